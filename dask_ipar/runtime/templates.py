"""Step templates: a submission's worker programs compiled once, replayed with new keys.

Its one job: :func:`submit_template` submits k steps of a model as worker programs
without building, compiling or pickling their graph again when an earlier submission
had the same shape. Building the step graph, turning it into programs and pickling them
was half of the client's CPU per step on a tiny MLP (``docs/benchmarks.md``, "Step
templates"), and unpickling a program a tenth of a worker's.

How: the step graph is built once in *template keys* (:mod:`dask_ipar.runtime.replay`:
the model's uid marked, steps 1 to k relative to the submission, step 0 the state it
starts from, mapped to the model's names at each replay whatever they are: the last
submission's, a lineage cut's; the batch blocks are inputs that come with the program),
compiled by
:func:`~dask_ipar.runtime.compiler.plan_programs` and pickled once per program. Each
submission with the same :func:`signature` (the number of steps; per step the batch's
shape and dtype and the optimizer with its rate; the layers and kinds of the weights and
momentum, and which of them are held in program results; the workers and the
engine) sends each worker the same bytes in a :class:`~dask_ipar.runtime.replay.Replay`
with the shift of its steps and its batch blocks. Only key names differ from a graph built
afresh: the same kernels, with the same arguments (the learning rate is part of the
signature), in the same order per worker, on the same blocks; the floats are equal bit for
bit (``tests/test_templates.py``).

Templates are used for the ``programs`` executor with SGD, Adam and AdamW (Adam's update
count, different every step, is a block per cell and step that comes with each replay,
as the batch does: ``(optim.t-<tuid>-s<r>, i, j)``), batches small enough to travel inside
the programs (``Model.embed_bytes``; larger ones are scattered to the workers), NumPy
blocks, and after the first submission (which creates the momentum). The dask config key
``dask-ipar.program-templates`` (default True) turns them off.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass

import dask
import numpy as np
from dask._task_spec import TaskRef

from dask_ipar.layout.partition import split_bounds
from dask_ipar.nn.graph import StepGraph
from dask_ipar.runtime.placement import add_sent_bytes, input_copies, placement_blocks
from dask_ipar.runtime.compiler import ahead_pairs, pack_program, plan_programs
from dask_ipar.runtime.programs import pick, run_program
from dask_ipar.runtime.replay import Rekey, Replay, template_uid

__all__ = ["StepTemplate", "Submitted", "submit_template", "signature", "templates_enabled",
           "MAX_TEMPLATES"]

#: Templates a model's executor keeps (the least recently used go): a run alternates
#: between a few (full submissions, an epoch's shorter last one, after a drain).
MAX_TEMPLATES = 8


def templates_enabled() -> bool:
    """The dask config key ``dask-ipar.program-templates`` (default True)."""
    return bool(dask.config.get("dask-ipar.program-templates", True))


@dataclass
class _Prog:
    """One program of a template: where it runs and what its dask task gets."""

    prefix: str  # its task key is (f"{prefix}-{tag}", n)
    n: int
    worker: str
    blob: bytes
    inputs: list  # template keys of its dask arguments (blocks with tasks of their own)
    sources: list  # groups of template keys held in one earlier program's result each
    given: list  # template keys of the batch blocks that come with it
    prev: int | None  # a second phase: the index of the first


@dataclass
class StepTemplate:
    """A submission's programs in template keys (see the module)."""

    tid: str
    tuid: str
    k: int
    progs: list
    w0: list  # the weight and momentum names it starts from (template names)
    v0: list
    w: list  # the names after its last step
    v: list
    keys: list  # outputs with tasks: new momentum blocks, then the loss statistics
    n_state: int  # how many of ``keys`` are momentum blocks
    owner: dict  # output key -> index of the program making it
    left: dict  # new weight key -> index of the program holding it
    orphans: list  # indices of programs no output depends on
    pushed: dict  # new weight key -> the workers it is pushed to ahead (``ahead``)


@dataclass
class Submitted:
    """What :func:`submit_template` submitted, in the submission's keys."""

    futures: list  # of the momentum blocks, then of the loss statistics
    left: dict  # new weight key -> future of the program holding it
    state: list  # keys of the momentum blocks: the first ``len(state)`` of ``futures``
    w: list
    v: list
    pushed: dict  # new weight key -> the workers it is pushed to ahead


def _role(name) -> str:
    """State name ``name`` as the signature sees it: its layer and kind (``"dense0.w"``).
    Where the name comes from (the last submission's step, a lineage cut, the momentum's
    first step) does not matter: a template maps its state names one by one."""
    return name.split("-", 1)[0]


def signature(model, batches, ahead=False):
    """What a submission's template depends on beyond its steps' numbers, or None where
    templates do not apply (see the module)."""
    from dask_ipar.optim import SGD, Adam, AdamW

    ex = model._executor
    if (not templates_enabled() or ex is None or not ex.leaves_in_programs
            or ex.client is not model.client or ex.name != model.executor
            or model.block_module is not None):
        return None
    w, v = model._w, model._v
    if w is None or v is None or any(n is None for n in (*w, *v)):
        return None  # the first submission (it creates the momentum); layers without state
    engine, store = model.engine, model._store
    copies = input_copies(engine)
    specs = []
    for Xb, yb, opt in batches:
        if (type(opt) not in (SGD, Adam, AdamW) or type(Xb) is not np.ndarray
                or (yb is not None and type(yb) is not np.ndarray)
                or Xb.nbytes * copies > model.embed_bytes):
            return None
        specs.append((Xb.shape, Xb.dtype.str, None if yb is None else (yb.shape, yb.dtype.str),
                      opt))
    cells = model.binding.grid.cells()
    names = tuple(_role(n) for n in (*w, *v))
    if len(set(names)) != len(names):  # a layer with two blocks of one kind: not named apart
        return None
    held = tuple(store.held_key((n, i, j)) is not None for n in (*w, *v) for i, j in cells)
    sent = tuple(store.sent_to((n, i, j)) for n in w for i, j in cells)
    workers = tuple(model.binding.worker(i, j) for i, j in cells)
    return (engine, tuple(specs), names, held, sent, bool(ahead), workers, str(model.dtype),
            model.embed_bytes, ex.program_timeout_s)


def _counts(engine, batches, t0: int, tuid: str) -> dict:
    """The update count of each Adam step of ``batches`` per cell, under template keys: the
    state's count ``t0`` before the submission plus the step's."""
    out = {}
    for r, (_, _, opt) in enumerate(batches, 1):
        if opt.name in ("adam", "adamw"):
            for i, j in engine.grid.cells():
                out[(f"optim.t-{tuid}-s{r}", i, j)] = int(t0 + r)  # as a fresh graph passes it
    return out


def _batch_blocks(engine, Xb, yb, step: int, tuid: str) -> dict:
    """The blocks of one step's batch per cell, under template keys (as
    :func:`~dask_ipar.runtime.placement.place_batch` places them, labels as blocks)."""
    if engine.in_process:  # in-process workers would hold the caller's memory
        Xb = np.array(Xb, copy=True)
        yb = None if yb is None else np.array(yb, copy=True)
    bounds = split_bounds(Xb.shape[0], engine.grid.pc)
    blocks, _ = placement_blocks(engine, Xb, f"input.x-{tuid}-s{step}", bounds)
    if yb is not None:
        for i, j in engine.grid.cells():
            b0, b1 = bounds[j]
            blocks[(f"input.y-{tuid}-s{step}", i, j)] = yb[b0:b1]
    return blocks


def _build(model, batches, bundle, ahead=False) -> StepTemplate:
    """The template of a submission of ``batches`` (built, compiled, pickled)."""
    engine, store = model.engine, model._store
    tuid = template_uid(model.uid)
    teng = copy.copy(engine)  # the same engine naming template keys
    teng.uid = tuid
    if engine.front is not None:
        teng.front = copy.copy(engine.front)
        teng.front.uid = tuid
    prev = model._step
    state = [*model._w, *model._v]
    names = [f"{_role(n)}-{tuid}-s0" for n in state]  # unique: see signature
    w0, v0 = names[: len(model._w)], names[len(model._w):]
    cells = model.binding.grid.cells()
    cell_of = {model.binding.worker(i, j): (i, j) for i, j in cells}
    g, w, v, stats, given = StepGraph(), w0, v0, [], []
    fresh_w, fresh_v = w0, []
    w_last = w
    for r, (Xb, yb, opt) in enumerate(batches, 1):
        w_last = w
        xname, yname = f"input.x-{tuid}-s{r}", f"input.y-{tuid}-s{r}"
        given += [(xname, i, j) for i, j in cells]
        x_keys = {(i, j): TaskRef((xname, i, j)) for i, j in cells}
        y_keys = None
        if yb is not None:
            given += [(yname, i, j) for i, j in cells]
            y_keys = {(i, j): TaskRef((yname, i, j)) for i, j in cells}
        t = r
        if opt.name in ("adam", "adamw"):  # the count comes with each replay
            given += [(f"optim.t-{tuid}-s{r}", i, j) for i, j in cells]
            t = (lambda r: lambda worker: TaskRef((f"optim.t-{tuid}-s{r}", *cell_of[worker])))(r)
        g, w_new, v_new, st = teng.train_step(
            x_keys, y_keys, Xb.shape[0], w, v, r, opt.lr, getattr(opt, "momentum", 0.0),
            opt.weight_decay, g=g, optimizer=opt, t=t)
        stats.append(st)
        fresh_w, fresh_v = w_new, [n for n in v_new if n not in v0]
        w, v = w_new, v_new
    k = len(batches)
    w_keys = [(n, i, j) for n in fresh_w for i, j in cells]
    keys = [(n, i, j) for n in fresh_v for i, j in cells]
    flat = bundle(g, teng, stats, k) if k > 1 else stats[0]
    now = Rekey(tuid, model.uid, prev, _fixed(names, state))  # this submission's keys
    ex = model._executor
    plan = plan_programs(g, keys + flat, store.locate, f"{tuid}-s1", ex.program_timeout_s,
                         first=flat if k == 1 else (), held=lambda d: store.held_key(now.key(d)),
                         leave=w_keys, given=given,
                         ahead=ahead_pairs(w_last, fresh_w, cells) if ahead else None,
                         sent=lambda d: store.sent_to(now.key(d)))
    index = {p.key: n for n, p in enumerate(plan.programs)}
    progs = [_Prog(p.key[0].split("-", 1)[0], p.key[1], p.worker, pack_program(p), list(p.inputs),
                   [list(s) for s in p.sources], list(p.given), plan.prev.get(p.key))
             for p in plan.programs]
    return StepTemplate(
        tid=uuid.uuid4().hex, tuid=tuid, k=k, progs=progs, w0=w0, v0=v0, w=w, v=v,
        keys=keys + list(flat), n_state=len(keys),
        owner={o: index[plan.owner[o]] for o in [*keys, *flat]},
        left={o: index[pk] for o, pk in plan.left.items()},
        orphans=[index[pk] for pk in plan.orphans], pushed=dict(plan.ahead))


def _fixed(names, state) -> dict:
    """Template state names -> the model's names now."""
    return dict(zip(names, state))


def _replay(model, tpl: StepTemplate, batches):
    """Submit ``tpl`` for ``batches`` (the next steps of ``model``); None when the model's
    state is not where the template expects it (nothing submitted then)."""
    store, engine = model._store, model.engine
    shift = model._step
    fixed = _fixed([*tpl.w0, *tpl.v0], [*model._w, *model._v])
    rk = Rekey(tpl.tuid, model.uid, shift, fixed)
    holders = []
    for p in tpl.progs:
        if any(store.held_key(rk.key(d)) is not None for d in p.inputs):
            return None
        hs = []
        for group in p.sources:
            h = {store.held_key(rk.key(d)) for d in group}
            if len(h) != 1 or None in h:
                return None
            hs.append(h.pop())
        holders.append(hs)
    blocks = {}
    for r, (Xb, yb, _) in enumerate(batches, 1):
        blocks.update(_batch_blocks(engine, Xb, yb, r, tpl.tuid))
    add_sent_bytes(model.uid, sum(b.nbytes for b in blocks.values()))
    blocks.update(_counts(engine, batches, store.opt[1], tpl.tuid))
    for _ in batches:
        model._next_step()
    tag = f"{model.uid}-s{shift + 1}"
    pkeys = [(f"{p.prefix}-{tag}", p.n) for p in tpl.progs]
    out = StepGraph()
    for n, (p, pkey, hs) in enumerate(zip(tpl.progs, pkeys, holders)):
        if p.prev is not None:
            args = [TaskRef(pkeys[p.prev])]
        else:
            args = [TaskRef(rk.key(d)) for d in p.inputs] + [TaskRef(h) for h in hs]
        replay = Replay(f"{tpl.tid}-{n}", p.blob, tpl.tuid, model.uid, shift, fixed, tag, pkey,
                        {d: blocks[d] for d in p.given})
        out.add(pkey, p.worker, run_program, replay, *args)
    keys = [rk.key(o) for o in tpl.keys]
    for o, key in zip(tpl.keys, keys):
        out.add(key, tpl.progs[tpl.owner[o]].worker, pick, TaskRef(pkeys[tpl.owner[o]]), key)
    left = {rk.key(o): pkeys[i] for o, i in tpl.left.items()}
    futs, held = model._executor.run(out.to_hlg(f"step-{model.uid}-s{shift + 1}"), keys,
                                     [pkeys[i] for i in tpl.orphans], left)
    return Submitted(futs, held, keys[: tpl.n_state],
                     [rk.name(n) for n in tpl.w], [rk.name(n) for n in tpl.v],
                     {rk.key(o): dests for o, dests in tpl.pushed.items()})


def submit_template(model, batches, bundle, ahead=False) -> Submitted | None:
    """Submit ``batches`` (``(Xb, yb, optimizer)`` per step) from the template of their
    :func:`signature`, built now when the model's executor has none; None where templates
    do not apply or the model's state does not match (the caller builds the graph then).
    ``bundle(g, engine, stats, last)``: the loss statistics of several steps as one block
    per worker (:func:`dask_ipar.runtime.steps._bundle_stats`); ``ahead``: push the new
    weights ahead (:func:`dask_ipar.runtime.steps.submit_steps`)."""
    sig = signature(model, batches, ahead)
    if sig is None:
        return None
    cache = model._executor.templates
    tpl = cache.get(sig)
    if tpl is None:
        tpl = cache[sig] = _build(model, batches, bundle, ahead)
        while len(cache) > MAX_TEMPLATES:
            cache.popitem(last=False)
    else:
        cache.move_to_end(sig)
    return _replay(model, tpl, batches)

