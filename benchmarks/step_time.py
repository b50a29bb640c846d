"""Predicted vs measured step time (issues 4, 23): calibrate, then time every grid of 4 workers.

    python benchmarks/step_time.py [--workers 4] [--steps 6] [--models mlp,cnn] [--json out.json]

One LocalCluster of ``--workers`` processes (1 thread each); ``dask_ipar.runtime.calibrate`` runs on it
first, then for each MLP and grid: two warm-up passes, then the median wall time of ``--steps``
single steps (each submitted and waited for alone), beside ``model.predict_step_s`` with the
calibrated machine and the machine's core count. ``--models cnn``: the CNN of
``benchmarks/common.py`` (convs with pooling, then dense 4096-4096-10), its conv schemes on
each grid those with the shortest simulated step (``rank_grids``, as ``--conv auto`` with a
calibrated machine picks them). Prints a markdown table.
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
    ap.add_argument("--models", default="mlp", help="comma list: mlp (three MLPs), cnn")
    ap.add_argument("--executor", choices=["programs", "graph"], default="programs",
                    help="Sequential.executor of the timed steps (and of the prediction)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    models = set(args.models.split(","))
    if models - {"mlp", "cnn"}:
        ap.error(f"--models {args.models}: use mlp, cnn or both")
    cores = os.cpu_count()
    rows = []
    from dask_ipar.runtime.cluster import worker_environment

    with dask.config.set({"distributed.worker.profile.enabled": False}), worker_environment():
        cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                               dashboard_address=None)
    with cluster, Client(cluster) as client:
        machine = calibrate(client, log=print)
        jobs = [(widths, batch, None) for widths, batch in CONFIGS] if "mlp" in models else []
        if "cnn" in models:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import common

            jobs.append((common.CNN.widths, common.CNN.batch, common.CNN))
        for widths, batch, cnn in jobs:
            rng = np.random.default_rng(0)
            if cnn is None:
                X = rng.standard_normal((batch, widths[0])).astype(np.float32)
                y = rng.integers(0, widths[-1], batch)
            else:
                X, y = cnn.data(1)
            for grid in factorizations(args.workers):
                if cnn is None:
                    model = Sequential([Dense(w, "relu") for w in widths[1:-1]]
                                       + [Dense(widths[-1])], input_dim=widths[0])
                else:
                    from dask_ipar.runtime.gridrank import rank_grids

                    # the conv schemes with the shortest simulated step on this grid, as
                    # dask-ipar train --conv auto picks them with a calibrated machine
                    lays = rank_grids(cnn.layers(), cnn.image, args.workers, batch, machine,
                                      cores=cores, executor=args.executor,
                                      grids=[grid])[0].layers
                    model = cnn.build_model(lays)
                    schemes = "/".join(lay.parallel for lay in lays
                                       if type(lay).__name__ == "Conv2d")
                model.distribute(client, grid)
                model.executor = args.executor
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
                name = "-".join(map(str, widths)) if cnn is None else "CNN"
                rows.append({"mlp": name, "batch": batch, "executor": args.executor,
                             "conv_schemes": None if cnn is None else schemes,
                             "grid": str(grid), "measured_s": meas, "predicted_s": sim.seconds,
                             "task_ms": task_ms,
                             "latency_s": sim.latency_s, "throughput_s": sim.throughput_s})
                views = (f" (latency {sim.latency_s:.3f}, throughput {sim.throughput_s:.3f})"
                         if args.executor == "graph" else "")
                print(f"{rows[-1]['mlp']} B={batch} {grid}: measured {meas:.3f} s, predicted "
                      f"{sim.seconds:.3f} s{views}", flush=True)
                model.close()
    print(f"\nmachine: alpha {machine.alpha_s * 1e3:.2f} ms, message {machine.message_s * 1e3:.3f} ms, "
          f"{machine.bandwidth_Bps / 1e6:.0f} MB/s, "
          f"{machine.flops_per_s / 1e9:.1f} GFLOP/s one worker, "
          f"{machine.cluster_flops_per_s / 1e9:.1f} GFLOP/s all workers, "
          f"task {machine.task_s * 1e3:.2f} ms, memory {machine.mem_Bps / 1e9:.1f} GB/s, "
          f"{machine.cluster_bandwidth_Bps / 1e6:.0f} MB/s all workers; "
          f"{cores} cores\n")
    print("| MLP | B | grid | matmul per task (ms) | measured step (s) | predicted (s) | "
          "predicted / measured |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        grid = r["grid"] + (f" ({r['conv_schemes']})" if r.get("conv_schemes") else "")
        print(f"| {r['mlp']} | {r['batch']} | {grid} | {r['task_ms']:.0f} | "
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
