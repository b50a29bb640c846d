"""What in-memory replicas cost a training step: the weight-dominated MLP with replicas off,
refreshed every 10 steps and every step, alternated on one cluster, medians.

    python benchmarks/replica_cost.py [--rounds 3] [--steps 30] [--grids 2x2,4x1] [--big]

Each fit trains ``--steps`` steps (after a warm-up fit); the step time is the median gap
between finished steps past the first three. The bytes each refresh moves are read from
the run's comm table (measured, and the cost model's prediction beside it) and the
planner's per-step replica time and memory per process are printed with them. Prints a
JSON line per grid and setting and a markdown table; the section in docs/benchmarks.md
is written by hand from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _replica_bytes(dask_worker=None):
    """Bytes of replica snapshots this worker holds now, each array once (the buddy's copy
    and the fetched snapshot it was made from are one array under two keys)."""
    seen = {}
    for key in list(dask_worker.data.keys()):
        name = key[0] if isinstance(key, tuple) else key
        if isinstance(name, str) and name.startswith("state.rep"):
            v = dask_worker.data[key]
            seen[id(v)] = v.nbytes
    return sum(seen.values())


def one_fit(client, cfg, grid, replicas, steps):
    from dask_ipar import SGD, Dense, Sequential
    from dask_ipar.runtime.loop import Callback
    from dask_ipar.runtime.replicas import Replicas

    import common as C

    X, y = C.make_data(cfg, steps + 2)
    model = Sequential([Dense(w, "relu") for w in cfg.widths[1:-1]] + [Dense(cfg.widths[-1])],
                       input_dim=cfg.widths[0], seed=0).distribute(client, grid)
    opt = SGD(lr=0.01, momentum=0.9)
    model.fit(X[:2 * cfg.batch], y[:2 * cfg.batch], epochs=1, batch_size=cfg.batch,
              optimizer=opt, replicas=replicas or None)  # warm-up
    done, held = [], {}
    rep = Replicas(replicas) if replicas else None

    class Memory(Callback):  # the snapshots held once the run is under way
        def on_step_end(self, loop, stats):
            if rep is not None and stats.step == steps // 2:
                held["bytes"] = max(client.run(_replica_bytes, workers=model.binding.workers)
                                    .values())
                held["refreshes"] = len(rep.gens)

    h = model.fit(X, y, epochs=1, batch_size=cfg.batch, optimizer=opt, replicas=rep,
                  callbacks=[Memory()], progress=lambda st: done.append(time.perf_counter()))
    model.close()
    gaps = [b - a for a, b in zip(done[3:], done[4:])]
    rows = {(r.layer, r.phase): r for r in h.comm.rows}
    row = rows.get(("state", "replica"))
    return statistics.median(gaps), (None if row is None else
                                     (row.predicted_bytes, row.measured_bytes, h.comm.steps)), held


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--grids", default="2x2,4x1")
    ap.add_argument("--big", action="store_true", help="the 8192-wide MLP (B=128)")
    a = ap.parse_args()
    import os
    import sys
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common as C
    from distributed import Client, LocalCluster

    from dask_ipar.cost import FC, LOOPBACK_MACHINE, Machine, evaluate_grid

    cfg = next(c for c in C.configs(quick=not a.big) if c.key == "weight")
    settings = (0, 10, 1)
    out = []
    with LocalCluster(n_workers=4, threads_per_worker=1, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        for grid in a.grids.split(","):
            times = {r: [] for r in settings}
            comm, mem = {}, {}
            for _ in range(a.rounds):
                for r in settings:
                    t, rep, held = one_fit(client, cfg, grid, r, a.steps)
                    times[r].append(t)
                    if rep is not None:
                        comm[r] = rep
                    if held:
                        mem[r] = held
            pr, pc = map(int, grid.split("x"))
            net = [FC(i, o) for i, o in zip(cfg.widths, cfg.widths[1:])]
            m = Machine(alpha_s=LOOPBACK_MACHINE.alpha_s,
                        bandwidth_Bps=LOOPBACK_MACHINE.bandwidth_Bps, word_bytes=4)
            base = statistics.median(times[0])
            from dask_ipar.cost.replica import GENERATIONS

            for r in settings:
                plan = evaluate_grid(net, pr, pc, cfg.batch, m, replicas=r)
                plan0 = evaluate_grid(net, pr, pc, cfg.batch, m)
                per_refresh = (plan.mem_bytes - plan0.mem_bytes) / GENERATIONS
                rec = {"grid": grid, "replicas": r, "step_s": statistics.median(times[r]),
                       "ratio": statistics.median(times[r]) / base,
                       "rounds": times[r], "planner_replica_s": plan.replica_comm_s,
                       "planner_mem_bytes": plan.mem_bytes,
                       "planner_replica_mem_per_refresh": per_refresh,
                       "measured_replica_mem": mem.get(r),
                       "comm_per_step": comm.get(r)}
                out.append(rec)
                print(json.dumps(rec), flush=True)
    print("\n| grid | replicas every | step (s) | ratio to off | replica bytes per step, "
          "predicted / measured | replica memory on the busiest worker, predicted / measured "
          "(refreshes held) | planner: replica s per step | planner: memory per process |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out:
        c, mm = r["comm_per_step"], r["measured_replica_mem"]
        mem = "-" if not mm else (
            f"{mm['refreshes'] * r['planner_replica_mem_per_refresh'] / 2**20:.1f} / "
            f"{mm['bytes'] / 2**20:.1f} MiB ({mm['refreshes']})")
        print(f"| {r['grid']} | {r['replicas'] or 'off'} | {r['step_s']:.3f} | {r['ratio']:.2f} | "
              + (f"{c[0]:,.0f} / {c[1]:,.0f}" if c else "-") + f" | {mem}"
              + f" | {r['planner_replica_s']:.4f} | {r['planner_mem_bytes'] / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
