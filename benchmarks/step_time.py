"""Predicted vs measured step time (issue 4): calibrate, then time every grid of 4 workers.

    python benchmarks/step_time.py [--workers 4] [--steps 6] [--json out.json]

One LocalCluster of ``--workers`` processes (1 thread each); ``dask_ipar.runtime.calibrate`` runs on it
first, then for each MLP and grid: two warm-up passes, then the median wall time of ``--steps``
single steps (each submitted and waited for alone), beside ``model.predict_step_s`` with the
calibrated machine and the machine's core count. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = [  # (widths, batch); the per-task matmul time (one worker alone) is in the output
    ((2048, 2048, 2048, 10), 512),
    ((4096, 4096, 10), 128),
    ((4096, 4096, 4096, 10), 512),
]


def main(argv=None):
    import dask
    from distributed import Client, LocalCluster, wait

    from dask_ipar import Dense, Sequential
    from dask_ipar.runtime.calibrate import calibrate
    from dask_ipar.layout.grid import factorizations
    from dask_ipar.optim import SGD
    from dask_ipar.layout.partition import split_bounds

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    cores = os.cpu_count()
    rows = []
    from dask_ipar.runtime.cluster import worker_environment

    with dask.config.set({"distributed.worker.profile.enabled": False}), worker_environment():
        cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                               dashboard_address=None)
    with cluster, Client(cluster) as client:
        machine = calibrate(client, log=print)
        for widths, batch in CONFIGS:
            rng = np.random.default_rng(0)
            X = rng.standard_normal((batch, widths[0])).astype(np.float32)
            y = rng.integers(0, widths[-1], batch)
            for grid in factorizations(args.workers):
                model = Sequential([Dense(w, "relu") for w in widths[1:-1]] + [Dense(widths[-1])],
                                   input_dim=widths[0]).distribute(client, grid)
                opt = SGD(lr=0.01)
                model.fit(X, y, epochs=2, batch_size=batch, measure=False)
                times = []
                for _ in range(args.steps):
                    t = time.perf_counter()
                    model.train_step(X, y, opt)
                    wait([model._futures[(n, i, j)] for n in model._w + model._v
                          for i, j in model.grid.cells()])
                    times.append(time.perf_counter() - t)
                sim = model.predict_step_s(batch, machine, cores=cores, optimizer=opt)
                # the largest matmul task of the step, at the one-worker rate
                task_ms = 1e3 * 2 * max(b - a for a, b in model.engine.layouts[0].rows) \
                    * widths[0] * max(b - a for a, b in split_bounds(batch, grid.pc)) \
                    / machine.flops_per_s
                meas = statistics.median(times)
                rows.append({"mlp": "-".join(map(str, widths)), "batch": batch,
                             "grid": str(grid), "measured_s": meas, "predicted_s": sim.seconds,
                             "task_ms": task_ms,
                             "latency_s": sim.latency_s, "throughput_s": sim.throughput_s})
                print(f"{rows[-1]['mlp']} B={batch} {grid}: measured {meas:.3f} s, predicted "
                      f"{sim.seconds:.3f} s (latency {sim.latency_s:.3f}, throughput "
                      f"{sim.throughput_s:.3f})", flush=True)
                model.close()
    print(f"\nmachine: alpha {machine.alpha_s * 1e3:.2f} ms, {machine.bandwidth_Bps / 1e6:.0f} MB/s, "
          f"{machine.flops_per_s / 1e9:.1f} GFLOP/s one worker, "
          f"{machine.cluster_flops_per_s / 1e9:.1f} GFLOP/s all workers, "
          f"task {machine.task_s * 1e3:.2f} ms, memory {machine.mem_Bps / 1e9:.1f} GB/s, "
          f"{machine.cluster_bandwidth_Bps / 1e6:.0f} MB/s all workers; "
          f"{cores} cores\n")
    print("| MLP | B | grid | matmul per task (ms) | measured step (s) | predicted (s) | "
          "predicted / measured |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mlp']} | {r['batch']} | {r['grid']} | {r['task_ms']:.0f} | "
              f"{r['measured_s']:.3f} | {r['predicted_s']:.3f} | "
              f"{r['predicted_s'] / r['measured_s']:.2f} |")
    for mlp in sorted({r["mlp"] for r in rows}):
        mine = [r for r in rows if r["mlp"] == mlp]
        best_m = min(mine, key=lambda r: r["measured_s"])
        best_p = min(mine, key=lambda r: r["predicted_s"])
        print(f"{mlp}: measured best {best_m['grid']} ({best_m['measured_s']:.3f} s), predicted "
              f"best {best_p['grid']} (measured {best_p['measured_s']:.3f} s, "
              f"{best_p['measured_s'] / best_m['measured_s'] - 1:+.1%})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine.__dict__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
