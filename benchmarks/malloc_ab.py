"""Worker malloc settings side by side: step time and peak memory per worker (issue 23).

    python benchmarks/malloc_ab.py [--workers 4] [--steps 5] [--rounds 2] [--json out.json]

Three LocalClusters of ``--workers`` processes, started in turn with the glibc malloc
variables of (a) dask's nanny default (``MALLOC_TRIM_THRESHOLD_=65536``), (b) dask-ipar's
settings before 2026-12-04 (heap up to 32 MiB, 64 MiB kept), (c) ``REUSE_MEMORY_ENV`` (one
heap, no per-array mappings, freed memory kept until the worker idles). On each: the
benchmarks' MLPs on pure batch and on 4x1 and the CNN on 2x2 (worker programs), median of
``--steps`` steps after a warm-up, and the largest worker's peak RSS (VmHWM). ``--rounds``
interleaves the three, because this machine's speed moves within minutes. Prints a markdown table: medians over
the rounds, and each setting's ratio to (c).
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

import common as C  # noqa: E402

from dask_ipar.runtime.cluster import REUSE_MEMORY_ENV  # noqa: E402

SETTINGS = {
    "dask default": {"MALLOC_TRIM_THRESHOLD_": "65536"},
    "before": {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
               "MALLOC_TRIM_THRESHOLD_": str(64 * 2**20),
               "MALLOC_TOP_PAD_": str(16 * 2**20)},
    "reuse (now)": dict(REUSE_MEMORY_ENV),
}


def jobs(workers):
    mlps = {c.key: c for c in C.configs(False)}
    return [(mlps["weight"], f"1x{workers}"), (mlps["weight"], f"{workers}x1"),
            (mlps["compute"], f"1x{workers}"), (C.CNN, "2x2" if workers == 4 else f"1x{workers}")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    got: dict = {}
    for r in range(a.rounds):
        for name, env in SETTINGS.items():
            cluster, client, _ = C.local_cluster(a.workers, cores, malloc_env=env)
            try:
                for cfg, grid in jobs(a.workers):
                    out = C.time_dask_grid(client, cfg, grid, a.steps, memory=True,
                                           profile=False, executor="programs")
                    key = f"{cfg.key} {grid}"
                    got.setdefault(key, {}).setdefault(name, []).append(
                        (out["step_s"], out["peak_rss_max"]))
                    print(f"round {r} {name:13s} {key:14s} {out['step_s']:.3f} s  peak "
                          f"{out['peak_rss_max'] / 2**20:.0f} MiB", flush=True)
            finally:
                client.close()
                cluster.close()
    rows = ["| model, grid | " + " | ".join(f"{n}: step s, peak MiB" for n in SETTINGS)
            + " | step / reuse (default, before) |", "|---" * (len(SETTINGS) + 2) + "|"]
    for key, by in got.items():
        med = {n: (statistics.median(s for s, _ in v), statistics.median(p for _, p in v))
               for n, v in by.items()}
        ref = med["reuse (now)"][0]
        cells = [f"{s:.3f}, {p / 2**20:.0f}" for s, p in med.values()]
        rows.append(f"| {key} | " + " | ".join(cells) + " | "
                    + ", ".join(f"{med[n][0] / ref:.2f}" for n in ("dask default", "before"))
                    + " |")
    print("\n".join(rows))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "workers": a.workers,
                       "steps": a.steps, "settings": SETTINGS, "results": got}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
