"""Shared pieces of the benchmarks: MLP configurations, the NumPy compute-limit step,
timing dask-ipar steps, counting tasks, hops, scheduler time, memory, bandwidth.

Only the engine's public API is used (``Sequential``, ``Dense``, ``SGD``,
``model.train_step``, ``model.engine.train_step``, ``dask_ipar.cost``).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from unittest import mock

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# ----------------------------------------------------------------- configurations
@dataclass(frozen=True)
class MLPConfig:
    key: str          # "compute" or "weight"
    label: str
    widths: tuple     # (d_0, d_1, ..., d_L)
    batch: int

    @property
    def flops(self) -> float:
        """FLOPs of one SGD step: 6 * B * sum(d_in * d_out) (forward, dX, dW)."""
        return 6.0 * self.batch * sum(a * b for a, b in zip(self.widths[:-1], self.widths[1:]))

    @property
    def params(self) -> int:
        return sum((a + 1) * b for a, b in zip(self.widths[:-1], self.widths[1:]))

    def describe(self) -> str:
        hidden = self.widths[1:-1]
        return (f"{self.widths[0]}-" + "-".join(str(w) for w in hidden) + f"-{self.widths[-1]}, "
                f"B={self.batch}")

    def spec(self) -> dict:
        """The model for the PyTorch peers (peers.py ``--spec``)."""
        return {"kind": "mlp", "widths": list(self.widths)}

    def layers(self):
        from dask_ipar import Dense

        return [Dense(w, "relu") for w in self.widths[1:-1]] + [Dense(self.widths[-1])]

    def build_model(self, layers=None):
        from dask_ipar import Sequential

        return Sequential(layers or self.layers(), input_dim=self.widths[0], dtype="float32",
                          seed=0)

    def data(self, n_batches: int = 2, seed: int = 0):
        return make_data(self, n_batches, seed)


@dataclass(frozen=True)
class CNNConfig:
    """A CNN in the paper's regime: 3x3 convs (same padding, ReLU), each followed by a 2x2
    max pooling, then large dense layers."""

    key: str
    label: str
    image: tuple      # (C, H, W)
    filters: tuple    # output channels of each conv
    dense: tuple      # hidden dense widths
    classes: int
    batch: int

    @property
    def widths(self) -> tuple:  # the dense part, as an MLP's: (flattened, *dense, classes)
        c, h, w = self.image
        k = 2 ** len(self.filters)
        return (self.filters[-1] * (h // k) * (w // k), *self.dense, self.classes)

    def describe(self) -> str:
        return (f"{'x'.join(map(str, self.image))} input, convs {'-'.join(map(str, self.filters))}"
                f" (3x3, each + 2x2 max pool), dense {'-'.join(map(str, self.widths))}, "
                f"B={self.batch}")

    def spec(self) -> dict:
        return {"kind": "cnn", "image": list(self.image), "filters": list(self.filters),
                "dense": list(self.dense), "classes": self.classes}

    def layers(self):
        from dask_ipar import Dense
        from dask_ipar.nn.layers import Conv2d, Flatten, MaxPool2d

        front = [lay for f in self.filters for lay in (Conv2d(f, 3, activation="relu"),
                                                       MaxPool2d(2))]
        return front + [Flatten()] + [Dense(w, "relu") for w in self.dense] + [
            Dense(self.classes)]

    def build_model(self, layers=None):
        from dask_ipar import Sequential

        return Sequential(layers or self.layers(), input_shape=self.image, dtype="float32",
                          seed=0)

    def data(self, n_batches: int = 2, seed: int = 0):
        rng = np.random.default_rng(seed)
        X = rng.standard_normal((self.batch * n_batches, *self.image), dtype=np.float32)
        y = rng.integers(0, self.classes, self.batch * n_batches)
        return X, y


#: The CNN of issue 23's peer comparison, and a small one (``--quick``).
CNN = CNNConfig("cnn", "CNN", (3, 64, 64), (32, 32, 64, 64), (4096, 4096), 10, 64)
CNN_QUICK = CNNConfig("cnn", "CNN", (3, 32, 32), (16, 16, 32, 32), (1024, 1024), 10, 16)


def sweep_models(quick: bool = False) -> dict:
    """The peer sweep's models by key (``compute``, ``weight``, ``cnn``)."""
    return {**{c.key: c for c in configs(quick)}, "cnn": CNN_QUICK if quick else CNN}


def configs(quick: bool) -> list[MLPConfig]:
    if quick:
        return [
            MLPConfig("compute", "compute-bound", (1024, 1024, 1024, 1024, 10), 256),
            MLPConfig("weight", "weight-dominated", (2048, 2048, 2048, 10), 32),
        ]
    return [
        MLPConfig("compute", "compute-bound", (4096, 4096, 4096, 4096, 10), 1024),
        MLPConfig("weight", "weight-dominated", (8192, 8192, 8192, 10), 128),
    ]


TINY = MLPConfig("tiny", "tiny (overhead)", (64, 64, 64, 64, 10), 64)


def tiny_of_depth(layers: int) -> MLPConfig:
    """The tiny MLP with ``layers`` layers (hidden widths 64, 10 classes, B=64)."""
    return MLPConfig(f"tiny{layers}", f"tiny, {layers} layers",
                     (64,) * layers + (10,), TINY.batch)


def make_data(cfg: MLPConfig, n_batches: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((cfg.batch * n_batches, cfg.widths[0]), dtype=np.float32)
    y = rng.integers(0, cfg.widths[-1], cfg.batch * n_batches)
    return X, y


#: Where dask-ipar's training batches come from in the timed steps (``--data``): ``file``,
#: a ``.npy`` file each worker reads its own blocks of (the cells' reads of data that
#: lives outside the client, :mod:`dask_ipar.io.lazy`; on the emulated clusters the hosts
#: share this machine's file system, as the nodes of a cluster share its file system),
#: as the PyTorch peers hold their batch on each rank; ``client``, NumPy batches in the
#: client's memory, sent to the workers every step (8x1 with the compute-bound MLP: the
#: whole 16 MiB batch to each of the 8 workers).
DATA_PATHS = ("file", "client")


@contextlib.contextmanager
def step_batches(cfg, model, data: str = "client", n_batches: int = 2):
    """``cfg``'s ``n_batches`` training batches for ``model``, as ``[(Xb, yb), ...]``, from
    where ``data`` (one of :data:`DATA_PATHS`) says; a ``file``'s directory is removed on
    exit."""
    import tempfile

    from dask_ipar.io.data import as_inputs, as_labels

    if data not in DATA_PATHS:
        raise ValueError(f"data={data!r}: expected one of {', '.join(DATA_PATHS)}")
    X, y = cfg.data(n_batches)
    B = cfg.batch
    if data == "client":
        yield [(X[k * B:(k + 1) * B], y[k * B:(k + 1) * B]) for k in range(n_batches)]
        return
    with tempfile.TemporaryDirectory(prefix="dask-ipar-bench-") as tmp:
        np.save(os.path.join(tmp, "X.npy"), X)
        np.save(os.path.join(tmp, "y.npy"), y)
        Xf = as_inputs(np.load(os.path.join(tmp, "X.npy"), mmap_mode="r"), model.input_dim,
                       model.input_shape, np.float32)
        yf = as_labels(np.load(os.path.join(tmp, "y.npy"), mmap_mode="r"), len(y),
                       cfg.widths[-1])
        yield [(Xf[k * B:(k + 1) * B], yf[k * B:(k + 1) * B]) for k in range(n_batches)]


def sweep_parser(doc: str, default_runs: str):
    """The argument parser of a script that runs on several emulated clusters: ``--runs``
    (a list of PxRATE, :func:`parse_runs`) and ``--md`` (the markdown file to write)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=default_runs, help="comma list of PxRATE (e.g. 4x1gbit)")
    ap.add_argument("--md", default=None, help="write the section into this markdown file")
    return ap


def parse_runs(ap, text: str) -> list[tuple[int, str]]:
    """``[(P, rate)]`` of a ``--runs`` list such as ``4x1gbit,2x10gbit`` (``ap.error`` on
    an item of another form)."""
    import re

    runs = []
    for item in text.split(","):
        m = re.fullmatch(r"(\d+)x(\w+)", item.strip())
        if not m:
            ap.error(f"--runs {text}: {item!r} is not PxRATE such as 4x1gbit")
        runs.append((int(m[1]), m[2]))
    return runs


def grids_of(p: int) -> list[tuple[int, int]]:
    """Every Pr x Pc grid of p workers, pure batch (1 x p) first."""
    return [(p // pc, pc) for pc in range(p, 0, -1) if p % pc == 0]


def median_time(fn, warmup: int = 1, reps: int = 3) -> float:
    """Median wall time of ``fn()`` over ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return median(ts)


def median(xs):
    return float(statistics.median(xs)) if xs else float("nan")


def pipelined_step(*runs):
    """The step of back-to-back intervals whose steps overlap (each interval holds the rest
    of the step before it), over one or more ``runs`` of them: the median of the means of
    two consecutive intervals of a run. An interval that ends early leaves more of its step
    to the next, so single intervals alternate about the step (pure batch on 8 emulated
    hosts: 2.4, 1.8, 2.5, 1.8 s) and their median is either; two in a row hold two steps'
    work. Runs of one interval: the median of the intervals."""
    windows = [(a + b) / 2 for ts in runs for a, b in zip(ts, ts[1:])]
    return median(windows or [t for ts in runs for t in ts])


# ------------------------------------------------------------- NumPy reference
class NumpyMLP:
    """Single-process SGD step of the same MLP (ReLU hidden layers, softmax
    cross-entropy, momentum SGD), written for speed: samples x features
    layout, preallocated buffers, every matmul a single sgemm into ``out=``,
    in-place activations and updates."""

    def __init__(self, widths, batch, lr=0.01, momentum=0.9, seed=0, dtype=np.float32):
        rng = np.random.default_rng(seed)
        self.widths, self.B, self.lr, self.mu = list(widths), batch, lr, momentum
        self.W, self.b, self.vW, self.vb = [], [], [], []
        for a, o in zip(widths[:-1], widths[1:]):
            lim = np.sqrt(6.0 / (a + o))
            self.W.append(rng.uniform(-lim, lim, size=(o, a)).astype(dtype))   # (d_out, d_in)
            self.b.append(np.zeros(o, dtype))
            self.vW.append(np.zeros((o, a), dtype))
            self.vb.append(np.zeros(o, dtype))
        self.act = [np.empty((batch, w), dtype) for w in widths]    # activations, (B, d)
        self.dz = [np.empty((batch, w), dtype) for w in widths]
        # row-block height of the blocked momentum update: about 1 MiB of weights per block
        self.rows = [max(8, min(w.shape[0], (1 << 20) // (4 * w.shape[1]))) for w in self.W]
        self.dW = [np.empty_like(w) for w in self.W]

    def step(self, X, y):
        L = len(self.W)
        self.act[0][...] = X
        for l in range(L):
            z = self.act[l + 1]
            np.matmul(self.act[l], self.W[l].T, out=z)               # (B, d_out)
            z += self.b[l]
            if l < L - 1:
                np.maximum(z, 0, out=z)
        logits = self.act[L]
        p = self.dz[L]
        np.subtract(logits, logits.max(axis=1, keepdims=True), out=p)
        np.exp(p, out=p)
        p /= p.sum(axis=1, keepdims=True)
        rows = np.arange(self.B)
        loss = -np.log(p[rows, y] + 1e-30).mean()
        p[rows, y] -= 1
        p /= self.B
        for l in range(L - 1, -1, -1):
            dz = self.dz[l + 1]
            db = dz.sum(axis=0)
            if l > 0:
                dx = self.dz[l]
                np.matmul(dz, self.W[l], out=dx)                      # (B, d_in), old W
                dx *= self.act[l] > 0
            # dW in one sgemm, then the momentum update in row blocks that stay in cache
            # (four element-wise passes per block instead of four over the whole matrix)
            W, vW, dW = self.W[l], self.vW[l], self.dW[l]
            np.matmul(dz.T, self.act[l], out=dW)                     # (d_out, d_in)
            R = self.rows[l]
            for r0 in range(0, W.shape[0], R):
                r1 = min(r0 + R, W.shape[0])
                g, v = dW[r0:r1], vW[r0:r1]
                v *= self.mu
                v += g
                np.multiply(v, self.lr, out=g)
                W[r0:r1] -= g
            vb = self.vb[l]
            vb *= self.mu
            vb += db
            self.b[l] -= self.lr * vb
        return float(loss)


def time_numpy(cfg: MLPConfig, steps: int, threads: int | None = None) -> dict:
    """Median step time of :class:`NumpyMLP` (after one warm-up step)."""
    load1 = os.getloadavg()[0]
    X, y = make_data(cfg, 1)
    net = NumpyMLP(cfg.widths, cfg.batch)
    ts = []
    with _null():
        net.step(X, y)
        for _ in range(steps):
            t0 = time.perf_counter()
            net.step(X, y)
            ts.append(time.perf_counter() - t0)
    t = median(ts)
    return {"step_s": t, "steps_s": ts, "gflops": cfg.flops / t / 1e9, "load1": load1}


def time_sgemm(n: int = 4096, reps: int = 3) -> float:
    """GFLOP/s of one n x n x n float32 matmul (the machine's compute ceiling)."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    c = np.empty_like(a)
    np.matmul(a, a, out=c)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.matmul(a, a, out=c)
        ts.append(time.perf_counter() - t0)
    return 2 * n ** 3 / median(ts) / 1e9


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# -------------------------------------------------------------- dask clusters
def blas_env(threads: int) -> dict:
    """BLAS threads, and the malloc settings dask-ipar's own clusters give their workers."""
    from dask_ipar.runtime.cluster import REUSE_MEMORY_ENV

    t = str(threads)
    return {"OMP_NUM_THREADS": t, "OPENBLAS_NUM_THREADS": t, "MKL_NUM_THREADS": t,
            **REUSE_MEMORY_ENV}


def local_cluster(n_workers: int, cores: int, malloc_env: dict | None = None,
                  config: dict | None = None):
    """LocalCluster of worker processes; BLAS threads per worker = max(1, cores // n);
    the event-loop and profiler settings of dask-ipar's own clusters (``QUIET_LOOP_CONFIG``;
    before session 39 the profiler was off here);
    ``malloc_env``: the workers' glibc malloc variables instead of ``REUSE_MEMORY_ENV``;
    ``config``: dask settings over those."""
    import dask
    from distributed import Client, LocalCluster

    from dask_ipar.runtime.cluster import QUIET_LOOP_CONFIG, REUSE_MEMORY_ENV

    threads = max(1, cores // n_workers)
    env = blas_env(threads)
    if malloc_env is not None:
        env = {**{k: v for k, v in env.items() if k not in REUSE_MEMORY_ENV}, **malloc_env}
    with dask.config.set({**QUIET_LOOP_CONFIG,
                          "distributed.nanny.pre-spawn-environ": env,
                          "distributed.worker.memory.target": False,
                          "distributed.worker.memory.spill": False,
                          "distributed.worker.memory.pause": False,
                          "distributed.worker.memory.terminate": False,
                          "distributed.scheduler.active-memory-manager.start": False,
                          "optimization.fuse.active": False,
                          "distributed.scheduler.work-stealing": False, **(config or {})}):
        cluster = LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                               dashboard_address=None, memory_limit=0)
        client = Client(cluster)
    client.wait_for_workers(n_workers)
    return cluster, client, threads


def worker_pids(client) -> dict:
    return client.run(os.getpid)


def reset_peak_rss(pids) -> bool:
    """Reset each process's peak RSS (VmHWM) by writing 5 to /proc/PID/clear_refs."""
    ok = True
    for pid in pids:
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            ok = False
    return ok


def peak_rss(pid) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _worker_peak_rss():
    """Run on a worker: its own peak RSS."""
    return peak_rss(os.getpid())


def _worker_reset_peak():
    """Run on a worker: reset its own peak RSS."""
    return reset_peak_rss([os.getpid()])


def _sched_cpu():
    """CPU seconds of the scheduler's event-loop thread (run on the scheduler)."""
    import time as _t
    return _t.thread_time()


# ---------------------------------------------------------------- graph profile
def graph_profile(model, cfg: MLPConfig, optimizer, executor: str = "graph") -> dict:
    """Tasks per step, dependent hops and graph-build time, from ``model.engine.train_step``.

    The graph is built with placeholder input/weight names (it is never submitted),
    exactly as ``model.train_step`` builds it. With ``executor="programs"`` the build
    includes compiling it into worker programs, and ``tasks`` counts the scheduler's tasks
    (one program per worker plus one per output block; ``graph_tasks`` the kernels they
    run); the chains and hops are those of the kernels' data flow either way.
    """
    from dask_ipar.runtime.compiler import compile_programs

    from dask._task_spec import TaskRef

    eng = model.engine
    grid = model.grid
    L = cfg.layers
    xk = {(i, j): TaskRef((f"bx-{i}-{j}", i, j)) for i, j in grid.cells()}
    yk = {(i, j): TaskRef((f"by-{i}-{j}", i, j)) for i, j in grid.cells()}
    w = [f"prof.w{l}-x" for l in range(L)]
    v = [f"prof.v{l}-x" for l in range(L)]
    times = []
    for s in range(15):  # ~1 ms each: the median of many, as the client's loop may interfere
        t0 = time.perf_counter()
        g, new_w, _, stats = eng.train_step(xk, yk, cfg.batch, w, v, 10**9 + s, optimizer.lr,
                                            optimizer.momentum, optimizer.weight_decay)
        if executor == "programs":
            outputs = [(n, i, j) for n in new_w for i, j in grid.cells()] + stats
            hlg, *_ = compile_programs(g, outputs, model._locate, f"prof-{s}", f"p-s{s}",
                                      first=stats)
            n_tasks = len(hlg.layers[f"prof-{s}"])
        else:
            g.to_hlg(f"prof-{s}")
            n_tasks = len(g.dsk)
        times.append(time.perf_counter() - t0)
    dsk, place = g.dsk, g.place
    # longest chains: in tasks, and in worker-to-worker hops (edges between different workers)
    depth, hops = {}, {}

    def visit(key):
        if key in depth:
            return
        stack = [(key, False)]
        while stack:
            k, done = stack.pop()
            if k in depth:
                continue
            deps = [d for d in getattr(dsk[k], "dependencies", ()) if d in dsk]
            if not done:
                stack.append((k, True))
                stack.extend((d, False) for d in deps if d not in depth)
                continue
            depth[k] = 1 + max((depth[d] for d in deps), default=0)
            hops[k] = max((hops[d] + (place.get(d) != place.get(k)) for d in deps), default=0)

    for k in dsk:
        visit(k)
    per_worker = {}
    for k, wk in place.items():
        per_worker[wk] = per_worker.get(wk, 0) + 1
    return {
        "executor": executor,
        "tasks": n_tasks,
        "graph_tasks": len(dsk),
        "tasks_per_layer": n_tasks / L,
        "tasks_per_worker_max": max(per_worker.values()),
        "depth": max(depth.values()),
        "hops": max(hops.values()),
        "hops_per_layer": max(hops.values()) / L,
        "build_s": median(times[1:]),
    }


# ------------------------------------------------------ scheduler in its own process
def time_own_scheduler(cfg: MLPConfig, grid: str, steps: int, floor: bool = True,
                       executor: str = "graph") -> dict:
    """Per-step scheduler CPU with the scheduler in a process of its own.

    In a LocalCluster the scheduler's event loop is also the client's: its CPU time then
    includes sending the batches and the graph. Here the scheduler runs in its own
    subprocess (``SubprocessCluster``), as on a real cluster, and its whole-process CPU
    time (all threads) per step is measured with psutil; the client's graph build is
    measured separately (:func:`graph_profile`). ``floor``: also measure dask's own cost for
    the same graph (:func:`noop_floor`). ``executor``: ``Sequential.executor`` of the
    timed steps.
    """
    import psutil
    from distributed import Client
    from distributed.deploy.subprocess import SubprocessCluster

    from dask_ipar import SGD, Dense, Sequential
    from dask_ipar.runtime.cluster import QUIET_LOOP_CONFIG, config_environ
    from dask_ipar.layout.grid import parse_grid

    n = parse_grid(grid).size
    # the subprocesses read their dask config from the environment
    env = config_environ({"distributed.scheduler.work-stealing": False,
                          "distributed.worker.profile.enabled": False,
                          "distributed.scheduler.active-memory-manager.start": False,
                          **QUIET_LOOP_CONFIG})
    with mock.patch.dict(os.environ, env):
        cluster = SubprocessCluster(n_workers=n, threads_per_worker=1, dashboard_address=None,
                                    worker_kwargs={"memory_limit": 0})
    client = Client(cluster)
    opt = SGD(lr=0.01, momentum=0.9)
    model = Sequential([Dense(w, "relu") for w in cfg.widths[1:-1]] + [Dense(cfg.widths[-1])],
                       input_dim=cfg.widths[0], dtype="float32", seed=0)
    try:
        client.wait_for_workers(n)
        sched = psutil.Process(client.run_on_scheduler(os.getpid))
        X, y = make_data(cfg, 2)
        batches = [(X[k * cfg.batch:(k + 1) * cfg.batch], y[k * cfg.batch:(k + 1) * cfg.batch])
                   for k in range(2)]
        model.distribute(client, grid)
        model.executor = executor
        for k in range(2):
            client.gather(model.train_step(*batches[k % 2], opt))
        ts = []
        c0 = sum(sched.cpu_times()[:2])  # clock-tick resolution: take the mean over steps
        for k in range(steps):
            t0 = time.perf_counter()
            client.gather(model.train_step(*batches[k % 2], opt))
            ts.append(time.perf_counter() - t0)
        cpu = sum(sched.cpu_times()[:2]) - c0
        prof = graph_profile(model, cfg, opt, executor)
        out = {"grid": grid, "executor": executor, "step_s": median(ts),
               "sched_cpu_s": cpu / steps,
               "build_s": prof["build_s"], "tasks": prof["tasks"]}
        if floor:
            out["noop"] = noop_floor(client, model, cfg, opt, sched, steps)
        return out
    finally:
        model.close()
        client.close()
        cluster.close()


def noop_floor(client, model, cfg: MLPConfig, optimizer, sched, steps: int) -> dict:
    """dask's own cost for the engine's step graph: the same graph (tasks, placement,
    dependencies, requested keys) with every kernel replaced by ``kernels.blocks.fetched``, which
    does nothing but receive its dependencies. Its inputs (batch blocks, the first weight
    and the momentum slices) are one-element placeholder arrays scattered once to their
    cells; each step reads the weight keys the step before produced, as in training. The
    scheduler sees the same computed tasks, restrictions, replica traffic and step-to-step
    dependencies as in real steps, and no computation. Returns the scheduler's CPU and the
    wall time per step.
    """
    from dask._task_spec import Task, TaskRef
    from distributed import wait

    from dask_ipar.kernels import blocks as K
    eng, grid, L = model.engine, model.grid, cfg.layers
    xk = {(i, j): TaskRef((f"floor.bx-{i}-{j}", i, j)) for i, j in grid.cells()}
    yk = {(i, j): TaskRef((f"floor.by-{i}-{j}", i, j)) for i, j in grid.cells()}
    w = [f"floor.w{l}-x" for l in range(L)]
    v = [f"floor.v{l}-x" for l in range(L)]
    external = [ref.key for ref in list(xk.values()) + list(yk.values())]
    external += [(n, i, j) for n in w + v for i, j in grid.cells()]
    placeholders = []
    for key in external:
        placeholders.append(client.scatter({key: np.zeros(1, np.float32)}, hash=False,
                                           workers=[model.binding.worker(*key[1:3])]))

    def submit(s, w_names):
        g, new_w, new_v, stats = eng.train_step(xk, yk, cfg.batch, w_names, v, 2 * 10**9 + s,
                                                optimizer.lr, optimizer.momentum,
                                                optimizer.weight_decay)
        for key, node in list(g.dsk.items()):
            g.dsk[key] = Task(key, K.fetched, *[TaskRef(d) for d in sorted(
                node.dependencies, key=str)])
        keys = [(n, i, j) for n in new_w for i, j in grid.cells()] + stats
        futs = client.get(g.to_hlg(f"floor-{s}"), keys, sync=False)
        return futs, futs[len(futs) - len(stats):], new_w

    # as the real steps run and are timed: each step reads the weights the step before
    # wrote, the loss statistics are waited for, and a step's futures are held until the
    # next step is submitted
    held, stats, w_cur = submit(0, w)  # warm-up
    client.gather(stats)
    ts = []
    c0 = sum(sched.cpu_times()[:2])
    for s in range(1, steps + 1):
        t0 = time.perf_counter()
        futs, stats, w_cur = submit(s, w_cur)
        held = futs
        client.gather(stats)
        ts.append(time.perf_counter() - t0)
    wait(held)
    cpu = sum(sched.cpu_times()[:2]) - c0
    del placeholders, held
    return {"sched_cpu_s": cpu / steps, "step_s": median(ts)}


# -------------------------------------------------------------- timed dask steps
def time_dask_grid(client, cfg: MLPConfig, grid: str, steps: int, warmup: int = 1,
                   memory: bool = False, pids=None, profile: bool = True,
                   executor: str = "graph", layers=None, more: bool = True,
                   data: str = "client", steps_per_program: int = 1) -> dict:
    """Median step time of dask-ipar on ``grid`` (train_step + gather), with the
    per-step overhead profile and (optionally) peak RSS per worker. ``executor``:
    ``Sequential.executor`` of the steps; ``layers``: the model's layers (a CNN's with the
    planner's conv schemes), else ``cfg``'s; ``more``: every step but the last says
    another follows (``train_step(more=True)``, as ``fit`` within an epoch); ``data``:
    where the batches come from (:data:`DATA_PATHS`); ``steps_per_program``: steps per
    submission (with several, ``steps`` steps, at least 3 submissions, are timed a
    submission at a time)."""
    model = cfg.build_model(layers)
    with step_batches(cfg, model, data) as batches:
        out = _time_steps(client, cfg, model, batches, grid, steps, warmup, memory, profile,
                          executor, more, steps_per_program)
    out["data"] = data
    return out


def _submit_k(model, batches, k, opt, more):
    """``k`` steps as one submission (``fit``'s way): a function that waits for their loss
    statistics and returns the last step's."""
    from dask_ipar.runtime.steps import gather_losses, submit_steps

    first = model._step + 1
    losses = submit_steps(model, [(*batches[i % 2], opt) for i in range(k)], ahead=more)
    return lambda: [gather_losses(model._store, f, first + i)
                    for i, f in enumerate(losses)][-1]


def _time_steps(client, cfg, model, batches, grid, steps, warmup, memory, profile, executor,
                more, group: int = 1) -> dict:
    from distributed import wait

    from dask_ipar import SGD

    opt = SGD(lr=0.01, momentum=0.9)
    out = {"grid": grid, "executor": executor, "load1": os.getloadavg()[0]}
    try:
        model.distribute(client, grid)
        model.executor = executor
        out["steps_per_program"] = group
        if group > 1:
            return _time_submissions(client, cfg, model, batches, group, steps, warmup, opt,
                                     more, out)
        for k in range(warmup):
            Xb, yb = batches[k % 2]
            r0 = client.gather(model.train_step(Xb, yb, opt, more=more))
            if k == 0:
                out["first_loss"] = float(np.sum(r0, axis=0)[0]) / cfg.batch
        # the warm-up's backward and update run on after its loss statistics came back:
        # wait for its new weights, so that the first step's allocations (new momentum and
        # weight blocks; later steps update them in place) are not in the peak measured
        wait([f for lay in model.state_blocks()["layers"] for f in lay["w"].values()])
        if memory:
            client.run(_worker_reset_peak)
        # one more step, untimed: a timed interval then always holds the rest of the step
        # before it (see the method notes), as in steady state
        c0 = client.run_on_scheduler(_sched_cpu)
        client.gather(model.train_step(*batches[warmup % 2], opt, more=more))
        t_end = time.perf_counter()
        # intervals end to end, from one step's loss statistics back to the next's: every
        # timed step says another follows (as the simulated steady-state step: its new
        # weights pushed to their readers), and an untimed last step takes the pushed
        # weights; nothing of a step runs between two intervals
        ts, submit = [], []
        for k in range(steps):
            Xb, yb = batches[k % 2]
            t0 = time.perf_counter()
            futs = model.train_step(Xb, yb, opt, more=more)
            t1 = time.perf_counter()
            res = client.gather(futs)
            t2 = time.perf_counter()
            ts.append(t2 - t_end)
            submit.append(t1 - t0)
            t_end = t2
            loss = float(np.sum(res, axis=0)[0]) / cfg.batch
        c1 = client.run_on_scheduler(_sched_cpu)
        if more:
            client.gather(model.train_step(*batches[steps % 2], opt, more=False))
        out.update(step_s=pipelined_step(ts), steps_s=ts, submit_s=median(submit),
                   sched_cpu_s=(c1 - c0) / (steps + 1), loss=loss)
        if memory:
            peaks = client.run(_worker_peak_rss)
            out["peak_rss"] = peaks
            out["peak_rss_max"] = max(peaks.values())
        if profile:
            out["profile"] = graph_profile(model, cfg, opt, executor)
        # the last step's backward and update run on after its loss statistics came back
        wait([f for lay in model.state_blocks()["layers"] for f in lay["w"].values()])
    finally:
        model.close()
    return out


def _time_submissions(client, cfg, model, batches, k, steps, warmup, opt, more, out):
    """:func:`_time_steps` with ``k`` steps a submission: intervals end to end from one
    submission's last loss statistics to the next's, each over its ``k`` steps."""
    from distributed import wait

    for w in range(warmup):
        r0 = client.gather(model.train_step(*batches[w % 2], opt, more=more))
        if w == 0:
            out["first_loss"] = float(np.sum(r0, axis=0)[0]) / cfg.batch
    _submit_k(model, batches, k, opt, more)()  # untimed: an interval holds the rest before
    t_end, ts = time.perf_counter(), []
    for _ in range(max(3, -(-steps // k))):
        res = _submit_k(model, batches, k, opt, more)()
        t2 = time.perf_counter()
        ts.append((t2 - t_end) / k)
        t_end = t2
    if more:
        client.gather(model.train_step(*batches[0], opt, more=False))
    wait([f for lay in model.state_blocks()["layers"] for f in lay["w"].values()])
    out.update(step_s=pipelined_step(ts), steps_s=ts,
               loss=float(np.sum(res, axis=0)[0]) / cfg.batch)
    return out


def write_json(path: str, res: dict) -> None:
    """A benchmark's raw numbers to ``path`` (indented JSON)."""
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def write_section(path: str, name: str, body: str) -> None:
    """Put ``body`` (which starts with ``<!-- NAME:begin -->`` and ends with
    ``<!-- NAME:end -->``) into the markdown file ``path``: in place of the old section of
    that name, else at the end (other scripts keep it: benchmarks/run.py)."""
    import re

    try:
        with open(path) as fh:
            old = fh.read()
    except OSError:
        old = ""
    pat = re.compile(rf"<!-- {name}:begin -->.*?<!-- {name}:end -->\n?", re.S)
    new = pat.sub(lambda m: body, old) if pat.search(old) else old.rstrip("\n") + "\n\n" + body
    with open(path, "w") as fh:
        fh.write(new)


# ------------------------------------------------------------ transfer timing
def _make_block(nbytes):
    import numpy as _np
    return _np.ones(nbytes // 4, dtype=_np.float32)


def _touch(x):
    return int(x.nbytes)


def transfer_time(client, src: str, dst: str, nbytes: int, reps: int = 3) -> float:
    """Median seconds to move an ``nbytes`` block from worker ``src`` to ``dst`` (a task on
    ``dst`` that depends on it), minus the same round trip with a 4-byte block."""
    def once(n):
        a = client.submit(_make_block, n, workers=[src], key=f"xfer-src-{uuid.uuid4().hex}",
                          allow_other_workers=False)
        a.result()
        t0 = time.perf_counter()
        b = client.submit(_touch, a, workers=[dst], key=f"xfer-dst-{uuid.uuid4().hex}",
                          allow_other_workers=False)
        b.result()
        dt = time.perf_counter() - t0
        del a, b
        return dt

    once(4)
    small = median([once(4) for _ in range(reps)])
    big = median([once(nbytes) for _ in range(reps)])
    return big, small


# ------------------------------------------------------------------ PyTorch DDP
def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def time_torch(cfg: MLPConfig, procs: int, cores: int, steps: int, timeout: float = 900) -> dict:
    """Run benchmarks/torch_ddp.py in a subprocess; returns its JSON (or an error)."""
    cmd = [sys.executable, os.path.join(HERE, "torch_ddp.py"), "--procs", str(procs),
           "--widths", ",".join(map(str, cfg.widths)), "--batch", str(cfg.batch),
           "--steps", str(steps), "--cores", str(cores)]
    load1 = os.getloadavg()[0]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line), load1=load1)
    return {"error": (r.stderr or r.stdout)[-800:]}


class Sampler:
    """Background thread sampling a callable; keeps the max (unused by default)."""

    def __init__(self, fn, interval=0.05):
        self.fn, self.interval, self.peak = fn, interval, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.fn())
            except Exception:
                pass
            self._stop.wait(self.interval)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *a):
        self._stop.set()
        self._t.join()
