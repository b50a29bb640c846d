"""What the /ipar dashboard costs a training step: the compute-bound MLP with the dashboard
off (``dask-ipar.dashboard: False``: no recorder, no feed, no page) and on with the page
open (fetched every 2 s, as a browser does), alternated on fresh clusters, medians.

    python benchmarks/dashboard_overhead.py [--rounds 3] [--steps 12]

Prints a JSON line; ``benchmarks/run.py``-style sections are written by hand into
docs/benchmarks.md from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request


def one_fit(on: bool, steps: int, width: int, batch: int, grid: str, executor: str) -> float:
    import dask
    import numpy as np
    from distributed import Client, LocalCluster

    from dask_ipar import Dense, Sequential

    with dask.config.set({"dask-ipar.dashboard": on}), \
            LocalCluster(n_workers=2, threads_per_worker=1, host="127.0.0.1",
                         dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        rng = np.random.default_rng(0)
        X = rng.standard_normal((batch * (steps + 2), width)).astype(np.float32)
        y = rng.integers(0, 10, len(X))
        model = Sequential([Dense(width, "relu"), Dense(width, "relu"), Dense(width, "relu"),
                            Dense(10)], input_dim=width).distribute(client, grid)
        model.executor = executor
        model.fit(X[:2 * batch], y[:2 * batch], epochs=1, batch_size=batch)  # warm-up
        stop = threading.Event()
        port = client.scheduler_info()["services"]["dashboard"]

        def poll():  # the page open in a browser
            while not stop.wait(2.0):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/ipar/fragment").read()
                except OSError:
                    pass

        t = threading.Thread(target=poll, daemon=True)
        if on:
            t.start()
        done = []
        model.fit(X, y, epochs=1, batch_size=batch, progress=lambda st: done.append(
            time.perf_counter()))
        stop.set()
        model.close()
    gaps = [b - a for a, b in zip(done[2:], done[3:])]  # steady state
    return statistics.median(gaps)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--grid", default="1x2")
    p.add_argument("--executor", default="programs")
    a = p.parse_args()
    off, on = [], []
    for _ in range(a.rounds):
        off.append(one_fit(False, a.steps, a.width, a.batch, a.grid, a.executor))
        on.append(one_fit(True, a.steps, a.width, a.batch, a.grid, a.executor))
    res = {"model": f"MLP {a.width}x3+10, B={a.batch}, grid {a.grid}, {a.executor}",
           "step_s_off": off, "step_s_on_page_open": on,
           "ratio_on_off": statistics.median(on) / statistics.median(off)}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
