"""Step-time prediction by simulating the engine's own task graph.

The alpha-beta phases of :mod:`dask_ipar.cost.model` count bytes exactly, but
on dask a step also pays a scheduler round trip for every dependent task and
runs one task at a time per worker. This module replays a step's task graph
(a plain list of tasks: worker, dependencies, flops, bytes) as a discrete-event
simulation:

* a task is ready ``hop_s`` after its last dependency is available on its
  worker (the scheduler learns of the finish and sends the task: dask's fixed
  batching intervals, measured by ``dask-ipar calibrate`` as alpha);
* a dependency held by another worker arrives ``latency_s + nbytes / bandwidth``
  after it finished, once per worker that needs it (as dask keeps a fetched key);
* each worker runs its ready tasks one at a time, in the order they became ready;
* compute takes ``flops / (flops_per_s * share)`` plus ``mem_bytes / mem_Bps``,
  where ``share = min(1, cores / workers)`` models worker processes that share
  fewer cores.

That event simulation is the latency view. The throughput view charges the
step's work to the cores the workers share: every task costs the cluster
``task_s`` (scheduler, worker and client work, calibrated with many small
tasks at once), every flop ``1 / cluster_flops_per_s`` (all workers computing
together), every byte of elementwise work ``1 / cluster_mem_Bps`` (all workers
at once, allocations included) and every transferred byte
``1 / cluster_bandwidth_Bps`` (all workers transferring at once).

The predicted step is the *sum* of the two views. The latency view is the dependency chain:
scheduler hops and the work on the chain, each task at its worker's share of the cores.
The throughput view is all of the step's work on the shared cores. Perfect overlap would
make the step their maximum; on dask with worker processes sharing few cores they barely
overlap (the chain's hops leave cores idle that the rest of the work cannot fill, since
most tasks wait on the same chain), and the sum is what the measurements follow
(docs/communication.md: within 15% on every grid of two MLPs on 4 workers and 2 cores,
where the maximum gives 0.52-0.64 of the measured steps). Both views are returned.

It never imports dask: the engine turns its graph into :class:`SimTask` values.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

__all__ = ["SimTask", "SimResult", "simulate_step", "simulate_programs", "fair_rates"]


@dataclass(frozen=True)
class SimTask:
    """One task of a step: where it runs, what it needs, what it costs."""

    key: object
    worker: str
    deps: tuple = ()
    flops: float = 0.0
    mem_bytes: float = 0.0  # bytes read and written by copies and elementwise work
    out_bytes: float = 0.0  # size of the result (what a remote consumer fetches)
    block_bytes: float = 0.0  # its largest array, read or written (the element-wise rate's)
    # its products' elements beyond a square product's (dask_ipar.kernels.cost_shapes.gemm;
    # the simulators price flops alone: dask_ipar.runtime.stepmodel adds the edge's)
    edge: float = 0.0
    # seconds of CPU around it on its worker beyond its own work (a worker program's loop:
    # Machine.program_task_cpu_s; simulate_programs only)
    cpu_s: float = 0.0
    # its kernel's kind (dask_ipar.kernels.costs.kernel_kind: "conv" for the conv front's
    # strided kernels, which simulate_programs' mem_s_per_B may price at a rate of their own)
    kind: str = ""


@dataclass
class SimResult:
    """Predicted step time and where it went."""

    seconds: float
    compute_s: dict = field(default_factory=dict)  # worker -> busy seconds
    transfer_bytes: float = 0.0
    critical_hops: int = 0
    latency_s: float = 0.0  # the event simulation's makespan
    throughput_s: float = 0.0  # the work on the shared cores (0 without task_s/cluster rates)
    critical_compute_s: float = 0.0  # work on the critical path, in both views


def simulate_step(tasks, *, flops_per_s, bandwidth_Bps, hop_s, latency_s=0.0, cores=None,
                  mem_Bps=5e9, available=None, task_s=0.0,
                  cluster_flops_per_s=None, cluster_mem_Bps=None,
                  cluster_bandwidth_Bps=None) -> SimResult:
    """Simulate one step; returns the time at which its last task finishes.

    Parameters
    ----------
    tasks : iterable of SimTask
        Every task of the step. Dependencies not among them are inputs in place at
        time 0: on worker ``w`` with ``nbytes`` if ``available[key] == (w, nbytes)``,
        else wherever they are needed.
    flops_per_s : float
        Matmul rate of one worker running alone.
    bandwidth_Bps, latency_s : float
        Worker-to-worker transfer of a dependency: ``latency_s + nbytes / bandwidth``.
    hop_s : float
        Scheduler round trip paid by every task after its inputs are ready.
    cores : int, optional
        Cores shared by the workers (default: one per worker).
    task_s, cluster_flops_per_s, cluster_mem_Bps, cluster_bandwidth_Bps : float, optional
        The throughput view's costs (module docstring); without them the result is
        the event simulation alone.
    """
    tasks = list(tasks)
    by_key = {t.key: t for t in tasks}
    workers = sorted({t.worker for t in tasks})
    share = 1.0 if cores is None else min(1.0, cores / max(len(workers), 1))
    rate = flops_per_s * share
    available = available or {}
    dependents: dict = {}
    missing = {}
    for t in tasks:
        inside = [d for d in t.deps if d in by_key]
        missing[t.key] = len(inside)
        for d in inside:
            dependents.setdefault(d, []).append(t.key)
    finish: dict = {}
    hops: dict = {}
    chain: dict = {}  # compute seconds on the path that made each task ready, and its own
    ready_at: dict = {}
    transfer = 0.0

    fetched: dict = {}  # (dependency, worker) -> (arrival, hops): one transfer each

    def arrival(dep, worker):
        nonlocal transfer
        if (dep, worker) in fetched:
            return fetched[(dep, worker)]
        got = 0.0, 0
        if dep in by_key:
            src = by_key[dep]
            if src.worker == worker:
                return finish[dep], hops[dep]
            transfer += src.out_bytes
            got = finish[dep] + latency_s + src.out_bytes / bandwidth_Bps, hops[dep]
        elif dep in available:  # an input in place at time 0 on some worker
            src_worker, nbytes = available[dep]
            if src_worker == worker:
                return got
            transfer += nbytes
            got = latency_s + nbytes / bandwidth_Bps, 0
        fetched[(dep, worker)] = got
        return got

    per_worker = {w: [] for w in workers}  # heap of (ready time, seq, key) per worker
    free_at = {w: 0.0 for w in workers}
    busy = {w: 0.0 for w in workers}
    seq = 0

    def make_ready(key):
        nonlocal seq
        t = by_key[key]
        times = [arrival(d, t.worker) for d in t.deps] or [(0.0, 0)]
        ready_at[key] = max(a for a, _ in times) + hop_s
        hops[key] = max(h for _, h in times) + 1
        inside = [d for d in t.deps if d in by_key]
        chain[key] = chain[max(inside, key=finish.get)] if inside else 0.0
        heapq.heappush(per_worker[t.worker], (ready_at[key], seq, key))
        seq += 1

    for t in tasks:
        if missing[t.key] == 0:
            make_ready(t.key)
    done = 0
    while done < len(tasks):
        # the worker whose next task can start earliest
        best = None
        for w, heap in per_worker.items():
            if heap:
                start = max(heap[0][0], free_at[w])
                if best is None or start < best[0]:
                    best = (start, w)
        if best is None:
            raise ValueError("the task graph has a cycle or a dependency that never runs")
        start, w = best
        _, _, key = heapq.heappop(per_worker[w])
        t = by_key[key]
        dur = t.flops / rate + t.mem_bytes / (mem_Bps * share)
        finish[key] = start + dur
        chain[key] += dur
        free_at[w] = finish[key]
        busy[w] += dur
        done += 1
        for child in dependents.get(key, ()):
            missing[child] -= 1
            if missing[child] == 0:
                make_ready(child)
    end = max(finish.values()) if finish else 0.0
    last = max(finish, key=finish.get) if finish else None
    bound = 0.0
    if task_s or cluster_flops_per_s:
        n_cores = cores or len(workers)
        bound = (len(tasks) * (task_s or 0.0)
                 + sum(t.flops for t in tasks) / (cluster_flops_per_s or flops_per_s * n_cores)
                 + sum(t.mem_bytes for t in tasks) / (cluster_mem_Bps or mem_Bps * n_cores)
                 + transfer / (cluster_bandwidth_Bps or bandwidth_Bps))
    # the work on the critical path is in both views: count it once
    overlap = chain.get(last, 0.0) if bound else 0.0
    return SimResult(seconds=end + bound - overlap, compute_s=busy, transfer_bytes=transfer,
                     critical_hops=hops.get(last, 0), latency_s=end, throughput_s=bound,
                     critical_compute_s=overlap)


def fair_rates(flows, capacity: float) -> list:
    """Max-min fair rates of ``flows`` (``(sender, receiver)`` pairs) over links that carry
    ``capacity`` bytes per second out of each sender and into each receiver: the rates
    rise together until a link is full; its flows keep that rate and the others rise on
    (progressive filling). Returns one rate per flow, in order."""
    users: dict = {}  # link ("out", w) or ("in", w) -> indices of its flows still rising
    for i, (src, dst) in enumerate(flows):
        users.setdefault(("out", src), set()).add(i)
        users.setdefault(("in", dst), set()).add(i)
    left = dict.fromkeys(users, float(capacity))
    rates = [0.0] * len(flows)
    while users:
        link = min(users, key=lambda k: left[k] / len(users[k]))
        share = left[link] / len(users[link])
        for i in users.pop(link):
            rates[i] = share
            for other in (("out", flows[i][0]), ("in", flows[i][1])):
                if other in users:
                    users[other].discard(i)
                    left[other] -= share
                    if not users[other]:
                        del users[other]
    return rates


def simulate_programs(tasks, *, flops_per_s, mem_Bps, bandwidth_Bps, latency_s, cores=None,
                      available=None, task_s=0.0, shared=1.0,
                      transfer_cpu_s_per_B=0.0, message_cpu_s=0.0, busy_bandwidth_Bps=None,
                      loaded_latency_s=None, start_cpu_s=0.0, background_cores=0.0,
                      trace=None, mem_s_per_B=None) -> SimResult:
    """Simulate one step run as worker programs (``Model.executor = "programs"``).

    No scheduler between tasks: each worker runs its own tasks, at each point the first
    one in the step's global order (the order of ``tasks``) whose inputs have all arrived,
    as :mod:`dask_ipar.runtime.programs` does. A result another worker reads is pushed to
    it when it exists, once per worker, as the programs' sender does: every block in
    flight at once, each a flow from its sender to its reader. A worker's link carries
    ``bandwidth_Bps`` out and ``bandwidth_Bps`` in (a host's link, limited each way), and
    the flows share them max-min fairly (:func:`fair_rates`, as TCP flows do: a receiver
    that three senders push to at once takes each at a third of its link); a block
    arrives ``latency_s`` after its last byte left. With ``cores`` and
    ``busy_bandwidth_Bps`` given, the links carry ``busy_bandwidth_Bps`` instead while as
    many tasks run as there are cores (the transports then wait for the cores: measured by
    ``dask-ipar calibrate`` as ``busy_exchange_Bps``). With ``loaded_latency_s`` given, a
    block that leaves while its sender's or its reader's link carries other blocks arrives
    that long after its last byte instead (it waits behind the bytes the links' queues hold:
    ``loaded_message_s``, a ping-pong beside an all-to-all).

    Running tasks share the ``cores`` (processor sharing: each runs at
    ``min(1, cores / running)`` of one core's speed, times ``shared`` when more than one
    runs: what the cores lose to each other, the cluster rate of ``dask-ipar calibrate``
    over the cores times the one-worker rate); a task alone takes
    ``task_s + cpu_s + flops / flops_per_s + mem_bytes / mem_Bps`` (``cpu_s``: its own,
    the program's loop around it), or with ``mem_s_per_B`` (a
    function of a task's ``block_bytes`` and ``kind``: the element-wise rate by the size of
    the arrays and the kernel's kind, :meth:`Machine.elementwise_s_per_B`)
    ``mem_bytes * mem_s_per_B(block_bytes, kind)`` for the last term.

    With ``cores`` given (workers that share a machine's cores), moving a block also costs
    the cores: ``transfer_cpu_s_per_B`` seconds per byte on the sender and on the receiver,
    from when it starts on the link (the transport's copies and system calls, which run as
    the bytes go; measured by ``dask-ipar calibrate``), and ``message_cpu_s`` per message on
    each end (a number, or a function of the message's bytes: the transport's fixed work
    per message, its framing, system calls and event-loop turns). Each worker's transfer work is one
    more runner in the processor sharing, beside its task, until it is done (``shared``
    applies to it as to tasks); the step ends when every task and every transfer's work is
    done.

    Also with ``cores`` given, dask's own work takes its share of them: ``start_cpu_s``
    seconds per worker from the step's start (what a submitted step costs the scheduler,
    the client and the workers' event loops outside the programs' loops: its dask tasks,
    its batch, its results, the programs' setup; added to each worker's transfer work),
    and ``background_cores`` in all, all along (the event loops' periodic work,
    heartbeats, dask's profiler, the scheduler's, while the workers compute): the tasks
    and transfers share ``cores - background_cores``. Both measured by ``dask-ipar
    calibrate`` (:mod:`dask_ipar.runtime.stepprobe`).

    Returns a :class:`SimResult` whose ``seconds`` is the step's makespan. ``trace``, a
    list, receives ``(worker, key, start, end)`` of every task (where a step's time goes).
    """
    tasks = list(tasks)
    by_key = {t.key: t for t in tasks}
    workers = sorted({t.worker for t in tasks})
    available = available or {}
    here: dict = {w: {} for w in workers}  # worker -> key -> arrival time
    pending = {w: [t.key for t in tasks if t.worker == w] for w in workers}
    readers: dict = {}  # key -> workers (other than its own) that read it
    for t in tasks:
        for d in t.deps:
            src = by_key[d].worker if d in by_key else available.get(d, (t.worker, 0))[0]
            if src != t.worker:
                readers.setdefault(d, set()).add(t.worker)
    transfer = 0.0
    # heap of (time, seq, (receiving worker, key)): a block arrives
    events: list = []
    seq = 0
    flows: list = []  # blocks on the links: [sender, receiver, key, bytes left, rate, latency]
    rated = True  # the flows' rates are those of the flows now in flight
    busy_links = False  # as many tasks run as there are cores: the links' busy rate
    per_byte = transfer_cpu_s_per_B if cores is not None else 0.0
    if cores is None or not message_cpu_s:
        per_message = None
    elif callable(message_cpu_s):
        per_message = message_cpu_s
    else:
        def per_message(_nbytes):
            return message_cpu_s
    comm = {}  # worker -> seconds of transfer work left (at full speed)
    if start_cpu_s < 0 or not 0 <= background_cores < (cores or float("inf")):
        raise ValueError(f"start_cpu_s {start_cpu_s!r}, background_cores {background_cores!r}: "
                         f"expected seconds >= 0, and cores >= 0 that leave some of the "
                         f"{cores} cores to the step")
    free = cores
    if cores is not None:
        if start_cpu_s:  # a submitted step's work outside the programs
            comm.update(dict.fromkeys(workers, float(start_cpu_s)))
        free = cores - background_cores

    def arrive(dst, key, at, latency):
        nonlocal seq
        heapq.heappush(events, (at + latency, seq, (dst, key)))
        seq += 1

    def latency_of(src, dst):
        """A block's latency: ``loaded_latency_s`` where its links already carry others."""
        if loaded_latency_s is not None and any(f[0] == src or f[1] == dst for f in flows):
            return max(latency_s, loaded_latency_s)
        return latency_s

    def send(key, src, nbytes, at):
        nonlocal rated, transfer
        for dst in sorted(readers.get(key, ())):
            transfer += nbytes
            for w in (src, dst) if (per_byte or per_message) else ():  # both ends' work
                comm[w] = comm.get(w, 0.0) + nbytes * per_byte \
                    + (per_message(nbytes) if per_message else 0.0)
            latency = latency_of(src, dst)
            if nbytes > 0:
                flows.append([src, dst, key, float(nbytes), 0.0, latency])
                rated = False
            else:
                arrive(dst, key, at, latency)

    for key, (src, nbytes) in available.items():  # inputs in place at time 0
        here.setdefault(src, {})[key] = 0.0
        if key in readers:
            send(key, src, nbytes, 0.0)
    running: dict = {}  # worker -> [key, remaining seconds at full speed]
    busy = {w: 0.0 for w in workers}
    now = 0.0

    def startable(w):
        got = here[w]
        for key in pending[w]:
            t = by_key[key]
            if all(d in got or (d not in by_key and d not in available) for d in t.deps):
                return key
        return None

    while any(pending.values()) or running or comm:
        for w in workers:
            if w not in running and pending[w]:
                key = startable(w)
                if key is not None:
                    pending[w].remove(key)
                    t = by_key[key]
                    work = task_s + t.cpu_s + t.flops / flops_per_s + (
                        t.mem_bytes / mem_Bps if mem_s_per_B is None
                        else t.mem_bytes * mem_s_per_B(t.block_bytes, t.kind))
                    running[w] = [key, work, now]
                    busy[w] += work
        if not running and not events and not comm and not flows:
            raise ValueError("the programs wait for a block that never comes")
        busy_now = busy_bandwidth_Bps is not None and cores is not None \
            and len(running) >= cores
        if busy_now != busy_links:
            busy_links, rated = busy_now, False
        if not rated:
            cap = busy_bandwidth_Bps if busy_links else bandwidth_Bps
            for f, r in zip(flows, fair_rates([(f[0], f[1]) for f in flows], cap)):
                f[4] = r
            rated = True
        n = len(running) + len(comm)
        speed = 1.0 if cores is None else min(1.0, free / max(n, 1))
        # what the cores lose to each other while more than one runs (the transports'
        # copies contend for the memory system too; the emulated sweeps fit better so)
        speed *= shared if n > 1 else 1.0
        t_done = min((now + r[1] / speed for r in running.values()), default=float("inf"))
        ends = {w: now + c / speed for w, c in comm.items()}
        t_done = min([t_done, *ends.values()])
        t_next = events[0][0] if events else float("inf")
        t_flow = min((now + f[3] / f[4] for f in flows), default=float("inf"))
        step_to = min(t_done, t_next, t_flow)
        if flows:
            left = []
            for f in flows:
                f[3] -= (step_to - now) * f[4]
                if f[3] <= 1e-6 * max(f[4], 1.0):  # its last byte left (a microsecond's)
                    arrive(f[1], f[2], step_to, f[5])
                    rated = False
                else:
                    left.append(f)
            flows[:] = left
        for r in running.values():
            r[1] -= (step_to - now) * speed
        for w, end in ends.items():
            comm[w] -= (step_to - now) * speed
            if end <= step_to:  # done (not left to a rounding remainder)
                del comm[w]
        now = step_to
        while events and events[0][0] <= now:
            _, _, (dst, key) = heapq.heappop(events)
            here[dst][key] = now
        for w in [w for w, r in running.items() if r[1] <= 1e-9]:
            key, _, start = running.pop(w)
            if trace is not None:
                trace.append((w, key, start, now))
            here[w][key] = now
            send(key, w, by_key[key].out_bytes, now)
    return SimResult(seconds=now, compute_s=busy, transfer_bytes=transfer, latency_s=now)
