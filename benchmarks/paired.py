"""Paired (A-B-A) re-check of one target on a shared, noisy machine.

    python benchmarks/paired.py --procs 2 [--mlp weight] [--grid 2x1] [--steps 3]

Runs PyTorch DDP, then dask-ipar on ``--grid``, then PyTorch DDP again, back to back,
recording the 1-minute load average before each, so that a ratio is not an artefact of
load that changed between two parts of a long run. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common as C  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--mlp", default="weight", choices=["compute", "weight"])
    ap.add_argument("--grid", default=None, help="default: Px1")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--executor", default="graph", choices=["graph", "programs"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--save", action="store_true",
                    help="write benchmarks/results/paired-<mlp>-P<procs>-<time>.json")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    cfg = {c.key: c for c in C.configs(a.quick)}[a.mlp]
    grid = a.grid or f"{a.procs}x1"
    cores = os.cpu_count()
    out = {"mlp": cfg.key, "procs": a.procs, "grid": grid, "quick": a.quick, "runs": [],
           "executor": a.executor,
           "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    for what in ("ddp", "dask", "ddp"):
        load = os.getloadavg()[0]
        if what == "ddp":
            r = C.time_torch(cfg, a.procs, cores, a.steps)
        else:
            cluster, client, _ = C.local_cluster(a.procs, cores)
            try:
                r = C.time_dask_grid(client, cfg, grid, a.steps, profile=False,
                                     executor=a.executor)
            finally:
                client.close()
                cluster.close()
        out["runs"].append({"what": what, "load1": load, "step_s": r.get("step_s"),
                            "error": r.get("error")})
        print(out["runs"][-1], flush=True)
    ddp = [r["step_s"] for r in out["runs"] if r["what"] == "ddp" and r["step_s"]]
    dk = out["runs"][1]["step_s"]
    if ddp and dk:
        out["ratio_vs_mean_ddp"] = dk / (sum(ddp) / len(ddp))
    print(json.dumps(out))
    if a.save:
        name = f"paired-{cfg.key}-P{a.procs}-{time.strftime('%Y%m%dT%H%M')}.json"
        with open(os.path.join(HERE, "results", name), "w") as fh:
            json.dump(out, fh, indent=1)
        out["file"] = name
    return out


if __name__ == "__main__":
    main()
