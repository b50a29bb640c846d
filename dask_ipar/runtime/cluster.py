"""Clusters built from the ``cluster`` section of the configuration.

``cluster.kind`` picks where the ``Pr*Pc`` workers run:

* ``local`` - a :class:`distributed.LocalCluster` of worker processes on this machine,
  the CPUs shared out between them (threads and BLAS threads per worker
  ``max(1, cores // workers)``), dashboard on 127.0.0.1 only;
* ``slurm``, ``pbs``, ``lsf``, ``sge`` - dask-jobqueue (optional extra ``hpc``): batch
  jobs of ``cluster.processes`` worker processes each, with the queue, account,
  walltime, cores and memory of the config (:mod:`.batch`: job scripts, rejected
  submissions, dead jobs replaced);
* ``cluster.scheduler_address`` set - join a running cluster, whatever the kind.

:func:`make_cluster` waits for all workers (progress and timeout), and closes what it
started whatever happens. :func:`job_script` shows the batch script without submitting
anything.
"""

from __future__ import annotations

import contextlib
import warnings

from distributed.diagnostics.plugin import WorkerPlugin

from dask_ipar.config import DEFAULTS
from dask_ipar.errors import IparError
from dask_ipar.runtime.batch import (
    JOBQUEUE_CLASSES,
    forget,
    job_script,
    jobqueue_kwargs,
    start_batch_cluster,
)
from dask_ipar.runtime.worker_env import (
    QUIET_LOOP_CONFIG,
    SCHEDULER_CONFIG,
    REUSE_MEMORY_ENV,
    blas_environ,
    check_n,
    cluster_section,
    config_environ,
    malloc_checked,
    usable_cpus,
    worker_environment,
)
from dask_ipar.runtime.workers import wait_for_workers

__all__ = ["make_cluster", "job_script", "jobqueue_kwargs", "local_threads", "JOBQUEUE_CLASSES",
           "QUIET_LOOP_CONFIG", "REUSE_MEMORY_ENV", "config_environ", "worker_environment",
           "mute_shutdown_heartbeat_errors", "open_client", "dashboard_link", "serves",
           "IgnoreStopSignals"]



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


def local_threads(cfg: dict, n_workers: int) -> int:
    """Threads (and BLAS threads) per local worker: ``max(1, cores // n_workers)``.

    ``cores`` is ``cluster.cores``, else the CPUs this process may use.
    """
    check_n(n_workers)
    cores = cluster_section(cfg).get("cores")
    if cores is None:
        cores = usable_cpus()
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

    check_n(n_workers)
    c = cluster_section(cfg)
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
            env=blas_environ(threads),
        )
        if cluster_cls is LocalCluster:
            kwargs["processes"] = True
        with warnings.catch_warnings(), worker_environment(c.get("reuse_memory", True)), \
                dask.config.set({**QUIET_LOOP_CONFIG, **SCHEDULER_CONFIG}):
            warnings.filterwarnings("ignore", message="Port .* is already in use")
            cluster = cluster_cls(**kwargs)
    elif kind in JOBQUEUE_CLASSES:
        cluster = start_batch_cluster(cfg, n_workers, security=security, log=log)
    else:
        raise IparError(
            f"cluster.kind is {kind!r}, expected local, slurm, pbs, lsf or sge."
        )
    with contextlib.ExitStack() as stack:
        if kind != "local":
            # dask closes the job of a worker that left when no worker of its name is back
            # within lost-worker-timeout (15 s): it would cancel the replacement job that
            # replace_dead_jobs submits under that name while it waits in the queue
            # (dask reads the setting when the worker leaves, so it holds for the run)
            stack.enter_context(dask.config.set({"distributed.deploy.lost-worker-timeout":
                                                 "3650d"}))
        try:
            if kind != "local":
                cluster.scale(n=n_workers)
            client = Client(cluster, security=security)
            malloc_checked(client)  # its workers have what cluster.reuse_memory says
            if kind == "local":
                client.register_plugin(IgnoreStopSignals(), name=IgnoreStopSignals.name)
            try:
                wait_for_workers(client, n_workers, wait_s, log)
                yield client
            finally:
                _quiet_shutdown(client)
                client.close()
        finally:
            try:
                cluster.close()
            finally:
                forget(cluster)


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
    """The dashboard URL, or None where there is none (bokeh missing, or a joined
    scheduler whose HTTP port serves no dashboard page). Callers ask only for clusters
    started with a dashboard (``cluster.dashboard``): distributed lists its HTTP port as
    ``services["dashboard"]`` whether or not the dashboard's pages are there.

    A cluster dask-ipar starts (local or batch system) serves its dashboard on
    127.0.0.1 of this machine, whatever address the scheduler has; dask's
    ``client.dashboard_link`` names the scheduler's address instead (for a batch cluster
    the node's network address, where nothing listens). For a joined cluster
    (``scheduler_address``) it is dask's link, the scheduler's host and its HTTP port, when
    a dashboard page answers there.
    """
    if not _has_bokeh():
        return None
    port = client.scheduler_info().get("services", {}).get("dashboard")
    if port is None:
        return None
    if getattr(client, "cluster", None) is not None:
        return f"http://127.0.0.1:{port}/status"
    # a scheduler started with --no-dashboard still serves /health on that port
    link = client.dashboard_link
    return link if serves(link) else None


def serves(url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``url`` answers with a page (the dashboard of a joined scheduler)."""
    import urllib.error
    import urllib.request

    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # not via http_proxy
    try:
        with direct.open(url, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
