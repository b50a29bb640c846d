"""Starting or joining a dask cluster, and always shutting down what we started."""

from __future__ import annotations

import contextlib
import warnings
import time

from dask_ipar.errors import IparError

__all__ = ["open_client", "wait_for_workers", "dashboard_link"]


def _has_bokeh() -> bool:
    try:
        import bokeh  # noqa: F401
    except ImportError:
        return False
    return True


def wait_for_workers(client, n: int, timeout_s: float, log=None) -> None:
    """Block until the cluster has ``n`` workers, reporting progress; IparError on timeout."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while True:
        have = len(client.scheduler_info(n_workers=-1)["workers"])
        if have >= n:
            return
        if log is not None and have != last:
            log(f"waiting for workers: {have}/{n} connected")
            last = have
        if time.monotonic() > deadline:
            raise IparError(
                f"the cluster has {have} workers after waiting {timeout_s:.0f} s, but the grid "
                f"needs {n}. Start more workers, choose a smaller grid, or raise --wait-timeout."
            )
        time.sleep(0.2)


@contextlib.contextmanager
def open_client(n_workers: int | None = None, scheduler_address: str | None = None, *,
                threads_per_worker: int = 1, dashboard: bool = True, device: str = "cpu",
                connect_timeout_s: float = 10.0, wait_timeout_s: float = 60.0, log=None):
    """Yield a ``distributed.Client`` on a new LocalCluster or an existing scheduler.

    A LocalCluster started here (worker processes, dashboard on 127.0.0.1) is
    closed on exit, whatever happens; a remote cluster is left running and
    only the client disconnects. With ``device="cuda"`` the local cluster is
    dask-cuda's LocalCUDACluster (one worker per GPU) when dask-cuda is
    installed and there are enough GPUs, else worker processes sharing the GPUs.
    """
    from distributed import Client, LocalCluster

    if scheduler_address:
        try:
            client = Client(scheduler_address, timeout=connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            raise IparError(
                f"could not reach a dask scheduler at {scheduler_address!r} within "
                f"{connect_timeout_s:.0f} s ({type(exc).__name__}). Check the address "
                "(for example tcp://host:8786) and that `dask scheduler` is running there."
            ) from exc
        try:
            if n_workers:
                wait_for_workers(client, n_workers, wait_timeout_s, log)
            yield client
        finally:
            client.close()
        return

    if n_workers is None or n_workers < 1:
        raise IparError(f"number of workers must be a positive integer, got {n_workers!r}.")
    # The dashboard binds to localhost only; a busy 8787 falls back to a free port
    # (the link printed says which). Without a dashboard, the scheduler's small HTTP
    # server (health, metrics) takes a random local port.
    dash = "127.0.0.1:8787" if dashboard and _has_bokeh() else "127.0.0.1:0"
    cluster_cls = LocalCluster
    if device == "cuda":
        cluster_cls = _cuda_cluster_class(n_workers) or LocalCluster
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Port .* is already in use")
        kwargs = dict(n_workers=n_workers, threads_per_worker=threads_per_worker,
                      host="127.0.0.1", dashboard_address=dash)
        if cluster_cls is LocalCluster:
            kwargs["processes"] = True
        cluster = cluster_cls(**kwargs)
    try:
        client = Client(cluster)
        try:
            yield client
        finally:
            client.close()
    finally:
        cluster.close()


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
