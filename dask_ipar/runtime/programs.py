"""Worker programs: a step's task graph run as one dask task per worker and phase.

With ``Model.executor = "programs"`` the engine builds the same step graph as always
(:class:`~dask_ipar.nn.graph.StepGraph`: the same kernels, arguments and placement), and
:func:`~dask_ipar.runtime.compiler.compile_programs` turns it into *programs*, dask tasks that run the tasks placed on
their worker themselves: per worker one for the forward pass up to the loss statistics,
and one for the rest of the step (backward and update), so that the loss arrives, and the
client sends the next batch, while the backward runs. A block that a task on another worker reads is
pushed to that worker as soon as it exists, once per worker, over a handler that
:class:`~dask_ipar.runtime.exchange.ExchangePlugin` adds to every worker (the mechanism of dask's P2P shuffle):
the blocks that move and their senders are the ones dask moves in the task-graph
executor, so the cost model's prediction holds unchanged, and each transfer is logged on
its sender and read by :class:`dask_ipar.runtime.meter.CommMeter` like dask's own transfer logs.

Why: dask's scheduler spends about half a millisecond of CPU per task on a small machine
(``docs/benchmarks.md``, target 2); a 2x2 step has 20 tasks per layer as a task graph
and two tasks per worker as programs (plus one small task per output block).

What the scheduler sees: per worker and step a task ``step.run0-<uid>-s<step>`` that
depends on the blocks the worker already holds (weights, momentum, a scattered batch;
the weights made by the previous submission: the programs that made them, whose results
hold them), a task ``step.run1-<uid>-s<step>`` that depends on it alone (it takes over
the blocks the first leaves for it, on the same worker), and one task per output block
(new momentum, loss statistics) that picks it out of a program's result, under the key
the task graph would give it. New weights (``leave``) get such a task only when
something else reads them (:meth:`~dask_ipar.runtime.state.BlockStore.materialize`).
Everything else (the
per-layer tasks, the worker-to-worker blocks) happens inside the programs: the dashboard
shows one bar per worker and step (its "Fine Performance Metrics" page splits the
programs' time by layer and phase, and the time spent waiting for blocks), and the
transfers are in the worker's own log, not in dask's.

Order and progress: every worker runs its tasks in one global order of the step's graph
(the order the engine built them in, dependencies first; the first phase's tasks depend
on first-phase tasks only), picking at each point the first task whose blocks have all
arrived. Sends never wait for the receiver, so the
first unfinished task of that global order can always run once its blocks arrive: the
programs cannot deadlock. (Blocks held for later steps keep this: a step's tasks read
blocks of that step and earlier ones only, which :func:`~dask_ipar.runtime.compiler.compile_programs` checks before it
lets any block wait.) A program that fails tells the other workers, whose waiting
programs then fail with its message instead of waiting; a waiting program also gives up
after ``timeout_s`` without any new block, and
:func:`~dask_ipar.runtime.exchange.abort_programs` stops the programs
of a model (the model calls it when a grid worker has left).

Small blocks: blocks under :data:`~dask_ipar.runtime.exchange.MERGE_BYTES` (16 KiB) that
a program sends to one peer without computing in between, or while it runs one layer and
phase, travel as one message (a tiny 2x2 MLP's step: 144 messages instead of 180); the
bytes, and so the cost model's prediction, are unchanged. Tasks that ran shorter than
:data:`QUICK_S` in an earlier step of the program do not end that: the blocks wait for
the next longer task, a wait for blocks, or the program's end (the tiny MLP with 16 steps
per program: about 9.5 messages per worker and step instead of 12). In a program of several steps,
small blocks that only later steps read (the updated weight slices the peers gather for
the next step) are held until the program has run its tasks of their step, so those of
every layer go as one message per peer (:class:`~dask_ipar.runtime.sender.Sender`).

In-place updates: a task that rewrites one of its inputs (:data:`MUTATES`: the fused SGD
update, halo and gradient sums) first waits until every send of that input has been
written to the network, so no peer can receive a half-updated block.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import time
from dataclasses import dataclass, field

from dask._task_spec import Task

from dask_ipar.dashboard.recorder import recorder
from dask_ipar.nn.graph import span_of_name
from dask_ipar.runtime.collector import collector_paused
from dask_ipar.runtime.exchange import plugin_of
from dask_ipar.runtime.sender import Sender

__all__ = ["Program", "run_program", "pick", "step_of", "kernel_cpu", "kernel_system_cpu",
           "thread_system_time", "count_cost_s", "MUTATES", "DEFAULT_TIMEOUT_S", "QUICK_S"]

#: Seconds a program waits without receiving any block before it gives up.
DEFAULT_TIMEOUT_S = 300.0
#: Seconds of waiting after which a program leaves its worker's thread pool (``secede``),
#: so that other tasks (a recovery's, another model's) can run meanwhile.
SECEDE_AFTER_S = 2.0
#: A task that ran this briefly the last time (an earlier step of the same program) does
#: not make the program send the small blocks it holds back first: they wait for the next
#: longer task, a wait for blocks, or the program's end (:meth:`Sender.phase`).
QUICK_S = 5e-4


#: This process's programs' CPU time per kernel while :func:`kernel_cpu` has it on
#: (``{(task, function): [seconds, calls]}``), else None: nothing measured.
_KERNEL_CPU: dict | None = None
#: Of it, the kernels' time in the operating system's kernel while :func:`kernel_cpu` was
#: switched on with ``system=True`` (``{(task, function): seconds}``), else None.
_KERNEL_SYSTEM: dict | None = None


def kernel_cpu(on: bool | None = None, system: bool = False) -> dict | None:
    """The CPU time (``time.thread_time``: not the turns other processes take on the core)
    of the kernels this worker's programs ran, ``{"<task>:<function>": (seconds, calls)}``
    with ``<task>`` the key's task name (``act``, ``bwd``, ``dxp``, ...), and
    ``"program:push"`` for handing the blocks to the transports, ``"program:wait"`` for
    the sends released and the blocks read before and while a program waits (the direct
    links' reads, where the waiting program reads them), ``"program:phase"`` for the sends
    released between tasks, ``"program:start"`` for a program's setup before its first
    task and ``"program:run"`` for the whole program (so the loop's own work is
    ``run`` less ``start``, the kernels and the other three), since the accounting was
    switched on; None while it is off (the default). ``on``: True starts it from zero,
    False stops it (what it counted is returned). Run it on the workers
    (``client.run(kernel_cpu, True)``): ``benchmarks/kernel_cpu.py`` sets each kernel's
    CPU in real steps beside the step model's price of it. ``system`` (with ``on=True``):
    also each kernel's time in the operating system's kernel (page faults, the network
    stack's work for packets that come while it runs), :func:`kernel_system_cpu`; a
    second clock read a call."""
    global _KERNEL_CPU, _KERNEL_SYSTEM
    if on and system:
        import resource

        if not hasattr(resource, "RUSAGE_THREAD"):
            from dask_ipar.errors import IparError

            raise IparError("kernel_cpu(system=True): a thread's system time is not "
                            "readable on this platform (no RUSAGE_THREAD: Linux only).")
    got = None if _KERNEL_CPU is None else {
        f"{t}:{f}": (v[0], v[1]) for (t, f), v in _KERNEL_CPU.items()}
    if on is not None:
        _KERNEL_CPU = {} if on else None
        _KERNEL_SYSTEM = {} if on and system else None
    return got


def kernel_system_cpu() -> dict | None:
    """Of :func:`kernel_cpu`'s kernels' CPU, the seconds each spent in the operating
    system's kernel (``{"<task>:<function>": seconds}``; the thread's ``RUSAGE_THREAD``
    system time, which Linux splits from the thread's CPU time by sampling at its ticks:
    exact only over many calls) since the accounting was switched on with ``system=True``;
    None otherwise. Read it before :func:`kernel_cpu` switches the accounting off."""
    if _KERNEL_SYSTEM is None:
        return None
    return {f"{t}:{f}": v for (t, f), v in _KERNEL_SYSTEM.items()}


def thread_system_time() -> float | None:
    """The calling thread's CPU seconds in the operating system's kernel (``RUSAGE_THREAD``;
    None where a thread's is not readable: Linux only). For a thread that makes no system
    calls, as a kernel's, that is the network stack's work for the packets that come while
    it runs, and page faults."""
    import resource

    who = getattr(resource, "RUSAGE_THREAD", None)
    return None if who is None else resource.getrusage(who).ru_stime


def _count_cpu(counts, task, func, c0):
    entry = counts.setdefault((task, func), [0.0, 0])
    entry[0] += time.thread_time() - c0
    entry[1] += 1


def count_cost_s(calls: int = 2000) -> float:
    """Seconds of one count of :func:`kernel_cpu`'s accounting outside what it counts: a
    read of the thread's CPU clock (``time.thread_time``, a system call: 3 us on this
    machine's KVM guest) and the entry's update."""
    scratch: dict = {}
    t = time.perf_counter()
    for _ in range(calls):
        _count_cpu(scratch, "t", "f", 0.0)
    return (time.perf_counter() - t) / calls


def _mutating_kernels() -> frozenset:
    from dask_ipar.kernels import adam as KA
    from dask_ipar.kernels import dense as K
    from dask_ipar.kernels.blocks import add_rows, sum_pieces

    return frozenset({K.sgd_update, K.sgd_velocity, K.nesterov_update, KA.adam_update,
                      KA.adam_state, sum_pieces, add_rows})


#: Kernels that may write into one of their input blocks (only through a key they read:
#: a block held for sending is flushed before a task reading its key rewrites it).
MUTATES: frozenset = _mutating_kernels()


@dataclass
class Program:
    """The tasks of one worker in one step graph, with what it sends and receives."""

    tag: str  # "<uid>-s<step>": names the step for aborts and error messages
    worker: str
    peers: tuple  # every worker with a program in this step
    nodes: list  # [(key, Task | DataNode)] in the global order
    inputs: list  # keys this worker already holds (values given as the task's arguments)
    sends: dict  # key -> [worker, ...] to push it to as soon as it exists
    remote: dict  # key -> worker it comes from
    outputs: list  # keys the program returns
    uses: dict = field(default_factory=dict)  # key -> local readers (to drop values early)
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: keys taken from the result of this worker's first program (its only argument)
    carried: list = field(default_factory=list)
    #: the program's own task key (what dask's task stream names it by)
    key: tuple = ()
    #: keys this worker holds in the results of earlier programs: per such program (its
    #: result comes as an argument after those of ``inputs``) the keys taken from it
    sources: list = field(default_factory=list)
    #: sent keys whose readers all belong to later steps -> the key's step: small ones
    #: are held until this program's tasks of that step are done (:class:`Sender`)
    later: dict = field(default_factory=dict)
    #: keys whose blocks come with the program itself (a replayed template's batch)
    given: list = field(default_factory=list)


def step_of(key) -> int:
    """The step of a key ``("<layer>.<task>-<uid>-s<step>", ...)``; -1 for other keys."""
    if not (isinstance(key, tuple) and key and isinstance(key[0], str)):
        return -1
    _, sep, tail = key[0].rpartition("-s")
    return int(tail) if sep and tail.isdigit() else -1


@functools.lru_cache(maxsize=1024)
def _meter_label(layer_task: str) -> str:
    """The fine performance metrics' label of a task named ``"<layer>.<task>-..."`` (given
    without the step: ``"dense1.act"``): its layer and phase."""
    return " ".join(span_of_name(layer_task)["name"][1:])


def _same(x):
    return x


def pick(result: dict, key):
    """Output ``key`` of a program's result."""
    return result[key]


# ------------------------------------------------------------------ worker side
class _Ready:
    """Which of a program's tasks ``nodes`` (in the global order) can run: a count of the
    blocks each still lacks, and a heap of those lacking none, so that the first ready
    task in order is found in O(log n) instead of a scan of every task left."""

    def __init__(self, nodes, env):
        self.lacking, self.waiters = [], {}  # task -> count; block -> [tasks reading it]
        self.heap, self.done = [], [False] * len(nodes)
        for n, (_, node) in enumerate(nodes):
            lack = [d for d in node.dependencies if d not in env]
            for d in lack:
                self.waiters.setdefault(d, []).append(n)
            self.lacking.append(len(lack))
            if not lack:
                self.heap.append(n)  # in order: already a heap

    def copy(self) -> "_Ready":
        """A fresh copy (a replayed template's runs start from the same state)."""
        new = _Ready.__new__(_Ready)
        new.lacking, new.waiters = list(self.lacking), dict(self.waiters)
        new.heap, new.done = list(self.heap), list(self.done)
        return new

    def pop(self) -> int:
        n = heapq.heappop(self.heap)
        self.done[n] = True
        return n

    def arrived(self, keys) -> None:
        """Blocks ``keys`` exist now (computed here or received): their readers lack less."""
        for k in keys:
            for n in self.waiters.pop(k, ()):
                self.lacking[n] -= 1
                if not self.lacking[n]:
                    heapq.heappush(self.heap, n)


def run_program(prog: Program, *values):
    """Run ``prog`` on this worker: its tasks in order, blocks pushed and received.

    ``values`` are those of ``prog.inputs``, or (a second program) the result of the
    worker's first. Returns ``{key: value}`` of ``prog.outputs``. ``prog`` may also be a
    :class:`~dask_ipar.runtime.replay.Replay`: a template's program, run on its own keys,
    renamed into the submission's wherever a block leaves or enters it. Python's cycle
    collector is paused while it runs (:mod:`dask_ipar.runtime.collector`).
    """
    with collector_paused():
        return _run(prog, *values)


def _run(prog, *values):
    # the accounting as the program starts, for all of it: a program is counted whole or
    # not at all (the accounting switched on or off while it runs)
    counts = _KERNEL_CPU
    if counts is None:
        return _run_program(None, prog, *values)
    c0 = time.thread_time()
    try:
        return _run_program(counts, prog, *values, system=_KERNEL_SYSTEM)
    finally:
        _count_cpu(counts, "program", "run", c0)


def _run_program(counts, prog, *values, system=None):
    from distributed import get_worker, rejoin, secede
    from distributed.metrics import context_meter

    c_start = time.thread_time() if counts is not None else 0.0

    opened = rk = None
    if isinstance(prog, bytes):  # as compile_programs sends it (:func:`~dask_ipar.runtime.compiler.pack_program`)
        from distributed.protocol.pickle import loads

        prog = loads(prog)
    elif not isinstance(prog, Program):  # a replayed template (:mod:`.replay`)
        replay = prog
        opened, rk = replay.open()
        prog = opened.prog
    R = _same if rk is None else rk.key  # the submission's key of a program's key
    N = _same if rk is None else rk.name
    # what the exchange, the peers and dask's task stream see: the submission's tag and keys
    view = prog if rk is None else dataclasses.replace(
        prog, tag=replay.tag, key=replay.key, remote={R(k): w for k, w in prog.remote.items()})
    worker = get_worker()
    plugin = plugin_of(worker)
    rec = recorder(worker)  # the dashboard's timeline (None: not installed)
    trace = []  # this program's kernels and waits, for dask's task stream at its end
    sender = Sender(plugin, worker, rec, tag=view.tag)
    if prog.carried:
        env = {k: values[0][R(k)] for k in prog.carried}
    else:
        env = dict(zip(prog.inputs, values))
        for keys, result in zip(prog.sources, values[len(prog.inputs):]):
            env.update((k, result[R(k)]) for k in keys)  # blocks an earlier program left
    if prog.given:
        env.update(replay.data)
    uses = dict(prog.uses)
    keep = set(prog.outputs)
    seceded = False
    waiting = set(view.remote)  # the submission's keys, as the mailbox has them
    back = None if rk is None else {R(k): k for k in prog.remote}
    spent: dict = {}  # fine performance metric label -> seconds, digested at the end
    quick: dict = {}  # "<layer>.<task>" -> whether it took under QUICK_S when last run

    def sent(key):
        """Drop a block that only other workers read once it is sent (the send holds it)."""
        if not uses.get(key) and key not in keep:
            env.pop(key, None)

    try:
        for k in [*prog.inputs, *prog.given, *(k for keys in prog.sources for k in keys)]:
            if k in prog.sends:
                sender.push(R(k), env[k], prog.sends[k], prog.later.get(k))
                sent(k)
        todo = prog.nodes
        if opened is None:
            ready = _Ready(todo, env)
            steps = [step_of(k) for k, _ in todo] if prog.later else None
        else:  # the same blocks at hand each run: the state computed once
            if opened.ready is None:
                opened.steps = [step_of(k) for k, _ in todo] if prog.later else None
                opened.ready = _Ready(todo, env)
            ready, steps = opened.ready.copy(), opened.steps
        head = 0
        if counts is not None:
            _count_cpu(counts, "program", "start", c_start)
        started = last = time.monotonic()
        left = len(todo)
        while left:
            while ready.done[head]:
                head += 1  # the first task in order not yet run
            if steps is not None and sender.held_before(steps[head]):
                sender.release_later(steps[head])  # this program's earlier steps are done
            got = plugin.take_ready(waiting)
            if got:
                waiting.difference_update(got)
                if back is not None:
                    got = {back[k]: v for k, v in got.items()}
                env.update(got)
                last = time.monotonic()
                ready.arrived(got)
            if not ready.heap:
                if rec is not None:  # what the first task in order waits for, and whom
                    due = next(d for d in todo[head][1].dependencies if d not in env)
                    rec.now("waiting", N(due[0]), prog.remote.get(due))
                    t0 = time.time()
                c0 = time.thread_time() if counts is not None else 0.0
                sender.release()  # small blocks held back go before this program idles
                t1 = time.perf_counter()
                try:
                    arrived = plugin.wait(view, waiting, started, last,
                                          None if seceded else SECEDE_AFTER_S)
                finally:  # an abort's or a timeout's wait counts too
                    spent["wait for blocks"] = spent.get("wait for blocks", 0.0) \
                        + time.perf_counter() - t1
                if counts is not None:  # the sends released, the blocks read
                    _count_cpu(counts, "program", "wait", c0)
                if rec is not None:  # the trace in the program's names (see program_done)
                    trace.append([due[0], "wait", t0, time.time()])
                    rec.add(N(due[0]), "wait", t0, trace[-1][3], prog.remote.get(due))
                if not arrived and not seceded:
                    secede()  # a long wait: free the thread for other tasks
                    seceded = True
                continue
            key, node = todo[ready.pop()]
            left -= 1
            last = time.monotonic()  # progress: a wait's timeout counts from its start
            deps = node.dependencies
            task = key[0].split("-", 1)[0]  # "<layer>.<task>"
            c0 = time.thread_time() if counts is not None else 0.0
            # small blocks held back go before another task, unless it ran short last time
            sender.phase(task, hold=quick.get(task, False))
            if isinstance(node, Task) and node.func in MUTATES:
                sender.flush(deps if rk is None else [R(d) for d in deps], view.tag)
            if counts is not None:
                _count_cpu(counts, "program", "phase", c0)
            if rec is not None:
                rec.now("computing", N(key[0]))
                t0 = time.time()
            c0 = time.thread_time() if counts is not None else 0.0
            s0 = thread_system_time() if system is not None else 0.0
            t1 = time.perf_counter()
            try:
                env[key] = value = node({d: env[d] for d in deps})
            finally:  # dask's fine performance metrics: each layer and phase's share
                took = time.perf_counter() - t1
                label = _meter_label(task)
                spent[label] = spent.get(label, 0.0) + took
                quick[task] = took < QUICK_S
            if counts is not None:
                name = (task.rsplit(".", 1)[-1],
                        getattr(getattr(node, "func", None), "__name__", None))
                _count_cpu(counts, *name, c0)
                if system is not None:
                    system[name] = system.get(name, 0.0) + thread_system_time() - s0
            if rec is not None:
                trace.append([key[0], "compute", t0, time.time()])
                rec.add(N(key[0]), "compute", t0, trace[-1][3])
            ready.arrived((key,))
            if key in prog.sends:
                c0 = time.thread_time() if counts is not None else 0.0
                sender.push(R(key), value, prog.sends[key], prog.later.get(key))
                if counts is not None:
                    _count_cpu(counts, "program", "push", c0)
                sent(key)
            for d in deps:
                uses[d] -= 1
                if uses[d] == 0 and d not in keep:
                    env.pop(d, None)
        c0 = time.thread_time() if counts is not None else 0.0
        sender.flush(tag=view.tag)
        if counts is not None:  # the last sends: the transports' work, as a push's
            _count_cpu(counts, "program", "push", c0)
        if rec is not None:
            rec.now("idle")
            rec.program_done(view.key, trace, None if rk is None else rk.name)
        return {R(k): env[k] for k in prog.outputs}
    except BaseException as exc:
        reason = f"{type(exc).__name__} on {worker.address}: {exc}"
        sender.abort_peers(view, reason)
        plugin.drop(list(waiting))
        plugin.abort(tag=view.tag, reason=reason)  # this worker's other program stops too
        if rec is not None:
            rec.now("idle", f"failed: {reason}")
        raise
    finally:
        try:
            for label, secs in spent.items():  # one digest per label, not one per task
                context_meter.digest_metric(label, secs, "seconds")
        finally:
            if seceded:
                rejoin()


