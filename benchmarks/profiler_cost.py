"""What dask's statistical profiler costs busy workers: training steps with it sampling
every 10 ms (dask's default), every 100 ms (the clusters dask-ipar starts,
``QUIET_LOOP_CONFIG``) and switched off, interleaved.

    python benchmarks/profiler_cost.py [--workers 8] [--grid 8x1] [--mlp compute]
        [--rounds 2] [--steps 5] [--json out.json]

Each round starts, per setting, a LocalCluster of ``--workers`` one-thread worker processes
with dask-ipar's other cluster settings, and times ``--steps`` training steps of the MLP on
``--grid`` (worker programs; ``common.time_dask_grid``). The settings take turns within
each round, so that a phase of this shared machine's speed moves all alike. Each sample of
the profiler is a turn of a worker's event loop that takes the GIL and walks every thread's
stack; on a machine whose cores the workers share, that CPU is taken from the steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SETTINGS = {
    "10 ms (dask's default)": {"distributed.worker.profile.interval": "10ms"},
    "100 ms (dask-ipar's clusters)": {},
    "off": {"distributed.worker.profile.enabled": False},
}


def one(cfg, grid: str, workers: int, steps: int, setting: dict) -> float:
    """Median step seconds on a fresh cluster started under ``setting``."""
    import common as C

    cluster, client, _ = C.local_cluster(workers, os.cpu_count() or 1, config=setting)
    try:
        return C.time_dask_grid(client, cfg, grid, steps, warmup=1, profile=False,
                                executor="programs")["step_s"]
    finally:
        client.close()
        cluster.close()


def main(argv=None):
    import common as C

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--grid", default="8x1")
    p.add_argument("--mlp", default="compute")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    cfgs = {c.key: c for c in C.configs(False)}
    if a.mlp not in cfgs:
        p.error(f"--mlp: unknown {a.mlp!r}; choose from {', '.join(cfgs)}")
    if a.rounds < 1 or a.steps < 1 or a.workers < 1:
        p.error("--rounds, --steps and --workers must be at least 1")
    cfg = cfgs[a.mlp]
    times: dict = {k: [] for k in SETTINGS}
    for r in range(a.rounds):
        for name, setting in SETTINGS.items():
            times[name].append(one(cfg, a.grid, a.workers, a.steps, setting))
            print(f"round {r + 1}, profiler {name}: {times[name][-1]:.3f} s", file=sys.stderr,
                  flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    off = med["off"]
    stamp = time.strftime("%Y%m%dT%H%M%S")
    path = a.json or os.path.join(HERE, "results", f"profiler-{stamp}.json")
    res = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cores": os.cpu_count(),
           "workers": a.workers, "grid": a.grid, "mlp": cfg.describe(), "steps": a.steps,
           "rounds": a.rounds, "steps_s": times, "median_s": med}
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"`python benchmarks/profiler_cost.py --workers {a.workers} --grid {a.grid} "
          f"--mlp {a.mlp} --rounds {a.rounds} --steps {a.steps}` on {res['when']} "
          f"({res['cores']} cores; `benchmarks/results/{os.path.basename(path)}`): "
          f"{cfg.describe()}, step seconds per round, the median, and against no profiler.")
    print()
    print("| profiler | steps (s) | median (s) | / off |")
    print("|---|---|---|---|")
    for k, v in times.items():
        print(f"| {k} | {', '.join(f'{x:.3f}' for x in v)} | {med[k]:.3f} | "
              f"{med[k] / off:.3f} |")


if __name__ == "__main__":
    main()
