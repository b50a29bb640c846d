"""The settings of the processes of the clusters dask-ipar starts: dask's event-loop
housekeeping, glibc's malloc, BLAS threads, and the ``cluster`` section they come from.

Shared by the local clusters (:mod:`.cluster`) and the batch-system ones (:mod:`.batch`).
"""

from __future__ import annotations

import contextlib
import logging
import os

from dask_ipar.config import DEFAULTS
from dask_ipar.errors import IparError

__all__ = ["usable_cpus", "config_seconds", "QUIET_LOOP_CONFIG", "SCHEDULER_CONFIG", "REUSE_MEMORY_ENV", "BLAS_THREAD_VARS", "cluster_key",
           "blas_environ",
           "config_environ", "config_exports", "worker_environment", "cluster_section",
           "check_n", "worker_malloc_env", "malloc_advice", "check_malloc", "malloc_checked"]


def usable_cpus() -> int:
    """The CPUs this process may use (its affinity; the machine's count where the platform
    has none)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


#: dask settings of the clusters dask-ipar starts: the event-loop housekeeping of the
#: scheduler, nannies and workers runs less often than dask's defaults (a tick every 20 ms,
#: a system-monitor sample every 500 ms). On a 2-core machine an idle scheduler with four
#: workers used 15 ms of CPU per second with the defaults and 5 ms with these, CPU the
#: workers' BLAS threads share. The costs: event-loop stalls are noticed within 0.5 s
#: instead of 20 ms, and the dashboard's CPU/memory plots get a sample every 2 s.
#: dask's own logs (``distributed.admin.low-level-log-length``: transitions, events per
#: topic, each worker's profile of every second) keep 200 entries instead of 1,000: the
#: workers' profile history otherwise grows for 1,000 s (about 2 KB per training step at
#: 7.5 steps/s, 15 KB a second) before it is flat. The dashboard's Profile page then shows
#: the last 200 s.
#: The workers' statistical profiler samples every 100 ms instead of 10 (dask's default):
#: each sample is a turn of the worker's event loop that takes the GIL and walks every
#: thread's stack. Eight workers sharing 2 cores took 1.105x as long per training step
#: (8x1, the 4096-wide MLP) with 10 ms sampling as without the profiler, 0.99x with 100 ms
#: (``benchmarks/profiler_cost.py``; ``docs/benchmarks.md``, "Session 39"). The Profile page of the dashboard then rests on
#: 10 samples a second per worker, enough for tasks and steps of 0.1 s and more.
QUIET_LOOP_CONFIG = {
    "distributed.admin.tick.interval": "500ms",
    "distributed.admin.system-monitor.interval": "2s",
    "distributed.admin.low-level-log-length": 200,
    "distributed.worker.profile.interval": "100ms",
}


#: Settings of the schedulers dask-ipar starts (local and batch clusters): a worker that
#: sends no heartbeat for a minute (stopped, hung, a suspended job) is removed from the
#: cluster (dask's default waits 5 minutes). While a model trains or saves, dask-ipar
#: notices sooner (``dask-ipar.hung-after``, 30 s) and restarts the worker through its
#: nanny; this covers the rest (evaluation, prediction, idle clients).
SCHEDULER_CONFIG = {
    "distributed.scheduler.worker-ttl": "60s",
}


def config_seconds(key: str, default: float, expected: str) -> float:
    """The dask config ``key`` as positive seconds (``"30s"``, ``45``, ``"2 minutes"``);
    an :class:`IparError` naming the key and ``expected`` otherwise."""
    import dask
    from dask.utils import parse_timedelta

    value = dask.config.get(key, default)
    try:
        secs = float(parse_timedelta(value, default="s"))
    except (TypeError, ValueError, KeyError):
        secs = -1.0
    if not secs > 0:
        raise IparError(f"the dask config key {key} is {value!r}; expected {expected}.")
    return secs


def config_environ(config: dict) -> dict:
    """The ``DASK_*`` environment variables that give a process started elsewhere the dask
    settings ``config`` (dotted keys)."""
    return {"DASK_" + k.upper().replace(".", "__").replace("-", "_"): str(v)
            for k, v in config.items()}


def config_exports(config: dict) -> list[str]:
    """``export`` lines for a job script: :func:`config_environ` of ``config``."""
    return [f"export {k}={v}" for k, v in config_environ(config).items()]


#: The variables the BLAS libraries NumPy may use (OpenBLAS, MKL, OpenMP builds) read for
#: their thread count. dask's nanny sets all three to 1 in every worker it starts
#: (``distributed.nanny.pre-spawn-environ``) unless the nanny's own environment sets them.
BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def blas_environ(threads: int) -> dict:
    """Environment giving a worker process ``threads`` BLAS threads."""
    return {k: str(int(threads)) for k in BLAS_THREAD_VARS}


def cluster_section(cfg: dict) -> dict:
    """The ``cluster`` section of ``cfg`` over the defaults."""
    c = dict(DEFAULTS["cluster"])
    c.update(cfg.get("cluster", {}) or {})
    return c


def check_n(n_workers) -> None:
    """IparError unless ``n_workers`` is a positive integer."""
    if not isinstance(n_workers, int) or isinstance(n_workers, bool) or n_workers < 1:
        raise IparError(f"number of workers must be a positive integer, got {n_workers!r}.")


#: glibc malloc settings of the worker processes (``cluster.reuse_memory``): one heap for
#: every thread (``MALLOC_ARENA_MAX=1``), arrays of any size carved from it instead of a
#: mapping of their own (``MALLOC_MMAP_MAX_=0``), and freed memory kept for the next step's
#: arrays (``MALLOC_TRIM_THRESHOLD_`` 1 TiB: glibc never trims it): a worker's resident
#: memory stays at its largest step's until it idles 2 s, when it hands the memory back
#: (:mod:`dask_ipar.runtime.release`). Without them every array over 32 MiB (glibc's default)
#: or over 128 KiB (dask's nanny default, ``MALLOC_TRIM_THRESHOLD_=65536``, which turns off
#: the adaptive threshold) is a fresh mapping whose pages fault in again at every step; on a
#: virtual machine that reports free pages to its host that costs up to 5 ms per MiB
#: (measured: a 268 MB join 1.1-1.5 s fresh, 15-25 ms reused). docs/hpc.md, "Worker memory
#: reuse", has the measurements.
REUSE_MEMORY_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**40),
    "MALLOC_TOP_PAD_": str(16 * 2**20),
}


@contextlib.contextmanager
def worker_environment(reuse_memory: bool = True):
    """dask config under which new worker processes get :data:`REUSE_MEMORY_ENV` (or not).

    glibc reads these variables when a process starts, so they must be in
    ``distributed.nanny.pre-spawn-environ`` when the nannies start their workers. The
    nannies also copy them into this process's ``os.environ``; that is undone on exit,
    so clusters started later in the same process get their own setting.
    """
    import dask

    saved = {k: os.environ.get(k) for k in REUSE_MEMORY_ENV}
    env = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {})
    # the nannies prefer this process's environment to the config: set both
    if reuse_memory:
        env.update(REUSE_MEMORY_ENV)
        os.environ.update(REUSE_MEMORY_ENV)
    else:
        for k in REUSE_MEMORY_ENV:
            os.environ.pop(k, None)
            env.pop(k, None)
        env["MALLOC_TRIM_THRESHOLD_"] = os.environ["MALLOC_TRIM_THRESHOLD_"] = "65536"
    try:
        with dask.config.set({"distributed.nanny.pre-spawn-environ": env}):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: Schedulers whose workers' malloc settings need no (more) advice: checked once, or
#: started by dask-ipar with the user's ``cluster.reuse_memory`` (:func:`malloc_checked`).
_MALLOC_CHECKED: set = set()


def worker_malloc_env() -> dict | None:
    """On a worker: its values of the :data:`REUSE_MEMORY_ENV` variables (None where
    unset), or None where the process does not run on glibc (they mean nothing there)."""
    import platform

    if platform.libc_ver()[0] != "glibc":
        return None
    return {k: os.environ.get(k) for k in (*REUSE_MEMORY_ENV, "MALLOC_MMAP_THRESHOLD_")}


def malloc_advice(envs: dict) -> str | None:
    """What to tell a user whose workers hand freed memory back to the OS at once, or None.

    ``envs``: worker address -> :func:`worker_malloc_env`. A worker started with
    ``MALLOC_TRIM_THRESHOLD_`` and without ``MALLOC_MMAP_THRESHOLD_`` or
    ``MALLOC_MMAP_MAX_`` (what a dask nanny gives the workers it starts) has glibc's
    adaptive mmap threshold off: every array over 128 KiB is a fresh mapping whose pages
    fault in again, every step.
    """
    slow = sorted(w for w, e in envs.items()
                  if e and e.get("MALLOC_TRIM_THRESHOLD_") is not None
                  and e.get("MALLOC_MMAP_THRESHOLD_") is None
                  and e.get("MALLOC_MMAP_MAX_") is None)
    if not slow:
        return None
    trim = envs[slow[0]]["MALLOC_TRIM_THRESHOLD_"]
    exports = " ".join(f"{k}={v}" for k, v in REUSE_MEMORY_ENV.items())
    return (f"{len(slow)} of {len(envs)} workers run with MALLOC_TRIM_THRESHOLD_={trim} and "
            "without MALLOC_MMAP_THRESHOLD_ (a dask nanny's default): glibc then maps every "
            "array over 128 KiB afresh and its pages fault in again at every step (training "
            "steps measured 1.05-1.3x longer; docs/hpc.md, 'Worker memory reuse'). Start "
            f"the workers with {exports} in their environment, as the clusters dask-ipar "
            "starts have them (dask-ipar train --workers N, "
            "dask_ipar.runtime.cluster.open_client); or leave them where memory is scarcer "
            "than time (with them a worker keeps the memory of its largest step until it idles).")


def cluster_key(client):
    """Which cluster ``client`` talks to, for once-per-cluster work: its scheduler's id
    (a scheduler started later at the same address is another cluster), else its address,
    else None."""
    try:
        sid = client.scheduler_info().get("id")
    except Exception:  # no identity yet (an asynchronous client not started)
        sid = None
    return sid or getattr(getattr(client, "scheduler", None), "address", None)


def malloc_checked(client) -> None:
    """No malloc advice for ``client``'s cluster (one dask-ipar started as configured)."""
    key = cluster_key(client)
    if key:
        _MALLOC_CHECKED.add(key)


def check_malloc(client, workers, log=None) -> str | None:
    """Ask ``workers`` for their malloc settings, once per scheduler, and log
    :func:`malloc_advice` (a warning of the ``dask_ipar`` logger, or ``log``) where they
    hand freed memory back at once; returns the advice (None: none, or already given)."""
    key = cluster_key(client)
    if not key or key in _MALLOC_CHECKED:
        return None
    _MALLOC_CHECKED.add(key)
    try:
        envs = client.run(worker_malloc_env, workers=list(workers))
    except Exception:  # advice only: a worker that cannot answer is no error here
        return None
    if not isinstance(envs, dict):  # an asynchronous client's coroutine: no advice
        getattr(envs, "close", lambda: None)()
        return None
    advice = malloc_advice(envs)
    if advice:
        (log or logging.getLogger("dask_ipar").warning)(f"dask-ipar: {advice}")
    return advice
