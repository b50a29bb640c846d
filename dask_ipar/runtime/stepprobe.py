"""Probes of what a cluster's processes spend outside the tasks, for
:func:`~dask_ipar.runtime.calibrate.calibrate`.

Its one job: measure the CPU that dask itself takes from the cores a step's kernels run
on, where the workers, the scheduler and the client share a machine's cores (a
workstation's ``LocalCluster``, the emulated clusters of the benchmarks):

* :func:`background_cores`: the CPU the workers' other threads (their event loops:
  heartbeats, dask's profiler, the comms), the scheduler and the client take per second
  while every worker computes, in cores, over the whole cluster (``background_cores``);
* :func:`step_cpu`: the CPU one submitted training step costs outside its worker
  programs (the scheduler's and the client's work for the step's dask tasks, its batch
  and its results; each worker's event loop receiving them), measured on real steps of a
  small network whose batch is scattered to the workers as a training batch is
  (``step_cpu_s``, per worker).

On the emulated clusters of 2, 4 and 8 hosts sharing 2 cores: 0.066, 0.088-0.092 and 0.12
of a core in all while computing; a scattered step 8.1-8.7, 7.2-8.1 and 7.2 ms per worker.

Both read a process's CPU clock and its task threads' (``time.pthread_getcpuclockid``: not
on every platform, :func:`measurable` says) and tell processes apart by host and process
id: workers that are threads of the client's process cannot be told from it.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np

__all__ = ["background_cores", "step_cpu", "program_cpu", "measurable", "PROBE_WIDTHS",
           "PROBE_BATCH", "PROBE_STEPS"]

#: The probe network of :func:`step_cpu`: one dense layer (at least as many inputs as
#: workers, so that its weight's columns split over them), so that its programs exchange a
#: few small messages only, and a batch of 2 MiB at 64 inputs, above
#: ``Sequential.embed_bytes``, scattered to the workers as a training batch is.
PROBE_WIDTHS = (64, 10)
PROBE_BATCH = 8192
#: Steps timed (after two untimed ones), as ``fit`` runs them: each says another follows.
PROBE_STEPS = 20


def _own_cpu() -> tuple:
    """``((host, process id), CPU seconds of this process so far, all of its threads)``."""
    return (socket.gethostname(), os.getpid()), time.process_time()


def _driver_cpu(client) -> float:
    """CPU seconds so far of the scheduler's process and the client's, once where they are
    one process (a ``LocalCluster`` runs its scheduler in the client's process)."""
    mine, sched = _own_cpu(), client.run_on_scheduler(_own_cpu)
    return mine[1] + (sched[1] if sched[0] != mine[0] else 0.0)


def measurable(client, workers) -> bool:
    """Whether the probes can tell dask's own CPU here: a thread CPU clock on this
    platform, and none of ``workers`` a thread of the client's process (a
    ``LocalCluster(processes=False)``)."""
    if not hasattr(time, "pthread_getcpuclockid"):
        return False
    mine = _own_cpu()[0]
    return all(who != mine for who, _ in client.run(_own_cpu, workers=list(workers)).values())


def _computing_cpu(seconds: float) -> tuple:
    """Run as a task: compute for ``seconds`` (the engine's kernels); returns ``(this
    process's CPU seconds outside this thread, this thread's, the wall seconds)``."""
    from dask_ipar.runtime.kernelmix import kernel_calls

    calls = kernel_calls("float32")
    p0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
    while time.perf_counter() - w0 < seconds:
        for f, args in calls:
            f(*args)
    p1, t1, w1 = time.process_time(), time.thread_time(), time.perf_counter()
    return (p1 - p0) - (t1 - t0), t1 - t0, w1 - w0


def background_cores(client, workers, seconds: float = 1.0) -> float:
    """Cores' worth of CPU that the workers' other threads, the scheduler and the client
    take in all while every worker computes for ``seconds`` (the engine's kernels in one
    task each): their CPU seconds over the wall seconds."""
    workers = list(workers)
    client.gather([client.submit(_computing_cpu, 0.05, workers=[w], pure=False,
                                 allow_other_workers=False) for w in workers])  # warm
    d0 = _driver_cpu(client)
    t0 = time.perf_counter()
    runs = client.gather([client.submit(_computing_cpu, seconds, workers=[w], pure=False,
                                        allow_other_workers=False) for w in workers])
    wall = time.perf_counter() - t0
    others = sum(r[0] for r in runs) + _driver_cpu(client) - d0
    return float(others / wall)


def _split_cpu() -> tuple:
    """CPU seconds of this worker process so far: ``(outside its task threads, its task
    threads')`` (the threads of dask's executors, by the names dask gives them)."""
    import threading

    tasks = 0.0
    for t in threading.enumerate():
        if "Dask-Default-Threads" in t.name:
            try:
                tasks += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except OSError:  # the thread ended meanwhile
                pass
    return time.process_time() - tasks, tasks


def program_cpu(got: dict, count_s: float) -> tuple:
    """``(the programs' loops' CPU seconds, of which beyond their kernels and transports,
    tasks run)`` from a worker's counts (:func:`dask_ipar.runtime.programs.kernel_cpu`,
    ``{"<task>:<function>": (seconds, calls)}``): the loops are the programs' ``run`` less
    their ``start`` (their setup); beyond the kernels and the transports' work counted on
    the program threads (``program:push``, ``wait``, ``phase``), less ``count_s`` per
    counted call (the accounting's own work between the counted intervals)."""
    run, start = (got.get(f"program:{k}", (0.0, 0))[0] for k in ("run", "start"))
    counted = sum(s for k, (s, _) in got.items() if k not in ("program:run", "program:start"))
    calls = sum(n for _, n in got.values())
    tasks = sum(n for k, (_, n) in got.items() if not k.startswith("program:"))
    loop = max(0.0, run - start)
    return loop, max(0.0, loop - counted - calls * count_s), tasks


def _stop_counting() -> tuple:
    """Run on a worker: its CPU split (:func:`_split_cpu`) and its programs' counts,
    the counting stopped (:func:`program_cpu`'s terms)."""
    from dask_ipar.runtime.programs import count_cost_s, kernel_cpu

    split = _split_cpu()
    return split, program_cpu(kernel_cpu(False) or {}, count_cost_s())


def step_cpu(client, workers, background: float = 0.0, steps: int = PROBE_STEPS) -> tuple:
    """``(step_cpu_s, program_task_cpu_s)`` of :class:`dask_ipar.cost.Machine`: the probe
    network (:data:`PROBE_WIDTHS`, a batch of :data:`PROBE_BATCH` samples) trained on a
    ``1 x P`` grid of ``workers`` as worker programs, ``steps`` steps, with the programs'
    CPU accounted (:func:`dask_ipar.runtime.programs.kernel_cpu`).

    ``step_cpu_s``: CPU seconds per worker that one submitted step costs outside its
    programs' loops: the scheduler's and the client's CPU and each worker's outside its
    task threads, and its task threads' outside the programs' loops (dask running the
    program, its setup before its first task), less ``background`` cores (the whole
    cluster's, measured apart: :func:`background_cores`) over the steps' wall time, over
    the steps and the workers. It includes the CPU of the probe's own few messages (a
    10-row weight's gradient summed over the workers: at ``direct_message_cpu_s`` each
    end, under 1 ms per worker and step on 8 emulated hosts).

    ``program_task_cpu_s``: CPU seconds of the programs' loops per task beyond the tasks'
    kernels and the transports' work done on the program threads (handing blocks over,
    reading them while waiting): the Python between the kernels."""
    from distributed import wait

    from dask_ipar import SGD, Dense, Sequential
    from dask_ipar.runtime.programs import kernel_cpu

    workers = list(workers)
    p = len(workers)
    n_in = max(PROBE_WIDTHS[0], p)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((PROBE_BATCH, n_in), dtype=np.float32)
    y = rng.integers(0, PROBE_WIDTHS[-1], PROBE_BATCH)
    model = Sequential([Dense(w) for w in PROBE_WIDTHS[1:]], input_dim=n_in,
                       dtype="float32", seed=0)
    opt = SGD(lr=0.01, momentum=0.9)
    try:
        model.distribute(client, f"1x{p}", workers=workers)
        model.executor = "programs"
        for _ in range(2):
            client.gather(model.train_step(X, y, opt, more=True))
        weights = [f for lay in model.state_blocks()["layers"] for f in lay["w"].values()]
        wait(weights)  # the warm steps' programs done: each program is counted whole
        w0 = client.run(_split_cpu, workers=workers)
        client.run(kernel_cpu, True, workers=workers)
        try:
            d0 = _driver_cpu(client)
            t0 = time.perf_counter()
            for k in range(steps):
                client.gather(model.train_step(X, y, opt, more=k < steps - 1))
            # the last step's backward and update run on after its loss came back
            wait([f for lay in model.state_blocks()["layers"] for f in lay["w"].values()])
            wall = time.perf_counter() - t0
            d1 = _driver_cpu(client)
        finally:
            ends = client.run(_stop_counting, workers=workers)
    finally:
        model.close()
    w1 = {w: split for w, (split, _) in ends.items()}
    programs = {w: counted for w, (_, counted) in ends.items()}
    # outside the task threads, and the task threads' outside the programs' loops
    spent = d1 - d0 + sum(w1[w][0] - w0[w][0] + (w1[w][1] - w0[w][1]) - programs[w][0]
                          for w in workers)
    tasks = sum(programs[w][2] for w in workers)
    per_task = sum(programs[w][1] for w in workers) / tasks if tasks else 0.0
    return float(max(0.0, spent - background * wall) / steps / p), float(per_task)
