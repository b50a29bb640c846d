"""Clusters built from the ``cluster`` section of the configuration.

``cluster.kind`` picks where the ``Pr*Pc`` workers run:

* ``local`` - a :class:`distributed.LocalCluster` of worker processes on this machine,
  the CPUs shared out between them (threads and BLAS threads per worker
  ``max(1, cores // workers)``), dashboard on 127.0.0.1 only;
* ``slurm``, ``pbs``, ``lsf``, ``sge`` - dask-jobqueue (optional extra ``hpc``): batch
  jobs of ``cluster.processes`` worker processes each, with the queue, account,
  walltime, cores and memory of the config;
* ``cluster.scheduler_address`` set - join a running cluster, whatever the kind.

:func:`make_cluster` waits for all workers (progress and timeout), and closes what it
started whatever happens. :func:`job_script` shows the batch script without submitting
anything.
"""

from __future__ import annotations

import contextlib
import warnings
import math
import os

from distributed.diagnostics.plugin import WorkerPlugin

from dask_ipar.config import DEFAULTS
from dask_ipar.errors import IparError
from dask_ipar.runtime.workers import wait_for_workers

__all__ = ["make_cluster", "job_script", "jobqueue_kwargs", "local_threads", "JOBQUEUE_CLASSES",
           "QUIET_LOOP_CONFIG", "config_environ", "mute_shutdown_heartbeat_errors",
           "open_client", "dashboard_link", "IgnoreStopSignals"]

#: dask settings of the clusters dask-ipar starts: the event-loop housekeeping of the
#: scheduler, nannies and workers runs less often than dask's defaults (a tick every 20 ms,
#: a system-monitor sample every 500 ms). On a 2-core machine an idle scheduler with four
#: workers used 15 ms of CPU per second with the defaults and 5 ms with these, CPU the
#: workers' BLAS threads share. The costs: event-loop stalls are noticed within 0.5 s
#: instead of 20 ms, and the dashboard's CPU/memory plots get a sample every 2 s.
QUIET_LOOP_CONFIG = {
    "distributed.admin.tick.interval": "500ms",
    "distributed.admin.system-monitor.interval": "2s",
}


def mute_shutdown_heartbeat_errors() -> None:
    """Drop the "Failed to communicate with scheduler during heartbeat" records of this
    process's dask worker logger (run on the workers of a cluster dask-ipar started, just
    before it shuts that cluster down).

    A worker whose heartbeat is in flight when the scheduler closes logs that error with a
    traceback (a race in dask's shutdown, harmless: the work is done and the cluster is
    going away); it read like a failure at the end of ``dask-ipar train``.
    """
    import logging

    def keep(record) -> bool:
        return "Failed to communicate with scheduler during heartbeat" not in record.getMessage()

    logging.getLogger("distributed.worker").addFilter(keep)


def _quiet_shutdown(client) -> None:
    try:
        client.run(mute_shutdown_heartbeat_errors, on_error="ignore")
    except Exception:  # scheduler already gone: nothing to mute
        pass


def config_environ(config: dict) -> dict:
    """The ``DASK_*`` environment variables that give a process started elsewhere the dask
    settings ``config`` (dotted keys)."""
    return {"DASK_" + k.upper().replace(".", "__").replace("-", "_"): str(v)
            for k, v in config.items()}


def _config_env(config: dict) -> list[str]:
    """``export`` lines for a job script: :func:`config_environ` of ``config``."""
    return [f"export {k}={v}" for k, v in config_environ(config).items()]

#: dask-jobqueue cluster and job class names for each batch system.
JOBQUEUE_CLASSES = {
    "slurm": ("SLURMCluster", "dask_jobqueue.slurm", "SLURMJob"),
    "pbs": ("PBSCluster", "dask_jobqueue.pbs", "PBSJob"),
    "lsf": ("LSFCluster", "dask_jobqueue.lsf", "LSFJob"),
    "sge": ("SGECluster", "dask_jobqueue.sge", "SGEJob"),
}


def _section(cfg: dict) -> dict:

    c = dict(DEFAULTS["cluster"])
    c.update(cfg.get("cluster", {}) or {})
    return c


def _check_n(n_workers):
    if not isinstance(n_workers, int) or isinstance(n_workers, bool) or n_workers < 1:
        raise IparError(f"number of workers must be a positive integer, got {n_workers!r}.")


def _jobqueue():
    try:
        import dask_jobqueue
    except ImportError:
        raise IparError(
            "batch-system clusters (slurm, pbs, lsf, sge) need dask-jobqueue, which is not "
            "installed. Install it with: pip install 'dask-ipar[hpc]' "
            "(or set cluster.kind: local)."
        ) from None
    return dask_jobqueue


def local_threads(cfg: dict, n_workers: int) -> int:
    """Threads (and BLAS threads) per local worker: ``max(1, cores // n_workers)``.

    ``cores`` is ``cluster.cores``, else the CPUs this process may use.
    """
    _check_n(n_workers)
    cores = _section(cfg).get("cores")
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - macOS, Windows
            cores = os.cpu_count() or 1
    return max(1, cores // n_workers)


def _security(c: dict):
    if not c.get("tls"):
        return None
    from distributed.security import Security

    sec = Security()  # reads distributed.comm.tls.* from dask's config
    if not sec.tls_ca_file:
        raise IparError(
            "cluster.tls is true but dask's config has no distributed.comm.tls.ca-file. "
            "Set distributed.comm.tls.ca-file, .scheduler.cert/.key, .worker.cert/.key and "
            ".client.cert/.key (see docs/hpc.md), or set cluster.tls: false."
        )
    return sec


def jobqueue_kwargs(cfg: dict, n_workers: int) -> dict:
    """Keyword arguments of the dask-jobqueue cluster/job class for ``cfg``.

    ``cores`` defaults to ``processes`` (one thread per worker process).
    """
    _check_n(n_workers)
    c = _section(cfg)
    processes = int(c["processes"])
    cores = c["cores"] if c["cores"] is not None else processes
    if cores < processes:
        raise IparError(
            f"cluster.cores is {cores} but cluster.processes is {processes}; each worker "
            f"process needs at least one core. Set cores >= {processes}."
        )
    kw = {
        "cores": cores,
        "memory": c["memory"],
        "processes": processes,
        "walltime": c["walltime"],
        "job_extra_directives": list(c.get("job_extra") or []),
    }
    prologue = _config_env(QUIET_LOOP_CONFIG)  # exported before the worker processes start
    if c.get("reuse_memory", True):
        prologue += [f"export {k}={v}" for k, v in REUSE_MEMORY_ENV.items()]
    kw["job_script_prologue"] = prologue
    for k in ("queue", "interface", "local_directory"):
        if c.get(k) is not None:
            kw[k] = c[k]
    if c.get("account") is not None:
        # SLURM and PBS call it account; LSF and SGE call it project
        kw["account" if c["kind"] in ("slurm", "pbs") else "project"] = c["account"]
    return kw


def job_script(cfg: dict, n_workers: int, scheduler_address: str = "tcp://scheduler:8786") -> str:
    """The batch script one job of a ``cluster.kind`` cluster would submit (nothing runs).

    Parameters
    ----------
    cfg : dict
        Configuration (``cluster`` section used).
    n_workers : int
        Workers the run needs (the grid's ``Pr*Pc``); jobs are ``ceil(n / processes)``.
    scheduler_address : str
        Written into the worker command line.
    """
    c = _section(cfg)
    kind = c["kind"]
    if kind not in JOBQUEUE_CLASSES:
        raise IparError(
            f"cluster.kind is {kind!r}; job scripts exist only for "
            f"{', '.join(JOBQUEUE_CLASSES)}. Set cluster.kind to your batch system."
        )
    _jobqueue()
    import importlib

    _, module, job_name = JOBQUEUE_CLASSES[kind]
    job_cls = getattr(importlib.import_module(module), job_name)
    kw = jobqueue_kwargs(cfg, n_workers)
    kw.pop("interface", None)  # resolving an interface needs it to exist here
    return job_cls(scheduler=scheduler_address, name="dask-ipar-worker", **kw).job_script()


#: glibc malloc settings of the worker processes (``cluster.reuse_memory``). dask's
#: default ``MALLOC_TRIM_THRESHOLD_=65536`` returns freed memory to the OS at once and
#: turns off glibc's adaptive mmap threshold, so every block-sized array of every step is
#: a fresh ``mmap`` whose pages fault in again; with these, arrays up to 32 MiB come from
#: the heap and freed memory up to 64 MiB stays for the next step's arrays (measured on 4
#: workers: MLP steps 7-17% shorter, peak memory per worker within 10%; docs/hpc.md).
REUSE_MEMORY_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(64 * 2**20),
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


class IgnoreStopSignals(WorkerPlugin):
    """Worker plugin: the worker process ignores SIGINT and SIGTERM.

    Ctrl-C in a terminal reaches the whole process group, a batch system's SIGTERM every
    process of the job: the workers of a cluster the command started must outlive both,
    so that the command can stop after the step in flight, write its checkpoint and shut
    them down itself. Registered on the scheduler, so a worker that a nanny restarts gets
    it too. (A nanny's worker runs its event loop, where plugins are set up, in its main
    thread, the only one that may set signal handlers.)"""

    name = "dask-ipar-ignore-stop-signals"
    idempotent = True

    def setup(self, worker):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, signal.SIG_IGN)


def _n_jobs(n_workers: int, processes: int) -> int:
    return math.ceil(n_workers / processes)


@contextlib.contextmanager
def make_cluster(cfg: dict, n_workers: int, *, device: str = "cpu", log=None):
    """Start (or join) the cluster of ``cfg`` for ``n_workers`` workers; yield a Client.

    Parameters
    ----------
    cfg : dict
        Configuration from :func:`dask_ipar.config.load_config` (``cluster`` section).
    n_workers : int
        Workers the grid needs (``Pr*Pc``); a local cluster starts exactly these,
        a batch cluster ``ceil(n_workers / processes)`` jobs.
    device : {"cpu", "cuda"}
        With ``"cuda"`` a local cluster is dask-cuda's LocalCUDACluster (one worker per
        GPU) when dask-cuda is installed and there is a GPU per worker; otherwise worker
        processes share the GPUs.
    log : callable, optional
        Gets progress lines (``waiting for workers: 2/4 connected``).

    Yields
    ------
    distributed.Client
        Connected, with at least ``n_workers`` workers. On exit the client is closed and
        any cluster started here is shut down (its batch jobs cancelled); a cluster
        joined by ``scheduler_address`` is left running.

    Raises
    ------
    IparError
        Unknown kind, dask-jobqueue missing, scheduler unreachable, or not enough workers
        within ``cluster.wait_timeout`` seconds.
    """
    import dask
    from distributed import Client

    _check_n(n_workers)
    c = _section(cfg)
    kind = c["kind"]
    security = _security(c)
    wait_s = float(c["wait_timeout"])

    if c.get("scheduler_address"):
        addr = c["scheduler_address"]
        try:
            client = Client(addr, timeout=float(c["connect_timeout"]), security=security)
        except (OSError, TimeoutError) as exc:
            raise IparError(
                f"could not reach a dask scheduler at {addr!r} within "
                f"{float(c['connect_timeout']):.0f} s ({type(exc).__name__}). Check the "
                "address (for example tls://host:8786) and that the scheduler is running."
            ) from exc
        try:
            wait_for_workers(client, n_workers, wait_s, log)
            yield client
        finally:
            client.close()
        return

    if kind == "local":
        from distributed import LocalCluster

        threads = local_threads(cfg, n_workers)
        blas = str(threads)
        # The dashboard binds to localhost only; a busy 8787 falls back to a free port (the
        # printed link says which). Without a dashboard the scheduler's small HTTP server
        # (health, metrics) takes a random local port.
        dash = "127.0.0.1:8787" if c["dashboard"] and _has_bokeh() else "127.0.0.1:0"
        cluster_cls = (_cuda_cluster_class(n_workers) if device == "cuda" else None) \
            or LocalCluster
        kwargs = dict(
            n_workers=n_workers,
            threads_per_worker=threads,
            host="127.0.0.1",
            dashboard_address=dash,
            security=security,
            protocol="tls://" if security is not None else None,
            env={"OMP_NUM_THREADS": blas, "OPENBLAS_NUM_THREADS": blas,
                 "MKL_NUM_THREADS": blas},
        )
        if cluster_cls is LocalCluster:
            kwargs["processes"] = True
        with warnings.catch_warnings(), worker_environment(c.get("reuse_memory", True)), \
                dask.config.set(QUIET_LOOP_CONFIG):
            warnings.filterwarnings("ignore", message="Port .* is already in use")
            cluster = cluster_cls(**kwargs)
    elif kind in JOBQUEUE_CLASSES:
        jq = _jobqueue()
        cls = getattr(jq, JOBQUEUE_CLASSES[kind][0])
        kw = jobqueue_kwargs(cfg, n_workers)
        sched = {"dashboard_address": "127.0.0.1:8787"} if c["dashboard"] else {"dashboard": False}
        if security is not None:
            kw["security"] = security
            kw["protocol"] = "tls://"
        try:
            with dask.config.set(QUIET_LOOP_CONFIG):  # the scheduler runs in this process
                cluster = cls(scheduler_options=sched, **kw)
        except Exception as exc:
            raise IparError(
                f"could not start the {kind} cluster ({type(exc).__name__}: {exc}). Check the "
                "cluster section of the config (queue, account, interface)."
            ) from exc
        if log is not None:
            log(f"submitting {_n_jobs(n_workers, kw['processes'])} {kind} job(s) for "
                f"{n_workers} workers ({kw['processes']} per job)")
    else:
        raise IparError(
            f"cluster.kind is {kind!r}, expected local, slurm, pbs, lsf or sge."
        )
    try:
        if kind != "local":
            cluster.scale(n=n_workers)
        client = Client(cluster, security=security)
        if kind == "local":
            client.register_plugin(IgnoreStopSignals(), name=IgnoreStopSignals.name)
        try:
            wait_for_workers(client, n_workers, wait_s, log)
            yield client
        finally:
            _quiet_shutdown(client)
            client.close()
    finally:
        cluster.close()


def _has_bokeh() -> bool:
    try:
        import bokeh  # noqa: F401
    except ImportError:
        return False
    return True


def open_client(n_workers: int | None = None, scheduler_address: str | None = None, *,
                threads_per_worker: int = 1, dashboard: bool = True, device: str = "cpu",
                connect_timeout_s: float = 10.0, wait_timeout_s: float = 60.0, log=None):
    """Yield a ``distributed.Client`` on a new LocalCluster or an existing scheduler.

    A shortcut to :func:`dask_ipar.runtime.cluster.make_cluster` with the default
    configuration: a LocalCluster started here (worker processes, dashboard on
    127.0.0.1) is closed on exit, whatever happens; a remote cluster is left
    running and only the client disconnects.
    """
    import copy


    cfg = copy.deepcopy(DEFAULTS)
    cfg["cluster"].update(
        kind="local", scheduler_address=scheduler_address, dashboard=dashboard,
        connect_timeout=connect_timeout_s, wait_timeout=wait_timeout_s,
    )
    if scheduler_address is None:
        if n_workers is None or n_workers < 1:
            raise IparError(f"number of workers must be a positive integer, got {n_workers!r}.")
        cfg["cluster"]["cores"] = threads_per_worker * n_workers
    return make_cluster(cfg, n_workers or 1, device=device, log=log)


def _cuda_cluster_class(n_workers: int):
    """dask-cuda's LocalCUDACluster when it is installed and there is a GPU per worker."""
    try:
        import cupy
        from dask_cuda import LocalCUDACluster
    except ImportError:
        return None
    try:
        n_gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return None
    return LocalCUDACluster if n_gpus >= n_workers else None


def dashboard_link(client) -> str | None:
    """The dashboard URL, or None when it cannot be served (bokeh missing)."""
    if not _has_bokeh():
        return None
    if client.scheduler_info().get("services", {}).get("dashboard") is None:
        return None
    return client.dashboard_link
