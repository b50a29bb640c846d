"""The workers a model runs on: asking the scheduler for them, waiting for them, binding
grid cells to them, and holding the Active Memory Manager off while a model trains."""

from __future__ import annotations

import time

from dask_ipar.errors import IparError
from dask_ipar.runtime.batch import check_submissions, replace_dead_jobs, waiting_jobs_note
from dask_ipar.layout.grid import Grid, GridBinding, parse_grid

__all__ = ["scheduler_gone", "revive_lost_workers", "scheduler_workers", "wait_for_workers",
           "bind_grid", "hold_replicas", "release_replicas", "hung_after_s", "silent_for",
           "hung_workers", "release_hung_workers", "shared_cores", "HUNG_AFTER_S"]

#: Seconds without a heartbeat (workers send one a second) after which a grid worker
#: counts as hung: stopped (SIGSTOP, a suspended job), deadlocked or swapping.
HUNG_AFTER_S = 30.0

#: Models per scheduler address that hold dask's Active Memory Manager stopped.
_AMM_HOLDS: dict[str, int] = {}


def scheduler_workers(client) -> dict:
    """The scheduler's current workers, asked directly.

    (``client.scheduler_info()`` is a cache that the client's periodic refresh may
    replace with a summary listing no workers.)
    """
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def shared_cores(client, workers) -> int | None:
    """The cores ``workers`` share where they all run on this machine (a workstation's
    LocalCluster): the CPUs this process may use. Else None: each worker on cores of its
    own, as the step model takes them without ``cores`` (workers on another host are not
    asked: this must not wait on them)."""
    import socket

    info = scheduler_workers(client)
    hosts = {info.get(w, {}).get("host") for w in workers}
    if len(hosts) != 1 or None in hosts:
        return None
    local = {"127.0.0.1", "::1", "localhost"}
    try:
        local.add(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    if hosts.pop() not in local:
        return None
    from dask_ipar.runtime.worker_env import usable_cpus

    return usable_cpus()


def scheduler_gone(client, timeout_s: float = 3.0) -> bool:
    """Whether the client's scheduler is gone: the client closed itself (it gives up after
    ``distributed.comm.timeouts.connect`` of failed reconnects) or the scheduler does not
    answer within ``timeout_s``."""
    if client.status in ("closing", "closed"):
        return True
    scheduler = getattr(getattr(client, "cluster", None), "scheduler", None)
    status = getattr(scheduler, "status", None)
    if status is not None:  # the scheduler runs in this process: ask it, not the network
        return getattr(status, "name", str(status)) in ("closing", "closed", "failed")
    for _ in range(2):  # a busy scheduler may miss one deadline
        try:
            client.sync(client.scheduler.identity, callback_timeout=timeout_s)
            return False
        except Exception:
            pass
    return True


def hung_after_s() -> float:
    """Seconds without a heartbeat after which a grid worker counts as hung: the dask config
    key ``dask-ipar.hung-after`` (``"30s"`` by default; ``DASK_DASK_IPAR__HUNG_AFTER``)."""
    from dask_ipar.runtime.worker_env import config_seconds

    return config_seconds("dask-ipar.hung-after", HUNG_AFTER_S,
                          "a positive duration such as '30s' or 45")


def silent_for(info: dict) -> dict:
    """Seconds since each worker of ``info`` (the scheduler's ``identity()["workers"]``)
    last sent a heartbeat, measured against the worker heard from last (so the client's
    and the scheduler's clocks never meet, and a busy scheduler delays everyone alike).

    >>> silent_for({"a": {"last_seen": 100.0}, "b": {"last_seen": 64.5}})
    {'a': 0.0, 'b': 35.5}
    """
    seen = {w: v.get("last_seen") for w, v in info.items()
            if isinstance(v.get("last_seen"), (int, float))}
    newest = max(seen.values(), default=0.0)
    return {w: newest - t for w, t in seen.items()}


def hung_workers(info: dict, workers, after_s: float) -> list:
    """``[(worker, seconds silent)]`` of ``workers`` silent for more than ``after_s``."""
    ages = silent_for(info)
    return [(w, ages[w]) for w in workers if ages.get(w, 0.0) > after_s]


def release_hung_workers(client, workers, log=None, timeout_s: float = 10.0) -> list:
    """Take hung ``workers`` out of the cluster: each one's nanny kills its process at once
    and starts a new worker (``Client.restart_workers`` would first ask the hung worker
    to close and wait 4 s for it); a worker without a nanny, or whose nanny did not
    answer within ``timeout_s`` (stopped too: a suspended job), is removed from the
    scheduler. Returns those still listed after that."""
    workers = list(workers)
    if log is not None:
        log(f"worker(s) {', '.join(workers)} stopped answering: restarting them")

    def kill(dask_worker=None):  # on a nanny (pickled by value): SIGKILL its live worker;
        import os  # the nanny sees it exit, unregisters it and starts a new one
        import signal

        pid = getattr(dask_worker, "pid", None)  # None once the process has ended
        if pid:
            os.kill(pid, signal.SIGKILL)
        return pid

    deadline = time.monotonic() + timeout_s
    nannied: list = []
    for _ in range(2):  # again if one left between the look and the ask (a KeyError there)
        info = scheduler_workers(client)
        nannied = [w for w in workers if (info.get(w) or {}).get("nanny")]
        if not nannied:
            break
        try:  # bounded: a nanny stopped with its worker (a suspended job) never answers
            client.run(kill, workers=nannied, nanny=True, on_error="ignore",
                       callback_timeout=max(0.1, deadline - time.monotonic()))
            break
        except TimeoutError:
            break
        except Exception:  # noqa: BLE001 - removed from the scheduler below
            continue
    while nannied:  # each nanny takes its worker off the scheduler once the process is gone
        listed = scheduler_workers(client)
        if not any(w in listed for w in nannied) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    still = [w for w in workers if w in scheduler_workers(client)]
    if still:
        async def _remove(addresses, dask_scheduler=None):  # pickled by value
            for a in addresses:
                if a in dask_scheduler.workers:
                    await dask_scheduler.remove_worker(a, stimulus_id="dask-ipar-hung-worker",
                                                       close=True)

        try:
            client.run_on_scheduler(_remove, still)
        except Exception:  # noqa: BLE001 - the scheduler's worker-ttl removes it later
            pass
        still = [w for w in still if w in scheduler_workers(client)]
    return still


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


def revive_lost_workers(client, log=None) -> int:
    """Ask a local cluster this process started (``client.cluster``, a dask SpecCluster such
    as LocalCluster; batch clusters: :func:`dask_ipar.runtime.batch.replace_dead_jobs`) to
    start again the workers it gave up: when a
    killed worker does not come back within ``distributed.deploy.lost-worker-timeout``
    (its nanny's restart can fail: dask/distributed#7312), the cluster closes its nanny
    but keeps its spec; ``scale`` to the spec's size starts it anew (a batch cluster
    submits a new job). Returns how many were missing."""
    cluster = getattr(client, "cluster", None)
    spec, running = getattr(cluster, "worker_spec", None), getattr(cluster, "workers", None)
    if not isinstance(spec, dict) or not isinstance(running, dict):
        return 0
    missing = [name for name in spec if name not in running]
    if missing:
        if log is not None:
            log(f"starting lost worker(s) {', '.join(map(str, missing))} again")
        cluster.scale(len(spec))  # a local cluster: one worker per spec entry
    return len(missing)


def wait_for_workers(client, n: int, timeout_s: float, log=None, revive: bool = False) -> None:
    """Block until the cluster has ``n`` workers, reporting progress; IparError on timeout.

    With ``revive`` (after a worker fault) a cluster of this process is asked to start the
    workers it gave up (:func:`revive_lost_workers`). On a batch-system cluster of this
    process a rejected job submission ends the wait at once (IparError with the batch
    system's message) and a worker job that ended is submitted again
    (:func:`dask_ipar.runtime.batch.replace_dead_jobs`)."""
    cluster = getattr(client, "cluster", None)
    batch = getattr(cluster, "job_cls", None) is not None
    deadline = time.monotonic() + timeout_s
    last = -1
    while True:
        info = scheduler_workers(client)
        have = len(info)
        if batch:
            check_submissions(cluster)
            replace_dead_jobs(cluster, {str(w.get("name")) for w in info.values()}, log=log)
        if have >= n:
            return
        if revive and not batch:
            revive_lost_workers(client, log)
        if log is not None and have != last:
            log(f"waiting for workers: {have}/{n} connected")
            last = have
        if time.monotonic() > deadline:
            if batch:
                names = {str(w.get("name")) for w in info.values()}
                raise IparError(
                    f"the cluster has {have} workers after waiting {timeout_s:.0f} s, but the "
                    f"grid needs {n}{waiting_jobs_note(cluster, names)}. Raise --wait-timeout "
                    "(cluster.wait_timeout) for a busy queue, or ask for less per job "
                    "(cluster.cores, cluster.memory) or a smaller grid.")
            raise IparError(
                f"the cluster has {have} workers after waiting {timeout_s:.0f} s, but the grid "
                f"needs {n}. Start more workers, choose a smaller grid, or raise --wait-timeout."
            )
        time.sleep(0.2)



def _worker_order(info: dict) -> list[str]:
    """Workers sorted by name (numeric names numerically), then address."""

    def key(item):
        addr, w = item
        name = w.get("name", addr)
        return (0, int(name), addr) if str(name).isdigit() else (1, str(name), addr)

    return [addr for addr, _ in sorted(info.items(), key=key)]


def bind_grid(grid: Grid, client, workers: list[str] | None = None) -> GridBinding:
    """Bind ``grid`` to the first ``grid.size`` workers of ``client`` (by worker name).

    Raises
    ------
    IparError
        If the cluster has fewer workers than grid cells.

    The first binding on a cluster dask-ipar did not start checks the workers' malloc
    settings and logs advice where they slow every step
    (:func:`dask_ipar.runtime.worker_env.check_malloc`); the first on any cluster has
    workers that keep freed memory hand it back when they idle
    (:mod:`dask_ipar.runtime.release`).
    """
    grid = parse_grid(grid)
    if workers is None:
        workers = _worker_order(scheduler_workers(client))
    if len(workers) < grid.size:
        raise IparError(
            f"grid {grid} needs {grid.size} workers but the cluster has {len(workers)}. "
            f"Start the cluster with at least {grid.size} workers (--workers {grid.size}) "
            f"or choose a smaller grid whose Pr*Pc <= {len(workers)}."
        )
    from dask_ipar.runtime.release import install_release
    from dask_ipar.runtime.worker_env import check_malloc

    check_malloc(client, workers[: grid.size])  # once per cluster: advice, never an error
    install_release(client)  # kept memory goes back when a worker idles
    return GridBinding(grid, tuple(workers[: grid.size]))
