"""A/B of the worker programs' transports on one emulated cluster, interleaved.

    sudo python benchmarks/ab_transport.py [--workers 4] [--rate 1gbit] [--models cnn,weight]
        [--grid 4x1] [--rounds 2] [--steps 3]

The same model and grid timed with the programs' small messages over their direct links
(the default), all of them, and none (dask's comms; set on every worker between the runs),
alternating ``--rounds`` times, so that the machine's drift shows in all alike.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _switch(limit, dask_worker=None):
    """Messages up to ``limit`` bytes over the direct links (0: none, None: all)."""
    from dask_ipar.runtime.exchange import PLUGIN_NAME

    plugin = dask_worker.plugins[PLUGIN_NAME]
    plugin.direct_bytes = float("inf") if limit is None else limit


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--models", default="cnn,weight")
    ap.add_argument("--grid", default=None, help="default: Px1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args(argv)
    from distributed import Client

    import common as C
    import netcluster as N
    from dask_ipar.runtime.exchange import DIRECT_MAX_BYTES, install_exchange

    models = {m.key: m for m in C.configs(False) + [C.CNN]}
    grid = a.grid or f"{a.workers}x1"
    threads = max(1, (os.cpu_count() or 1) // a.workers)
    with N.emulated_cluster(a.workers, a.rate, threads=threads) as addr:
        with Client(addr) as client:
            install_exchange(client)
            for key in a.models.split(","):
                cfg = models[key]
                modes = {"direct links, small messages (the default)": DIRECT_MAX_BYTES,
                         "direct links, all messages": None, "dask comms": 0}
                got = {name: [] for name in modes}
                for _ in range(a.rounds):
                    for name, limit in modes.items():
                        client.run(_switch, limit)
                        r = C.time_dask_grid(client, cfg, grid, a.steps, warmup=1,
                                             executor="programs", profile=False)
                        got[name].append(r["step_s"])
                        print(f"{cfg.label} {grid} {name}: {r['step_s']:.3f} s", flush=True)
                print(f"{cfg.label} {grid}: " + ", ".join(
                    f"{n} {min(v):.3f}-{max(v):.3f} s" for n, v in got.items()), flush=True)
            client.run(_switch, DIRECT_MAX_BYTES)
    print("namespaces left:", N.list_namespaces())
    return 0


if __name__ == "__main__":
    sys.exit(main())
