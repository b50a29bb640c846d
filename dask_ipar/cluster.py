"""Starting or joining a dask cluster, and always shutting down what we started."""

from __future__ import annotations

import time

from dask_ipar.errors import IparError

__all__ = ["open_client", "wait_for_workers", "dashboard_link", "scheduler_workers",
           "hold_replicas", "release_replicas"]

#: Models per scheduler address that hold dask's Active Memory Manager stopped.
_AMM_HOLDS: dict[str, int] = {}


def _has_bokeh() -> bool:
    try:
        import bokeh  # noqa: F401
    except ImportError:
        return False
    return True


def scheduler_workers(client) -> dict:
    """The scheduler's current workers, asked directly.

    (``client.scheduler_info()`` is a cache that the client's periodic refresh may
    replace with a summary listing no workers.)
    """
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def hold_replicas(client) -> bool:
    """Stop the scheduler's Active Memory Manager while a model trains on it.

    The engine's collectives fetch a block once per worker and then read the replica from
    several tasks of the step (the forward, the dX pieces, the update). The AMM's
    ReduceReplicas policy drops replicas that no *running* task needs, so a replica that a
    later task of the step still needs can go, and be fetched again: bytes the algorithm
    does not move. Returns True when this call stopped it (release with
    :func:`release_replicas`); the AMM restarts when the last model on the scheduler closes.
    """
    addr = client.scheduler.address
    if addr in _AMM_HOLDS:
        _AMM_HOLDS[addr] += 1
        return True
    try:
        running = client.amm.running()
    except Exception:  # scheduler without the AMM extension
        return False
    if not running:
        return False
    client.amm.stop()
    _AMM_HOLDS[addr] = 1
    return True


def release_replicas(client) -> None:
    """Undo one :func:`hold_replicas`; the last one on a scheduler restarts its AMM."""
    addr = client.scheduler.address
    if addr not in _AMM_HOLDS:
        return
    _AMM_HOLDS[addr] -= 1
    if _AMM_HOLDS[addr] <= 0:
        del _AMM_HOLDS[addr]
        try:
            if client.status == "running":
                client.amm.start()
        except Exception:  # the scheduler is gone: nothing to restart
            pass


def wait_for_workers(client, n: int, timeout_s: float, log=None) -> None:
    """Block until the cluster has ``n`` workers, reporting progress; IparError on timeout."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while True:
        have = len(scheduler_workers(client))
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


def open_client(n_workers: int | None = None, scheduler_address: str | None = None, *,
                threads_per_worker: int = 1, dashboard: bool = True, device: str = "cpu",
                connect_timeout_s: float = 10.0, wait_timeout_s: float = 60.0, log=None):
    """Yield a ``distributed.Client`` on a new LocalCluster or an existing scheduler.

    A shortcut to :func:`dask_ipar.clusters.make_cluster` with the default
    configuration: a LocalCluster started here (worker processes, dashboard on
    127.0.0.1) is closed on exit, whatever happens; a remote cluster is left
    running and only the client disconnects.
    """
    import copy

    from dask_ipar.clusters import make_cluster
    from dask_ipar.config import DEFAULTS

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
