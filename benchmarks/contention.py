"""What worker processes that share cores lose to each other, per kind of work (issue 23).

    python benchmarks/contention.py [--workers 2,4,8] [--rounds 3] [--json out.json]

The step-time model slows every task that runs beside others by one factor, the
matmul's (``cluster_flops_per_s`` over the cores at the one-worker rate). This measures
whether other work loses more: per worker count, a ``LocalCluster`` of that many worker
processes (one thread each, dask-ipar's worker settings) runs each workload on one worker
alone (the fastest of three) and on every worker at once (all starting at one moment; the
median worker's time), side by side in each round:

* ``matmul``: float32 1024-cubed matmuls (the model's reference);
* ``kernel mix``: the engine's conv, pooling and dense kernels of ``dask-ipar calibrate``
  (:mod:`dask_ipar.runtime.kernelmix`: arrays of 1-4 MiB);
* ``passes N MiB``: element-wise passes into fresh arrays of N MiB (``a * s``, then
  ``+= b``: the calibration's memory rate), N = 1, 4, 16: what streams from memory.

Each workload is sized to take about 0.15 s alone. Prints a markdown table: per worker
count and workload, its slowdown (all at once over alone; the medians over the rounds) and
that over the matmul's slowdown of the same round (1.0: it loses what the model says).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import common as C  # noqa: E402

TARGET_S = 0.15
PASS_MIB = (1, 4, 16)


def _wait(start_at):
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))


def matmul(reps, start_at=None):
    a = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    b = a.copy()
    a @ b
    _wait(start_at)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return time.perf_counter() - t


def mix(reps, start_at=None):
    from dask_ipar.runtime.kernelmix import kernel_mix

    kernel_mix(1)
    _wait(start_at)
    return kernel_mix(reps)[2]


def passes(mib, reps, start_at=None):
    a = np.ones(mib * 2**18, np.float32)
    b = a.copy()
    c = a * np.float32(0.5)  # warm: the heap holds a block of this size
    del c
    _wait(start_at)
    t = time.perf_counter()
    for _ in range(reps):
        c = a * np.float32(0.5)
        c += b
        del c
    return time.perf_counter() - t


def _alone(client, worker, f, *args):
    return min(client.submit(f, *args, None, workers=[worker], pure=False).result()
               for _ in range(3))


def _together(client, workers, f, *args):
    start = time.time() + 0.3 + 0.05 * len(workers)  # after the dispatch
    return statistics.median(client.gather([
        client.submit(f, *args, start, workers=[w], pure=False) for w in workers]))


def _sized(client, worker, f, *args):
    """``args + (reps,)`` so that ``f`` takes about TARGET_S alone."""
    one = _alone(client, worker, f, *args, 1)
    return (*args, max(1, round(TARGET_S / max(one, 1e-6))))


def measure(n_workers: int, rounds: int) -> dict:
    """``{workload: {"slowdown": [...], "vs_matmul": [...]}}`` per round."""
    cluster, client, _ = C.local_cluster(n_workers, os.cpu_count() or 1)
    try:
        workers = sorted(client.scheduler_info()["workers"])
        w0 = workers[0]
        loads = {"matmul": (matmul, _sized(client, w0, matmul)),
                 "kernel mix": (mix, _sized(client, w0, mix))}
        for mib in PASS_MIB:
            loads[f"passes {mib} MiB"] = (passes, _sized(client, w0, passes, mib))
        out = {name: {"slowdown": [], "vs_matmul": []} for name in loads}
        for r in range(rounds):
            slow = {name: _together(client, workers, f, *args) / _alone(client, w0, f, *args)
                    for name, (f, args) in loads.items()}
            for name, s in slow.items():
                out[name]["slowdown"].append(s)
                out[name]["vs_matmul"].append(s / slow["matmul"])
            print(f"  {n_workers} workers, round {r + 1}: " + ", ".join(
                f"{k} {v:.2f}x" for k, v in slow.items()), flush=True)
    finally:
        client.close()
        cluster.close()
    return out


def table(results: dict) -> str:
    rows = ["| workers | workload | slowdown (all at once / alone) | over the matmul's |",
            "|---|---|---|---|"]
    for n, loads in results.items():
        for name, v in loads.items():
            rows.append(f"| {n} | {name} | {statistics.median(v['slowdown']):.2f} | "
                        f"{statistics.median(v['vs_matmul']):.2f} "
                        f"({min(v['vs_matmul']):.2f}-{max(v['vs_matmul']):.2f}) |")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="2,4,8",
                    help="worker counts, comma-separated (default: 2,4,8)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per worker count (default: 3)")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    try:
        counts = [int(x) for x in args.workers.split(",")]
    except ValueError:
        ap.error(f"--workers: got {args.workers!r}; expected worker counts such as 2,4,8")
    if any(n < 1 for n in counts) or args.rounds < 1:
        ap.error("--workers and --rounds: expected positive numbers")
    results = {n: measure(n, args.rounds) for n in counts}
    print(f"\n{os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}\n")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": os.cpu_count(), "rounds": args.rounds,
                       "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
