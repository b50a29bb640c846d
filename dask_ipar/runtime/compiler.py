"""Compiling a step graph into worker programs (:mod:`dask_ipar.runtime.programs`).

Its one job, on the client: :func:`plan_programs` splits a step graph's tasks by worker
and phase into :class:`~dask_ipar.runtime.programs.Program` objects (what each sends,
receives, takes as arguments and returns), and :func:`compile_programs` makes them dask
tasks, one per worker and phase, plus one task per output block that picks it out of its
program's result. What the programs do and why is the module docstring of
:mod:`dask_ipar.runtime.programs`; a step template compiles once and replays the programs
(:mod:`dask_ipar.runtime.templates`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dask._task_spec import TaskRef

from dask_ipar.errors import IparError
from dask_ipar.nn.graph import StepGraph
from dask_ipar.runtime.programs import DEFAULT_TIMEOUT_S, Program, pick, run_program, step_of

__all__ = ["Plan", "compile_programs", "plan_programs", "pack_program", "ahead_pairs"]


def _order(dsk: dict) -> list:
    """Keys of ``dsk`` with dependencies first, otherwise in insertion order."""
    index = {k: n for n, k in enumerate(dsk)}
    if all(index.get(d, -1) < n for k, n in index.items() for d in dsk[k].dependencies):
        return list(dsk)  # built dependencies first (the engine's graphs are)
    deps = {k: [d for d in node.dependencies if d in dsk] for k, node in dsk.items()}
    done, out = set(), []
    for root in dsk:
        if root in done:
            continue
        stack = [(root, iter(sorted(deps[root], key=index.get)))]
        while stack:
            key, it = stack[-1]
            nxt = next((d for d in it if d not in done), None)
            if nxt is None:
                stack.pop()
                if key not in done:
                    done.add(key)
                    out.append(key)
            else:
                stack.append((nxt, iter(sorted(deps[nxt], key=index.get))))
    return out


def _ancestors(dsk: dict, keys) -> set:
    """``keys`` and every key of ``dsk`` they depend on."""
    out, stack = set(), [k for k in keys if k in dsk]
    while stack:
        k = stack.pop()
        if k not in out:
            out.add(k)
            stack.extend(d for d in dsk[k].dependencies if d in dsk)
    return out


def compile_programs(g, outputs, locate, name: str, tag: str,
                     timeout_s: float = DEFAULT_TIMEOUT_S, first=(), held=None, leave=(),
                     ahead=None, sent=None):
    """The step graph ``g`` as program tasks per worker plus one task per output key.

    ``outputs``: keys the caller wants futures of (returned under the same keys);
    ``locate(key)``: the worker holding an existing key that ``g`` reads but does not
    compute. With ``first`` (keys of ``g``, e.g. the loss statistics) each worker runs two
    programs, one task per phase: the tasks that ``first`` depends on, then the others
    (whose dask task reads what the first left for it on the same worker), so that
    ``first`` is ready while the rest of the step runs. ``leave``: keys of ``g`` left in
    their program's result without a task of their own (the model's new weights: a later
    step's program takes them from there); ``held(key)``: the key of an earlier program
    whose result holds an existing key, or None (the key is a task's output). ``ahead``
    (``{key of leave: key of g}``): push each such key, as soon as it exists, to the workers
    that read the other key in ``g`` (the new weights to the workers that read the old ones:
    the next step's all-gather starts as each new slice exists); ``sent(key)``: the workers
    an existing key was pushed to ahead by an earlier program (not sent again). Returns
    ``(HighLevelGraph, program_keys, orphans, left, pushed)``: ``orphans`` are programs
    that no output depends on (they only send; request them too, or dask never runs them),
    ``left`` maps each key of ``leave`` to the program holding it (request those too),
    ``pushed`` each key of ``ahead`` to the workers it goes to.
    """
    plan = plan_programs(g, outputs, locate, tag, timeout_s, first, held, leave,
                         ahead=ahead, sent=sent)
    out = StepGraph()
    for prog, holders in zip(plan.programs, plan.holders):
        if prog.key in plan.prev:  # a second phase: the first's result
            args = [TaskRef(plan.programs[plan.prev[prog.key]].key)]
        else:
            args = [TaskRef(k) for k in [*prog.inputs, *holders]]
        out.add(prog.key, prog.worker, run_program, pack_program(prog), *args)
    for k in outputs:
        out.add(k, g.place[k], pick, TaskRef(plan.owner[k]), k)
    return out.to_hlg(name), [p.key for p in plan.programs], plan.orphans, plan.left, plan.ahead


@dataclass
class Plan:
    """What :func:`plan_programs` makes of a step graph: its :class:`Program` objects (with
    their dask keys), per program the keys of the earlier programs holding its ``sources``
    (one per group), which program makes each output, which program a second-phase
    program continues (``prev``: its key -> index of the first), the programs no output
    depends on (``orphans``), the program holding each key left in results
    (``left``), and the workers each key of ``ahead`` is pushed to (``ahead``)."""

    programs: list
    holders: list
    owner: dict
    prev: dict
    orphans: list
    left: dict
    ahead: dict = field(default_factory=dict)


def plan_programs(g, outputs, locate, tag: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                  first=(), held=None, leave=(), given=(), ahead=None, sent=None) -> Plan:
    """The programs of :func:`compile_programs` before they become dask tasks. ``given``:
    keys that ``g`` reads but that come with the program itself (a replayed template's
    batch blocks, :mod:`dask_ipar.runtime.templates`): not dask arguments."""
    missing = [k for k in list(outputs) + list(leave) if k not in g.dsk]
    if missing:
        raise IparError(f"output keys {missing[:3]} are not computed by the step graph.")
    given = set(given)
    order = _order(g.dsk)
    where = dict(g.place)
    early = _ancestors(g.dsk, first)
    phase = {k: 0 if (k in early or not early) else 1 for k in g.dsk}
    external: dict = {}
    sends: dict = {}  # (worker, phase) -> {key: [workers]}
    needs: dict = {}  # (worker, key) -> phases of that worker reading key
    uses: dict = {}  # (worker, phase) -> {key: readers}
    reader_step: dict = {}  # sent key -> the earliest step of a task reading it elsewhere
    readers: dict = {}  # key -> workers with a task reading it
    steps = {k: step_of(k) for k in order}
    stepped = min(steps.values(), default=0) >= 0  # every task's key names its step
    for key in order:
        w, p, step = where[key], phase[key], steps[key]
        for d in g.dsk[key].dependencies:
            if steps.get(d, -1) > step:  # not the rule holding for later needs
                stepped = False
            if d in g.dsk:
                src, sp = where[d], phase[d]
            else:
                if d not in external:
                    external[d] = locate(d)
                src, sp = external[d], 0  # an existing block: the first program holds it
            needs.setdefault((w, d), set()).add(p)
            readers.setdefault(d, set()).add(w)
            if src != w and (sent is None or d in g.dsk or w not in sent(d)):
                dests = sends.setdefault((src, sp), {}).setdefault(d, [])
                if w not in dests:
                    dests.append(w)
                reader_step[d] = min(reader_step.get(d, step), step)
            # the reader's program has the block: made there, received there, or left
            # by the first program (a block the first made, received or held)
            uses.setdefault((w, p), {}).setdefault(d, 0)
            uses[(w, p)][d] += 1
    pushed: dict = {}  # key of ``ahead`` -> the workers it goes to (for a later step)
    for new, old in (ahead or {}).items():
        src = where[new]
        dests = sorted(readers.get(old, set()) - {src})
        if dests:
            sends.setdefault((src, phase[new]), {})[new] = dests
            reader_step[new] = steps[new] + 1  # read by the next submission's step
            pushed[new] = tuple(dests)
    remote: dict = {}  # (worker, phase) -> {key: sender}
    carry: dict = {}  # worker -> keys the first program leaves for the second
    for (w, d), phases in needs.items():
        src = where.get(d, external.get(d))
        origin = phase.get(d, 0) if src == w else min(phases)
        if src != w:
            remote.setdefault((w, origin), {})[d] = src
        if 1 in phases and origin == 0:
            carry.setdefault(w, set()).add(d)
    workers = sorted(set(where.values()) | {w for w, _ in sends})
    plan = Plan([], [], {}, {}, [], {}, pushed)
    for n, w in enumerate(workers):
        inputs, gift, sources = [], [], {}  # program key -> keys of its result
        for d in sorted({d for d, src in external.items() if src == w}, key=str):
            pk = None if held is None or d in given else held(d)
            if d in given:
                gift.append(d)
            elif pk is None:
                inputs.append(d)
            else:
                sources.setdefault(pk, []).append(d)
        prev = None
        for p in (0, 1):
            nodes = [(k, g.dsk[k]) for k in order if where[k] == w and phase[k] == p]
            if p == 1 and not nodes:
                continue
            kept = sorted(carry.get(w, ()), key=str) if p == 0 else []
            prog = Program(
                tag=tag, worker=w, peers=tuple(workers), nodes=nodes,
                inputs=inputs if p == 0 else [],
                sources=list(sources.values()) if p == 0 else [],
                sends=sends.get((w, p), {}),
                remote=remote.get((w, p), {}),
                outputs=[k for k in list(outputs) + list(leave)
                         if where[k] == w and phase[k] == p] + kept,
                uses=uses.get((w, p), {}),
                timeout_s=timeout_s,
                carried=sorted(carry.get(w, ()), key=str) if p == 1 else [],
                given=gift if p == 0 else [],
            )
            if stepped:  # a task reads blocks of its own step and earlier ones only
                prog.later = {k: s for k in prog.sends
                              if (s := steps.get(k, step_of(k))) >= 0
                              and reader_step[k] > s}
            prog.key = (f"step.run{p if early else ''}-{tag}", n)
            if p == 1:
                plan.prev[prog.key] = prev
            plan.programs.append(prog)
            plan.holders.append(list(sources) if p == 0 else [])
            for k in prog.outputs:
                plan.owner[k] = prog.key
            prev = len(plan.programs) - 1
    # a program no output depends on (it only sends) would be culled by dask: the caller
    # must request it too (``orphans``)
    plan.left = {k: plan.owner[k] for k in leave}
    needed = {plan.owner[k] for k in outputs} | set(plan.left.values())
    needed |= {plan.programs[plan.prev[k]].key for k in list(needed) if k in plan.prev}
    plan.orphans = [p.key for p in plan.programs if p.key not in needed]
    return plan


def pack_program(prog: Program) -> bytes:
    """``prog`` pickled on the client: the scheduler forwards bytes to the worker instead
    of unpickling and pickling again each of the program's tasks (with several steps per
    program, the larger part of the scheduler's work per step)."""
    from distributed.protocol.pickle import dumps

    return dumps(prog, protocol=5)


def ahead_pairs(w_last, w_new, cells) -> dict:
    """``{new weight block: the block it replaces}`` of a submission's last step (names
    ``w_last`` before it, ``w_new`` after, per layer): the new blocks go to the workers
    that read the old ones (:func:`dask_ipar.runtime.steps.submit_steps` ``ahead``)."""
    return {(new, i, j): (old, i, j) for old, new in zip(w_last, w_new)
            if old is not None and new is not None for i, j in cells}
