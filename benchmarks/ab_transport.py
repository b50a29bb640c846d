"""A/B of the worker programs' transports on one emulated cluster, interleaved.

    sudo python benchmarks/ab_transport.py [--workers 4] [--rate 1gbit] [--models cnn,weight]
        [--grid 4x1] [--rounds 2] [--steps 3] [--limits default,inf,0] [--data client]
        [--linger default] [--steps-per-program 1,4]

The same model and grid timed with the programs' messages up to each of ``--limits`` bytes
over their direct links (default: up to ``DIRECT_MAX_BYTES``, all of them, and none, i.e.
dask's comms; set on every worker between the runs), and with the batches from each of
``--data`` (``common.DATA_PATHS``: a ``.npy`` file the workers read, or the client's memory,
sent every step), and with each of ``--linger`` (seconds the links' background reader waits
after a program stopped reading them, ``wire.LINGER_S``), and with each of
``--steps-per-program`` (steps a submission), alternating ``--rounds`` times, so
that the machine's drift shows in all alike. A CNN's convs are batch-parallel.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _switch(limit, dask_worker=None):
    """Messages up to ``limit`` bytes over the direct links (0: none, None: all)."""
    from dask_ipar.runtime.exchange import PLUGIN_NAME

    plugin = dask_worker.plugins[PLUGIN_NAME]
    plugin.direct_bytes = float("inf") if limit is None else limit


def _linger(seconds, dask_worker=None):
    """The links' background reader waits ``seconds`` after a program's wait."""
    from dask_ipar.runtime import wire

    wire.LINGER_S = seconds


def _mode_name(limit, default) -> str:
    if limit is None or limit == float("inf"):
        return "direct links, all messages" + (" (the default)" if limit == default else "")
    if limit == 0:
        return "dask comms"
    return (f"direct links, messages up to {limit // 1024} KiB"
            + (" (the default)" if limit == default else ""))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--models", default="cnn,weight")
    ap.add_argument("--grid", default=None, help="default: Px1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--limits", default="default,inf,0",
                    help="the direct links' message limits to compare, in bytes: a comma list "
                         "of numbers, 'default' (DIRECT_MAX_BYTES), 'inf' (all messages), 0 "
                         "(none: dask's comms)")
    ap.add_argument("--data", default="client",
                    help="where the batches come from, a comma list of: file (a .npy file "
                         "each worker reads), client (NumPy batches sent from the client)")
    ap.add_argument("--linger", default="default",
                    help="the links' background reader's wait after a program's, in seconds: "
                         "a comma list of numbers or 'default' (wire.LINGER_S)")
    ap.add_argument("--steps-per-program", default="1",
                    help="steps a submission: a comma list of whole numbers from 1 to 16")
    a = ap.parse_args(argv)
    from dask_ipar.runtime.exchange import DIRECT_MAX_BYTES
    from dask_ipar.runtime.steps import MAX_STEPS_PER_PROGRAM

    try:
        groups = [int(x) for x in a.steps_per_program.split(",")]
    except ValueError:
        groups = []
    if not groups or not all(1 <= k <= MAX_STEPS_PER_PROGRAM for k in groups):
        ap.error(f"--steps-per-program {a.steps_per_program}: expected a comma list of whole "
                 f"numbers from 1 to {MAX_STEPS_PER_PROGRAM}")
    from dask_ipar.runtime.wire import LINGER_S

    try:
        lingers = [LINGER_S if x == "default" else float(x) for x in a.linger.split(",")]
    except ValueError:
        ap.error(f"--linger {a.linger}: give seconds or 'default'")

    try:
        limits = [DIRECT_MAX_BYTES if x == "default" else None if x == "inf" else int(x)
                  for x in a.limits.split(",")]
    except ValueError:
        ap.error(f"--limits {a.limits}: give numbers of bytes, 'default' or 'inf'")
    from distributed import Client

    import common as C

    paths = [d.strip() for d in a.data.split(",") if d.strip()]
    if not paths or any(d not in C.DATA_PATHS for d in paths):
        ap.error(f"--data {a.data}: expected a comma list of {', '.join(C.DATA_PATHS)}")
    import netcluster as N
    from dask_ipar.nn.layers import Conv2d
    from dask_ipar.runtime.exchange import install_exchange

    models = {m.key: m for m in C.configs(False) + [C.CNN]}
    grid = a.grid or f"{a.workers}x1"
    threads = max(1, (os.cpu_count() or 1) // a.workers)
    with N.emulated_cluster(a.workers, a.rate, threads=threads) as addr:
        with Client(addr) as client:
            install_exchange(client)
            for key in a.models.split(","):
                cfg = models[key]
                # a CNN's convs batch-parallel (the planner's scheme on every grid of the
                # peer sweeps; the layers' default, domain-parallel, needs Pr <= 4 here)
                layers = [dataclasses.replace(lay, parallel="batch")
                          if isinstance(lay, Conv2d) else lay
                          for lay in cfg.layers()] if key == "cnn" else None
                modes = {_mode_name(x, DIRECT_MAX_BYTES)
                         + ("" if len(paths) == 1 else f", batches from the {d}")
                         + ("" if len(lingers) == 1 else f", reader lingers {g * 1e3:g} ms")
                         + ("" if len(groups) == 1 else f", {k} steps a submission"):
                         (x, d, g, k) for x in limits for d in paths for g in lingers
                         for k in groups}
                got = {name: [] for name in modes}
                for _ in range(a.rounds):
                    for name, (limit, data, linger, k) in modes.items():
                        client.run(_switch, limit)
                        client.run(_linger, linger)
                        r = C.time_dask_grid(client, cfg, grid, a.steps, warmup=1,
                                             executor="programs", profile=False,
                                             layers=layers, data=data,
                                             steps_per_program=k)
                        got[name].append(r["step_s"])
                        print(f"{cfg.label} {grid} {name}: {r['step_s']:.3f} s", flush=True)
                print(f"{cfg.label} {grid}: " + ", ".join(
                    f"{n} {min(v):.3f}-{max(v):.3f} s" for n, v in got.items()), flush=True)
            client.run(_switch, DIRECT_MAX_BYTES)
            client.run(_linger, LINGER_S)
    print("namespaces left:", N.list_namespaces())
    return 0


if __name__ == "__main__":
    sys.exit(main())
