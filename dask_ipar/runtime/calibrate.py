"""``dask-ipar calibrate``: measure alpha, bandwidth and compute rate on a live cluster.

What the engine pays, measured the way the engine pays it:

* ``alpha_s``: seconds per dependent hop between two workers with a tiny
  payload (a chain of pinned tasks alternating between two workers). On
  dask this is dominated by the scheduler round trip, not by the wire.
* ``bandwidth_Bps``: payload bytes per second of worker-to-worker transfers,
  fitted over several sizes from the workers' own transfer logs
  (duration = latency + bytes / bandwidth, least squares).
* ``flops_per_s``: the local matmul rate of one worker (the engine's kernels
  are matmuls, by the BLAS ``ipar.matmul`` picks), timed inside the task: the fastest of
  three readings, and no less than each worker's share of ``cluster_flops_per_s``.
* ``cluster_flops_per_s``: the matmul rate of all workers computing at once
  (worker processes that share cores get this together, not P times the above): the
  fastest of :data:`CLUSTER_ROUNDS` rounds of :data:`CLUSTER_REPEATS` matmuls each.
  These compute rates, the thin product's and the kernel mix's below are read in three
  groups spread over the calibration, as the transfer CPU beside computing is, each the
  fastest reading (:class:`~dask_ipar.runtime.rateprobe.RateReadings`; since session 59:
  back to back they once read the machine slow, the element-wise rate 7.4 GB/s against
  9.1 in the calibration before).
* ``gemm_edge_flops``: what a thin product costs beyond its flops, from the all-workers
  rate of a thin product (:data:`THIN`: 16 MiB of weights by 128 columns, a pure-batch
  grid's kind) beside the square one's (:func:`~dask_ipar.kernels.cost_shapes.gemm`; 8
  one-thread processes on 2 cores: 4096 x 4096 x 128 at 0.82 of 1024-cubed's rate with
  OpenBLAS and MKL alike, 88-96 flop-equivalents per element; this one at 0.89-0.93 on
  2 to 8 emulated hosts, 26-43).
* ``task_s``: seconds per task of one graph of many small pinned tasks spread
  over all workers (scheduler, worker and client work per task on the shared
  cores): the throughput cost that every task of a step pays.
* ``message_s``: one way of a 4-byte block from one worker program to another (half
  the median round trip of a ping-pong between two tasks over the programs' transport,
  no scheduler): what a remote input costs a step run as programs.
* ``round_s``: a graph of one small task per worker submitted and its results
  gathered: what a step run as programs pays once outside them.
* ``transfer_cpu_s_per_B``: CPU seconds a worker process spends per byte it sends or
  receives while every worker program pushes a large block to every other one at once
  over the programs' transport (the process's CPU, all of its threads; or, where more and
  readable (``/proc/stat``), each host's busy CPU less its CPU at rest): what moving blocks
  takes from the computing where workers share a machine's cores; each worker also
  computing, the computing threads' CPU taken off (a transport beside computing wakes less
  often and reads larger pieces: 0.43-0.54 ns a byte on 8 emulated hosts at 1 Gbit/s
  against 0.80-0.86 on idle cores); the median of :data:`BUSY_REPEATS` exchanges in groups
  spread over the calibration (since session 58: back to back they read one moment of the
  machine; six calibrations in a row, 4 emulated hosts at 10 Gbit/s: 0.39-0.54, now 0.44-0.49).
* ``stack_cpu_s_per_B``: in the same exchanges, the computing threads' time in the
  operating system's kernel (the network stack's work for the packets that come while they
  run: they make no system calls) over the bytes that crossed the transports; the median.
* ``bandwidth_Bps`` is raised to ``exchange_Bps`` where the fit reads lower (a link's
  share of an all-to-all bounds its rate from below; on one host's loopback the fit over
  dask's transfer logs read 132-264 MiB/s in some runs against 0.9-3 GB/s all-to-all).
* ``exchange_Bps``: from the same exchanges, the bytes per second one worker sends while
  every worker sends to every other (what a link gives a collective; below a pair's
  ``bandwidth_Bps`` where links share a switch or a host: 105 against 120 MB/s on 4
  emulated 1 Gbit/s hosts, 80 against 120 on 8).
* ``busy_exchange_Bps``: the same exchange while every worker also runs the kernel mix
  (:func:`~dask_ipar.runtime.linkprobe.busy_exchange`): a link's rate while a step's
  kernels fill the cores.
* ``loaded_message_s``: ``message_s`` while every worker pushes 32 MiB to every other
  (:func:`~dask_ipar.runtime.linkprobe.loaded_hop`): a small block behind the links' queues.
* ``direct_message_cpu_s``, ``message_cpu_s``: the transports' CPU per message on each
  end beyond the bytes' (framing, system calls, event-loop turns): all-to-all exchanges of
  4-byte blocks (small messages, written by the sending program itself over the direct
  links) and of 256 KiB blocks (large ones: the direct links' own threads, or dask's comms
  where the workers have no direct links). A step's
  all-to-all phases of mid-sized blocks pay it P - 1 times per worker on shared cores (8
  workers on 2 cores: an all-to-all of 4-byte blocks took 4 ms, 1.4 ns per byte at 256 KiB
  against 0.26 at 16 MiB).
* ``background_cores``: the CPU, in cores over the whole cluster, that the workers' other
  threads (event loops, heartbeats, dask's profiler), the scheduler and the client take
  while every worker computes; ``step_cpu_s``: the CPU per worker one submitted training step
  costs outside its programs' loops (its dask tasks, its scattered batch, its results,
  dask running each program), from real steps of a small network
  (:mod:`dask_ipar.runtime.stepprobe`). What dask itself takes from the cores where the
  workers share them. ``program_task_cpu_s``: from the same steps, the programs' own
  loops' CPU per task beyond the kernels and the transports.
* ``elementwise_Bps``: the step-time model's rate of the kernels' element-wise work (their
  counted memory passes, :mod:`dask_ipar.kernels.costs`): the engine's conv, pooling and
  dense kernels (:mod:`dask_ipar.runtime.kernelmix`) on one worker on 16 MiB blocks (that
  stream from memory), their time less their flops at ``flops_per_s`` (the fastest of
  :class:`Effort`'s ``mix_runs`` runs, as the matmul rate; the sweeps' 2-8 workers of a
  2-core AMD EPYC, sessions 49-51: 8.4-9.6 GB/s). ``conv_Bps``: the same from the mix's
  conv and pooling calls alone, each call timed (:func:`~dask_ipar.runtime.kernelmix.mix_rates`).

The result is a :class:`dask_ipar.cost.Machine`, written as a YAML machine
file that ``dask-ipar plan --machine`` and ``dask-ipar train --machine`` read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
from dask._task_spec import TaskRef

from dask_ipar.cost import Machine
from dask_ipar.kernels.cost_shapes import edge_flops
from dask_ipar.nn.graph import StepGraph
from dask_ipar.runtime.linkprobe import (
    BUSY_GROUPS,
    BUSY_REPEATS,
    LOADED_REPEATS,
    TRANSFER_REPEATS,
    TRANSFER_WARMUPS,
    BusyReadings,
    exchange_block,
    loaded_hop,
    message_cpu,
    program_hop,
    rest_cores,
    transfer_cpu,
)
from dask_ipar.runtime.rateprobe import (
    THIN,
    RateReadings,
    cluster_rate,
    mem_work,
    one_worker_flops,
)
from dask_ipar.runtime.stepprobe import PROBE_STEPS, background_cores, measurable, step_cpu

__all__ = ["calibrate", "program_hop", "edge_flops", "one_worker_flops", "Effort", "FULL",
           "QUICK", "CLUSTER_REPEATS", "CLUSTER_ROUNDS", "THIN"]

#: :data:`FULL`'s matmuls (1024-cubed) per worker in one round of the all-workers matmul
#: rate (``cluster_flops_per_s``), and its rounds (the fastest taken).
CLUSTER_REPEATS = 32
CLUSTER_ROUNDS = 3


@dataclass(frozen=True)
class Effort:
    """How much a calibration measures: its sizes and its repeats (each figure the median,
    or the fastest, of its repeats). :data:`FULL` is what ``dask-ipar calibrate`` runs;
    :data:`QUICK` (``--quick``) about 0.6 of its time (2 workers on 2 cores: 17 s against
    29 s), its figures noisier (the matmul rates on 512-cubed products scaled to 1024-cubed
    by the edge model, the transfers on 4 MiB blocks, 28 MiB a worker): a check that a
    cluster works end to end, not a machine file to plan large runs by."""

    sizes_mib: tuple = (4, 16, 64)
    hops: int = 40
    matmul_n: int = 1024
    tasks: int = 300
    block_mib: int = 16
    exchange_mib: int = 112  # the transfer CPU's exchanges: each worker sends at least this
    mix_repeats: int = 1
    mix_runs: int = 3
    cluster_repeats: int = CLUSTER_REPEATS
    cluster_rounds: int = CLUSTER_ROUNDS
    transfer_warmups: int = TRANSFER_WARMUPS
    transfer_repeats: int = TRANSFER_REPEATS
    busy_repeats: int = BUSY_REPEATS
    rate_groups: int = BUSY_GROUPS  # the compute rates' readings: 1 takes them back to back
    loaded_repeats: int = LOADED_REPEATS
    background_s: float = 1.0
    probe_steps: int = PROBE_STEPS


FULL = Effort()
QUICK = Effort(sizes_mib=(1, 4), hops=10, matmul_n=512, tasks=60, block_mib=4, exchange_mib=28,
               mix_repeats=1, mix_runs=1, cluster_repeats=32, cluster_rounds=2,
               transfer_warmups=1, transfer_repeats=2, busy_repeats=1, loaded_repeats=1,
               background_s=0.3, probe_steps=6)


def _tiny(*deps):
    return np.zeros(1)


def _payload(nbytes, seed):
    return np.full(nbytes // 8, float(seed))


def _consume(x):
    return float(x[0])


def _task_time(client, workers, n_tasks, tag):
    """Seconds per task of one graph of ``n_tasks`` small pinned tasks over ``workers``.

    Each task reads one small input from another worker, as the engine's do.
    """
    g = StepGraph()
    for k, w in enumerate(workers):
        g.add((f"calibrate.src-{tag}", k), w, _tiny)
    keys = []
    for t in range(n_tasks):
        k = t % len(workers)
        key = (f"calibrate.task-{tag}", t)
        g.add(key, workers[k], _tiny, TaskRef((f"calibrate.src-{tag}", (k + 1) % len(workers))))
        keys.append(key)
    start = time.perf_counter()
    client.gather(client.get(g.to_hlg(f"calibrate-tasks-{tag}"), keys, sync=False))
    return (time.perf_counter() - start) / n_tasks


def _round_time(client, workers, tag):
    """Seconds from submitting a graph of one small task per worker to holding their
    results: what a step run as worker programs pays once outside its programs."""
    g = StepGraph()
    keys = [(f"calibrate.round-{tag}", k) for k in range(len(workers))]
    for key, w in zip(keys, workers):
        g.add(key, w, _tiny)
    start = time.perf_counter()
    client.gather(client.get(g.to_hlg(f"calibrate-round-{tag}"), keys, sync=False))
    return time.perf_counter() - start


def _cluster_bandwidth(client, workers, nbytes, tag):
    """Bytes per second moved when every worker fetches a block from its neighbour at once."""
    g = StepGraph()
    keys = []
    n = len(workers)
    for k, w in enumerate(workers):
        g.add((f"calibrate.ring-{tag}", k), w, _payload, nbytes, k)
    for k, w in enumerate(workers):
        key = (f"calibrate.ringsink-{tag}", k)
        g.add(key, w, _consume, TaskRef((f"calibrate.ring-{tag}", (k + 1) % n)))
        keys.append(key)
    client.run(lambda dask_worker=None: dask_worker.transfer_incoming_log.clear(),
               workers=workers)
    client.gather(client.get(g.to_hlg(f"calibrate-ring-{tag}"), keys, sync=False))
    spans = [(e["start"], e["stop"]) for entries in client.run(_ring_log, workers=workers).values()
             for e in entries]
    return n * nbytes / (max(b for _, b in spans) - min(a for a, _ in spans))


def _ring_log(dask_worker=None):
    return [{"start": e["start"], "stop": e["stop"]} for e in dask_worker.transfer_incoming_log
            if any(str(k[0] if isinstance(k, tuple) else k).startswith("calibrate.ring")
                   for k in e["keys"])]


def _incoming(dask_worker=None):
    return [(e["duration"], list(e["keys"].items())) for e in dask_worker.transfer_incoming_log]


def _hop_time(client, a, b, hops, tag):
    g = StepGraph()
    prev = None
    for h in range(hops):
        key = (f"calibrate.hop-{tag}", h)
        g.add(key, a if h % 2 == 0 else b, _tiny, *([] if prev is None else [TaskRef(prev)]))
        prev = key
    t = time.perf_counter()
    client.gather(client.get(g.to_hlg(f"calibrate-hops-{tag}"), [prev], sync=False))
    return (time.perf_counter() - t) / hops


def calibrate(client, workers=None, *, dtype="float32", effort: Effort = FULL, log=None,
              **sizes) -> Machine:
    """Measure the alpha-beta machine of ``client``'s cluster (two workers, under a minute).

    Parameters
    ----------
    workers : list of str, optional
        Two worker addresses to measure between (default: the first two).
    dtype : str
        Dtype of the matmul rate and the word size of the result.
    effort : Effort
        Sizes and repeats: :data:`FULL` (the default) or :data:`QUICK`.
    **sizes
        Fields of :class:`Effort` that replace ``effort``'s (e.g. ``block_mib=2``;
        ``mix_repeats`` is the kernel mix's rounds per run for the element-wise rate, one
        round about 0.35 s of one core, three runs).
    """
    from dask_ipar.runtime.release import install_release
    from dask_ipar.runtime.workers import scheduler_workers

    e = replace(effort, **sizes)
    sizes_mib, hops, matmul_n, tasks, block_mib = (e.sizes_mib, e.hops, e.matmul_n, e.tasks,
                                                   e.block_mib)
    workers = list(workers or sorted(scheduler_workers(client)))
    if len(workers) < 2:
        from dask_ipar.errors import IparError

        raise IparError("calibration needs at least 2 workers to time transfers between them.")
    a, b = workers[:2]
    # its blocks (up to 64 MiB, on every worker) go back to the system once it ends
    install_release(client)
    tag = f"{time.time_ns():x}"
    log = log or (lambda *_: None)

    _hop_time(client, a, b, 6, tag + "w")  # warm the connections
    alpha = float(np.median([_hop_time(client, a, b, hops, f"{tag}{r}") for r in range(3)]))
    log(f"alpha (seconds per dependent hop between workers): {alpha * 1e3:.2f} ms")
    message = program_hop(client, a, b)
    log(f"message (one way, a 4-byte block between worker programs): {message * 1e3:.3f} ms")

    client.run(lambda dask_worker=None: dask_worker.transfer_incoming_log.clear(), workers=[b])
    pts = []
    for size in sizes_mib:
        for r in range(2):
            g = StepGraph()
            src = (f"calibrate.payload-{tag}", size, r)
            dst = (f"calibrate.sink-{tag}", size, r)
            g.add(src, a, _payload, size * 2**20, r)
            g.add(dst, b, _consume, TaskRef(src))
            client.gather(client.get(g.to_hlg(f"calibrate-bw-{tag}-{size}-{r}"), [dst],
                                     sync=False))
    for duration, keys in client.run(_incoming, workers=[b])[b]:
        nbytes = sum(n for k, n in keys if str(k[0] if isinstance(k, tuple) else k).startswith(
            "calibrate.payload"))
        if nbytes:
            pts.append((nbytes, duration))
    x = np.array([p[0] for p in pts], dtype=float)
    t = np.array([p[1] for p in pts], dtype=float)
    slope, _ = np.polyfit(x, t, 1) if len(set(x)) > 1 else (t.mean() / x.mean(), 0.0)
    bandwidth = float(1.0 / slope) if slope > 0 else float(x.sum() / t.sum())
    log(f"bandwidth (worker to worker payload): {bandwidth / 2**20:.0f} MiB/s")

    everyone = sorted(scheduler_workers(client))
    # the compute rates' first readings (the rest after the idle exchanges, and at the end)
    rates = RateReadings(client, everyone, a, dtype=dtype, matmul_n=matmul_n,
                         repeats=e.cluster_repeats, rounds=e.cluster_rounds,
                         mix_repeats=e.mix_repeats, mix_runs=e.mix_runs, tag=tag,
                         groups=e.rate_groups)
    mem = max(cluster_rate(client, everyone, f"{tag}m{r}", mem_work, block_mib * 2**20, 10)
              for r in range(2))
    log(f"memory (elementwise into fresh {block_mib} MiB arrays, all workers at once): "
        f"{mem / 1e9:.1f} GB/s")
    # the steady state a run's exchanges see: the first exchanges of a size cost up to 5x
    # the CPU a byte of later ones (fresh memory; 8 emulated hosts: 3.1, 2.3 ns/B, 0.5-1.2)
    rest = rest_cores(client, everyone)
    log("hosts' CPU at rest (nothing submitted): " + (", ".join(
        f"{h} {c:.3f} cores" for h, c in sorted(rest.items())) or "not readable here"))
    xfer = exchange_block(len(everyone), block_mib * 2**20, e.exchange_mib * 2**20)
    for _ in range(e.transfer_warmups):
        transfer_cpu(client, everyone, xfer, rest)
    beside = BusyReadings(client, everyone, xfer, rest, e.busy_repeats)  # after the rates
    cluster_bw = bandwidth
    if len(everyone) > 2:
        _cluster_bandwidth(client, everyone, 2**20, f"{tag}bw")
        cluster_bw = float(np.median([_cluster_bandwidth(client, everyone, block_mib * 2**20,
                                                         f"{tag}b{r}") for r in range(5)]))
    log(f"bandwidth (every worker fetching {block_mib} MiB at once): "
        f"{cluster_bw / 2**20:.0f} MiB/s in all")
    _task_time(client, everyone, 50, tag + "w")
    task_s = float(np.median([_task_time(client, everyone, tasks, f"{tag}{r}")
                              for r in range(3)]))
    log(f"task cost ({tasks} small tasks over {len(everyone)} workers): "
        f"{task_s * 1e3:.2f} ms per task")
    _round_time(client, everyone, tag + "rw")
    round_s = float(np.median([_round_time(client, everyone, f"{tag}r{r}") for r in range(9)]))
    log(f"round trip (a graph of one small task per worker, submitted and gathered): "
        f"{round_s * 1e3:.2f} ms")
    cpu_B, exchange = (float(np.median(col)) for col in zip(*(
        transfer_cpu(client, everyone, xfer, rest) for _ in range(e.transfer_repeats))))
    log(f"transfer CPU (every worker pushing {xfer / 2**20:.0f} MiB to every other at once): "
        f"{cpu_B * 1e9:.2f} ns per byte sent or received on idle cores; each worker sent "
        f"{exchange / 2**20:.0f} MiB/s")
    if exchange > bandwidth:  # one link's share of an all-to-all bounds its rate below
        log(f"bandwidth: the fit over dask's transfer logs ({bandwidth / 2**20:.0f} MiB/s) is "
            f"below what each link carried in the all-to-all; taking that")
        bandwidth = exchange
    beside.take()
    rates.take()
    loaded = [loaded_hop(client, everyone) for _ in range(e.loaded_repeats)]
    loaded = [h for h in loaded if h is not None]
    loaded_s = float(np.median(loaded)) if loaded else None
    log("message beside an all-to-all (one way, a 4-byte block while every worker pushes "
        "32 MiB to every other): " + ("not measured (the links emptied too soon)"
                                      if loaded_s is None else f"{loaded_s * 1e3:.2f} ms"))
    direct_msg, comms_msg = message_cpu(client, everyone, cpu_B)
    log(f"transfer CPU per message, each end (all-to-all exchanges of 4-byte and 256 KiB "
        f"blocks): {direct_msg * 1e6:.0f} us a small message, {comms_msg * 1e6:.0f} us a "
        f"large one")
    background = step_s = task_cpu = None
    if not measurable(client, everyone):
        log("dask's own CPU: not measured (workers in the client's process, or no thread "
            "CPU clock on this platform)")
    else:
        background = background_cores(client, everyone, e.background_s)
        log(f"dask's own CPU while the workers compute (their event loops, the scheduler, "
            f"the client): {background:.3f} of a core in all")
        step_s, task_cpu = step_cpu(client, everyone, background, e.probe_steps)
        log(f"CPU of a submitted step outside its programs (real steps of a small network, "
            f"its batch scattered): {step_s * 1e3:.1f} ms per worker; the programs' own "
            f"loops: {task_cpu * 1e6:.0f} us per task")
    beside.take()
    rates.take()
    flops, cluster, edge, ew, conv = rates.rates(log)
    busy, busy_B, stack_B, lost = beside.medians()
    log(f"exchange beside computing (every worker also running the kernel mix): each worker "
        f"sent {busy / 2**20:.0f} MiB/s; transfer CPU {busy_B * 1e9:.2f} ns per byte "
        f"({beside.spread_note()}; the computing threads' CPU taken off); the network stack's "
        "work on the computing threads: " + ("not readable here" if lost is None else (
            f"{stack_B * 1e9:.3f} ns per byte ({lost:.1%} of their time)")))
    return Machine(alpha_s=alpha, bandwidth_Bps=bandwidth, word_bytes=np.dtype(dtype).itemsize,
                   flops_per_s=flops, cluster_flops_per_s=cluster, task_s=task_s,
                   mem_Bps=mem, cluster_bandwidth_Bps=cluster_bw, message_s=message,
                   round_s=round_s, transfer_cpu_s_per_B=busy_B, elementwise_Bps=ew,
                   exchange_Bps=exchange, busy_exchange_Bps=busy, loaded_message_s=loaded_s,
                   direct_message_cpu_s=direct_msg, message_cpu_s=comms_msg,
                   step_cpu_s=step_s, background_cores=background,
                   gemm_edge_flops=edge, program_task_cpu_s=task_cpu, conv_Bps=conv,
                   stack_cpu_s_per_B=stack_B)
