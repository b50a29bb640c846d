"""A grid's whole training step replayed kernel by kernel in one process, beside the
step-time model's cost of each kernel (issue 23).

    python benchmarks/step_replay.py [--model cnn] [--workers 8] [--grids 4x2,8x1]
                                     [--reps 3] [--cold] [--processes 1] [--json FILE]

Builds the step graph the engine runs for ``--model`` (``cnn``, ``compute`` or ``weight``
of ``benchmarks/common.py``) on each grid of ``--workers`` processes (the conv schemes
the planner picks for it), with no cluster, then runs every task of it in the graph's
order in this process (one BLAS thread, float32, random weights and batch, the workers'
malloc settings), ``--reps`` times; a kernel's time is its fastest. ``--cold``: before each
kernel, a pass over a 64 MiB buffer evicts the caches, as other processes' work does
between a kernel and the one that made its inputs where worker processes share the cores.
``--processes N``: N processes replay the step at once from a common start, process ``i``
pinned to core ``i`` modulo the cores (2 on 2 cores: side by side, sharing the memory
system; 8 on 2 cores: four taking turns on each, as 8 workers on 2 cores do); a kernel's
time is then its thread's CPU time, the mean over the processes of each one's fastest.

The model's time of a task is ``flops / rate + bytes / elementwise``
(:mod:`dask_ipar.kernels.costs`), the rate the matmul rate of this process and
``elementwise`` the kernel mix's (as ``dask-ipar calibrate`` measures both). Prints per
kernel (layer, task and function, over all workers' tasks) the measured time, the
model's (its flops and its bytes parts) and measured / model, and the totals: what the
simulator's kernel costs miss before any sharing of cores. ``--json``: every kernel's
figures (seconds) also written to ``FILE``, its ``"json"`` the path given.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import common as C  # noqa: E402

COLD_BYTES = 64 * 2**20


def _rates():
    """``(matmul flops/s, element-wise bytes/s)`` of this process, as calibrate measures
    them on a worker (the fastest of three 1024-cubed matmuls; the kernel mix on 16 MiB
    blocks, fastest of three runs: the whole mix's rate, the conv front's not apart)."""
    from dask_ipar.runtime.rateprobe import matmul_rate
    from dask_ipar.runtime.kernelmix import LARGE_IMAGES, kernel_mix, mix_rates
    from dask_ipar.runtime.stepmodel import ELEMENTWISE_BPS

    rate = matmul_rate(1024, "float32", 3)
    mixes = [kernel_mix(1, images=LARGE_IMAGES) for _ in range(3)]
    return rate, mix_rates(min(mixes, key=lambda r: r.seconds), rate)[0] or ELEMENTWISE_BPS


def replay(cfg, workers: int, grid: str, rate: float, ew: float, reps: int, cold: bool,
           start=None):
    """``{(layer.task, function): [measured s, flops s, bytes s, tasks]}`` of one step
    (``start``: a barrier passed before the timed runs)."""
    from dask._task_spec import DataNode, TaskRef

    from dask_ipar import SGD
    from dask_ipar.cost import Machine
    from dask_ipar.nn.graph import sim_tasks
    from dask_ipar.runtime.gridrank import rank_grids
    from dask_ipar.runtime.stepmodel import sim_step_graph
    from dask_ipar.testing import fake_binding

    shape = cfg.image if isinstance(cfg, C.CNNConfig) else (cfg.widths[0],)
    machine = Machine(alpha_s=1e-3, bandwidth_Bps=1.2e8, flops_per_s=rate, elementwise_Bps=ew)
    chosen = rank_grids(cfg.layers(), shape, workers, cfg.batch, machine, cores=2,
                        executor="programs", grids=[grid])[0]
    model = cfg.build_model(chosen.layers if isinstance(cfg, C.CNNConfig) else None)
    engine = model._make_engine(fake_binding(grid))
    names = [f"w{k}" for k in range(len(engine.param_layouts))]
    opt = SGD(lr=0.01, momentum=0.9)
    g, external = sim_step_graph(engine, names, cfg.batch, shape, "float32", opt)
    cost = {t.key: t for t in sim_tasks(g, external, 4)[0]}
    rng = np.random.default_rng(2)
    ext = {k: (rng.standard_normal(s) * 0.01).astype(np.float32)
           for k, (_, s) in external.items()}
    # the batch: random values where the graph holds zeros (a kernel's time may depend on
    # its values: max pooling's backward took 15.6 ms on constant 16 MiB blocks, 21.6 on
    # random ones); labels as they are
    for key, node in g.dsk.items():
        if isinstance(node, DataNode):
            v = node.value
            ext[key] = (rng.standard_normal(v.shape).astype(v.dtype)
                        if np.issubdtype(v.dtype, np.floating) else v)
    scratch = np.ones(COLD_BYTES // 4, np.float32) if cold else None
    times = collections.defaultdict(list)
    clock = time.perf_counter
    if start is not None:  # processes take turns on the cores: each kernel's own CPU
        clock = time.thread_time
        start.wait()
    for _ in range(reps):
        vals = dict(ext)
        for key, node in g.dsk.items():
            if isinstance(node, DataNode):
                continue
            deps = {a.key: vals[a.key] for a in node.args if isinstance(a, TaskRef)}
            if scratch is not None:
                scratch += 1.0
            t = clock()
            vals[key] = node(deps)
            times[key].append(clock() - t)
    per = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for key, ts in times.items():
        name = (key[0] if isinstance(key, tuple) else key).split("-")[0]
        p = per[(name, g.dsk[key].func.__name__)]
        p[0] += min(ts)
        p[1] += cost[key].flops / rate
        p[2] += cost[key].mem_bytes / ew
        p[3] += 1
    return dict(per)


def _pinned(core, queue, start, *args):
    """:func:`replay` in a process pinned to ``core``, its result put on ``queue``."""
    os.sched_setaffinity(0, {core})
    queue.put(replay(*args, start=start))


def together(n: int, *args) -> dict:
    """:func:`replay`'s ``args`` run in ``n`` processes at once from a common start, process
    ``i`` pinned to core ``i`` modulo this process's cores: each kernel's figures with its
    measured time (CPU) the mean of the processes'."""
    import multiprocessing as mp

    import queue as queues

    cores = sorted(os.sched_getaffinity(0))
    ctx = mp.get_context("fork")
    queue, start = ctx.Queue(), ctx.Barrier(n, timeout=600)
    procs = [ctx.Process(target=_pinned, args=(cores[i % len(cores)], queue, start, *args))
             for i in range(n)]
    for p in procs:
        p.start()
    got = []
    try:
        while len(got) < n:
            try:
                got.append(queue.get(timeout=5))
            except queues.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    raise SystemExit(f"--processes: a replaying process failed (exit code "
                                     f"{failed[0]}); its error is printed above") from None
    finally:
        for p in procs:
            if len(got) < n:
                p.terminate()
            p.join()
    return {k: [sum(g[k][0] for g in got) / n, *got[0][k][1:]] for k in got[0]}


def main(argv=None):
    from threadpoolctl import threadpool_limits

    from dask_ipar.runtime.worker_env import REUSE_MEMORY_ENV, blas_environ

    # a one-thread worker's settings, read at the process's start: the malloc settings of
    # dask-ipar's workers (fresh arrays reuse freed memory, as in the workers: the kernel
    # mix read 15.2 GB/s without them, 17.0 with) and one BLAS thread, PyTorch's too
    # (threadpoolctl below limits NumPy's BLAS only: before session 42 the products of
    # matmul auto ran on all cores here, and the rates of the model with them)
    worker = {**REUSE_MEMORY_ENV, **blas_environ(1)}
    if argv is None and any(os.environ.get(k) != v for k, v in worker.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **worker})

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="cnn", choices=["cnn", "compute", "weight"])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--grids", default="4x2,8x1", help="grids, comma-separated")
    ap.add_argument("--reps", type=int, default=3,
                    help="runs of the step, a kernel's time its fastest (at least 2: a "
                         "kernel's first run allocates its arrays)")
    ap.add_argument("--cold", action="store_true", help="evict the caches before each kernel")
    ap.add_argument("--processes", type=int, default=1,
                    help="processes replaying the step at once, spread over the cores")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per grid")
    ap.add_argument("--json", help="also write every kernel's figures here")
    a = ap.parse_args(argv)
    if a.processes < 1:
        ap.error(f"--processes: got {a.processes}; expected at least 1")
    if a.reps < 2:
        ap.error(f"--reps: got {a.reps}; expected at least 2 (a kernel's first run allocates "
                 "its arrays and would be timed)")
    cfg = C.sweep_models()[a.model]
    out = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": a.model,
           "workers": a.workers, "reps": a.reps, "cold": a.cold, "processes": a.processes,
           "json": a.json, "grids": {}}
    with threadpool_limits(1):
        rate, ew = _rates()
        out.update(flops_per_s=rate, elementwise_Bps=ew)
        print(f"matmul {rate / 1e9:.1f} GFLOP/s, element-wise {ew / 1e9:.1f} GB/s (one thread)"
              f"{', caches evicted before each kernel' if a.cold else ''}"
              + (f", {a.processes} processes at once over {len(os.sched_getaffinity(0))} "
                 "cores (kernels' CPU time)" if a.processes > 1 else "") + "\n")
        for grid in a.grids.split(","):
            args = (cfg, a.workers, grid, rate, ew, a.reps, a.cold)
            per = together(a.processes, *args) if a.processes > 1 else replay(*args)
            real = sum(p[0] for p in per.values())
            model = sum(p[1] + p[2] for p in per.values())
            out["grids"][grid] = {"measured_s": real, "model_s": model, "kernels": [
                {"kernel": name, "function": fn, "tasks": p[3], "measured_s": p[0],
                 "flops_s": p[1], "bytes_s": p[2]} for (name, fn), p in sorted(per.items())]}
            print(f"{cfg.label} {grid} ({a.workers} workers' tasks): measured {real * 1e3:.1f} ms, "
                  f"model {model * 1e3:.1f} ms (measured / model {real / model:.2f})\n")
            print("| kernel | function | tasks | measured (ms) | model (ms) | flops / bytes "
                  "(ms) | measured / model |")
            print("|---|---|---|---|---|---|---|")
            for (name, fn), p in sorted(per.items(), key=lambda kv: -kv[1][0])[:a.top]:
                m = p[1] + p[2]
                ratio = p[0] / m if m else float("nan")
                print(f"| {name} | {fn} | {p[3]} | {p[0] * 1e3:.1f} | {m * 1e3:.1f} | "
                      f"{p[1] * 1e3:.1f} / {p[2] * 1e3:.1f} | {ratio:.2f} |")
            print()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
