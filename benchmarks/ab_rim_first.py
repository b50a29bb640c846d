"""A/B of the domain-parallel conv's rim-first backward on one emulated cluster, interleaved.

    sudo python benchmarks/ab_rim_first.py [--workers 4] [--rate 1gbit] [--rounds 3]
        [--steps 4] [--image 128] [--filters 64,64,64] [--batch 32]

A CNN in the domain-parallel regime (large images, a small batch: ``--image`` square
3-channel images, 3x3 convs of ``--filters`` each followed by a 2x2 max pooling, then a
small dense head), its convs domain-parallel on ``Px1``, timed with the halo rows' input
gradient computed first (``dask_ipar.nn.conv.rim_first``, the default) and without it
(``rim_first`` replaced by one that says no, on the client, where the graphs are built),
alternating ``--rounds`` times so that the machine's drift shows in both alike. Beside
each, the step model's prediction for the same graph (the calibrated machine). Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--image", type=int, default=128)
    ap.add_argument("--filters", default="64,64,64")
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args(argv)
    from distributed import Client

    import common as C
    import netcluster as N
    import dask_ipar.nn.conv as NC
    from dask_ipar.nn.layers import Conv2d
    from dask_ipar.runtime.calibrate import calibrate
    from dask_ipar.runtime.gridrank import simulate_layers

    filters = tuple(int(f) for f in a.filters.split(","))
    cfg = C.CNNConfig("domain-cnn", "domain CNN", (3, a.image, a.image), filters, (256,), 10,
                      a.batch)
    layers = [dataclasses.replace(lay, parallel="domain") if isinstance(lay, Conv2d) else lay
              for lay in cfg.layers()]
    grid = f"{a.workers}x1"
    default = NC.rim_first
    modes = {"rim first": default, "without": lambda *a, **k: None}
    got = {m: [] for m in modes}
    pred = {}
    with N.emulated_cluster(a.workers, a.rate) as addr:
        with Client(addr) as client:
            machine = calibrate(client)
            for name, rule in modes.items():
                NC.rim_first = rule
                pred[name] = simulate_layers(layers, cfg.image, grid, cfg.batch, machine,
                                             cores=os.cpu_count()).seconds
            try:
                for _ in range(a.rounds):
                    for name, rule in modes.items():
                        NC.rim_first = rule
                        r = C.time_dask_grid(client, cfg, grid, a.steps, warmup=1,
                                             executor="programs", profile=False,
                                             layers=layers)
                        got[name].append(r["step_s"])
                        print(f"{cfg.label} {grid} {name}: {r['step_s']:.3f} s", flush=True)
            finally:
                NC.rim_first = default
    print(f"\n{cfg.describe()}, convs domain-parallel on {grid}, {a.workers} emulated hosts at "
          f"{a.rate}; {a.rounds} interleaved rounds of {a.steps} steps (each a median)\n")
    print("| backward | step (s), median | rounds (s) | predicted (s) |")
    print("|---|---|---|---|")
    for name in modes:
        print(f"| {name} | {statistics.median(got[name]):.3f} | "
              f"{', '.join(f'{s:.3f}' for s in got[name])} | {pred[name]:.3f} |")
    print("namespaces left:", N.list_namespaces())
    return 0


if __name__ == "__main__":
    sys.exit(main())
