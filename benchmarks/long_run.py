"""Memory of long training: task records and RSS per step, with and without lineage cuts.

    python benchmarks/long_run.py [--steps 600] [--every 150] [--grid 2x2] [--save]
    python benchmarks/long_run.py --fit [--steps 10000] [--every 500] [--save]

``--fit``: the run ``dask-ipar train`` makes by default (the 64-128-64-10 MLP on the
training split of the bundled digits, B = 64, 2x2, worker programs, the dashboard's recorder
and feed, lineage cuts every 100 steps), through ``Sequential.fit`` for ``--steps`` steps,
sampled by a callback; the same table. Without it:

Trains the tiny 64-64-64-64-10 MLP (B = 64, batch embedded in the step graph) for
``--steps`` steps on a cluster whose scheduler is a process of its own
(``SubprocessCluster``), twice: ``model.lineage_steps = None`` (no cuts) and the default
(a cut every 100 steps). Every ``--every`` steps it records the largest worker's RSS,
the scheduler's RSS, the task records the workers and the scheduler hold, the task
groups the scheduler's spans hold, and the entries of dask's ``key_split`` cache (an LRU
of 100,000 keys in every process, filled by each new key name). Prints a markdown table
and the growth per step (least squares over all samples, over the second half, and over the
samples taken once every process's key cache is full); ``--save`` writes
``benchmarks/results/long-run-<time>.json``, ``--from-json`` prints a saved run again.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
import warnings
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common as C  # noqa: E402


def _worker_records(dask_worker=None):
    return len(dask_worker.state.tasks)


def _key_cache():
    """Entries in dask's ``key_split`` cache of this process (an LRU of 100,000 keys)."""
    from dask.utils import key_split

    return key_split.cache_info().currsize


def _scheduler_records(dask_scheduler=None):
    ext = dask_scheduler.extensions.get("spans")
    groups = sum(len(s.groups) for s in ext.spans.values()) if ext else 0
    return len(dask_scheduler.tasks), groups


def run(lineage_steps, steps: int, every: int, grid: str) -> dict:
    import psutil
    from distributed import Client
    from distributed.deploy.subprocess import SubprocessCluster

    from dask_ipar import SGD, Dense, Sequential
    from dask_ipar.runtime.cluster import QUIET_LOOP_CONFIG, config_environ
    from dask_ipar.layout.grid import parse_grid

    cfg = C.TINY
    n = parse_grid(grid).size
    env = config_environ({"distributed.scheduler.work-stealing": False,
                          "distributed.worker.profile.enabled": False,
                          **QUIET_LOOP_CONFIG})
    with mock.patch.dict(os.environ, env):
        cluster = SubprocessCluster(n_workers=n, threads_per_worker=1, dashboard_address=None,
                                    worker_kwargs={"memory_limit": 0})
    client = Client(cluster)
    model = Sequential([Dense(w, "relu") for w in cfg.widths[1:-1]] + [Dense(cfg.widths[-1])],
                       input_dim=cfg.widths[0], dtype="float32", seed=0)
    try:
        client.wait_for_workers(n)
        sched = psutil.Process(client.run_on_scheduler(os.getpid))
        workers = [psutil.Process(p) for p in client.run(os.getpid).values()]
        model.lineage_steps = lineage_steps
        X, y = C.make_data(cfg, 2)
        batches = [(X[k * cfg.batch:(k + 1) * cfg.batch], y[k * cfg.batch:(k + 1) * cfg.batch])
                   for k in range(2)]
        model.distribute(client, grid)
        opt = SGD(lr=0.01, momentum=0.9)
        samples = []
        t0 = time.perf_counter()
        for s in range(1, steps + 1):
            client.gather(model.train_step(*batches[s % 2], opt))
            if s % every == 0:
                samples.append(sample(client, workers, sched, s))
                print(json.dumps({"lineage_steps": lineage_steps, **samples[-1]}), flush=True)
        secs = time.perf_counter() - t0
    finally:
        model.close()
        client.close()
        cluster.close()
    return {"lineage_steps": lineage_steps, "samples": samples, "seconds": secs}


def sample(client, workers, sched, step) -> dict:
    tasks, groups = client.run_on_scheduler(_scheduler_records)
    return {
        "step": step,
        "worker_rss_mib": max(w.memory_info().rss for w in workers) / 2**20,
        "scheduler_rss_mib": sched.memory_info().rss / 2**20,
        "worker_records": max(client.run(_worker_records).values()),
        "scheduler_records": tasks,
        "span_groups": groups,
        "scheduler_key_cache": client.run_on_scheduler(_key_cache),
        "worker_key_cache": max(client.run(_key_cache).values()),
    }


def run_fit(steps: int, every: int, grid: str, profile: bool = True) -> dict:
    """``dask-ipar train``'s default run through ``fit``, sampled every ``every`` steps;
    ``profile=False`` switches off dask's statistical profiler on the workers (whose
    history of one sample tree a second is kept for an hour)."""
    import psutil
    from distributed import Client
    from distributed.deploy.subprocess import SubprocessCluster

    from dask_ipar import Dense, Sequential
    from dask_ipar.cli.config import load_config
    from dask_ipar.io.data import load_digits_split
    from dask_ipar.layout.grid import parse_grid
    from dask_ipar.runtime.cluster import QUIET_LOOP_CONFIG, SCHEDULER_CONFIG, config_environ
    from dask_ipar.runtime.loop import Callback

    cfg = load_config(None)
    hidden, batch = cfg["model"]["hidden"], cfg["train"]["batch"]
    n = parse_grid(grid).size
    env = config_environ({**QUIET_LOOP_CONFIG, **SCHEDULER_CONFIG,
                          "distributed.worker.profile.enabled": profile})
    with mock.patch.dict(os.environ, env):
        cluster = SubprocessCluster(n_workers=n, threads_per_worker=1, dashboard_address=None)
    client = Client(cluster)
    samples = []
    try:
        client.wait_for_workers(n)
        sched = psutil.Process(client.run_on_scheduler(os.getpid))
        workers = [psutil.Process(p) for p in client.run(os.getpid).values()]
        Xtr, ytr, _, _ = load_digits_split()
        model = Sequential([Dense(int(h), "relu") for h in hidden] + [Dense(10)],
                           input_dim=Xtr.shape[1], seed=0).distribute(client, grid)

        class Probe(Callback):
            def on_step_end(self, loop, stats):
                if stats.step % every == 0:
                    samples.append(sample(client, workers, sched, stats.step))
                    print(json.dumps({"fit": True, **samples[-1]}), flush=True)

        spe = len(Xtr) // batch
        t0 = time.perf_counter()
        model.fit(Xtr, ytr, epochs=-(-steps // spe), batch_size=batch, callbacks=[Probe()],
                  progress=False)
        secs = time.perf_counter() - t0
        model.close()
    finally:
        client.close()
        cluster.close()
    return {"lineage_steps": f"{model.lineage_steps} (fit{'' if profile else ', no profiler'})",
            "samples": samples,
            "seconds": secs}


def growth(samples) -> dict:
    """Least-squares growth per step of every sampled quantity (empty with < 2 samples)."""
    if len(samples) < 2:
        return {}
    xs = [p["step"] for p in samples]
    return {k: statistics.linear_regression(xs, [p[k] for p in samples]).slope
            for k in samples[0] if k != "step"}


def caches_full(samples, size: int) -> list:
    """The samples taken once the scheduler's and every worker's key cache were full."""
    return [p for p in samples
            if p.get("scheduler_key_cache") == size and p.get("worker_key_cache") == size]


def render(out: dict) -> None:
    size = out.get("key_cache_size", 100000)
    print(f"\n## Long training, tiny MLP, {out['grid']}, {out['steps']} steps\n")
    print("| lineage cut every | step | largest worker RSS (MiB) | scheduler RSS (MiB) | "
          "worker task records | scheduler task records | span task groups | "
          "key cache entries, scheduler / largest worker |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out["runs"]:
        for p in r["samples"]:
            print(f"| {r['lineage_steps'] or 'never'} | {p['step']} | {p['worker_rss_mib']:.0f} "
                  f"| {p['scheduler_rss_mib']:.0f} | {p['worker_records']} "
                  f"| {p['scheduler_records']} | {p['span_groups']} "
                  f"| {p.get('scheduler_key_cache', '-')} / {p.get('worker_key_cache', '-')} |")
    print(f"\nGrowth per step (least squares over all samples; over the second half, after "
          f"warm-up; over the samples taken once every key cache held its {size:,} keys):\n")
    print("| lineage cut every | samples | worker RSS (KB) | scheduler RSS (KB) | "
          "worker records | span task groups |")
    print("|---|---|---|---|---|---|")
    for r in out["runs"]:
        half = r["samples"][len(r["samples"]) // 2:]
        for label, sel in (("all", r["samples"]), ("second half", half),
                           ("caches full", caches_full(r["samples"], size))):
            g = growth(sel)
            if not g:
                continue
            print(f"| {r['lineage_steps'] or 'never'} | {label} (steps {sel[0]['step']}-"
                  f"{sel[-1]['step']}) | {g['worker_rss_mib'] * 1024:.1f} "
                  f"| {g['scheduler_rss_mib'] * 1024:.1f} | {g['worker_records']:.1f} "
                  f"| {g['span_groups']:.1f} |")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--every", type=int, default=150)
    ap.add_argument("--grid", default="2x2")
    ap.add_argument("--save", action="store_true")
    ap.add_argument("--fit", action="store_true",
                    help="dask-ipar train's default run through fit (one run)")
    ap.add_argument("--no-profile", action="store_true",
                    help="with --fit: dask's statistical profiler off on the workers")
    ap.add_argument("--from-json", help="print a saved run (benchmarks/results/long-run-*.json)")
    a = ap.parse_args(argv)
    if a.from_json:
        with open(a.from_json) as f:
            render(json.load(f))
        return
    warnings.filterwarnings("ignore")
    from dask.utils import key_split

    from dask_ipar import Dense, Sequential

    default = Sequential([Dense(2)], input_dim=2).lineage_steps  # the model's default
    out = {"time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "grid": a.grid, "steps": a.steps, "key_cache_size": key_split.cache_info().maxsize,
           "runs": [run_fit(a.steps, a.every, a.grid, not a.no_profile)] if a.fit else
                   [run(ls, a.steps, a.every, a.grid) for ls in (None, default)]}
    render(out)
    if a.save:
        stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S")
        path = os.path.join(HERE, "results", f"long-run-{stamp}.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
