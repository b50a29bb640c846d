"""Worker faults during checkpointed work: :class:`WorkerLost`, raised when a grid worker
left the cluster, and waiting for futures while watching that every grid worker is
still connected.

Part of :mod:`dask_ipar.io.checkpoint` (which re-exports :class:`WorkerLost`).
"""

from __future__ import annotations

import contextlib
import time

from dask_ipar.io.checkpoint_format import CheckpointCorrupt, CheckpointStorageError
from dask_ipar.runtime.workers import (hung_after_s, hung_workers, release_hung_workers,
                                       scheduler_workers)
from dask_ipar.errors import IparError

__all__ = ["WorkerLost"]


class WorkerLost(RuntimeError):
    """A worker holding model blocks left the cluster; the blocks it held are gone.

    Attributes
    ----------
    workers : list of str
        Addresses of the grid workers that are gone.
    what : str
        What was running (``training step 53``, ``recovery``).
    """

    def __init__(self, workers, what):
        self.workers, self.what = list(workers), what
        super().__init__(
            f"worker(s) {', '.join(self.workers)} left the cluster during {what}; the model "
            "blocks they held are lost. Resume from the last checkpoint: "
            "checkpoint.recover(model, directory) (or dask-ipar train --resume)."
        )


def _alive(client) -> set:
    """Addresses of the workers connected now (asked from the scheduler directly)."""
    return set(scheduler_workers(client))


def _gone_soon(client, workers, grace_s=20.0):
    """Grid workers missing from the scheduler, allowing it ``grace_s`` to notice a death."""
    deadline = time.monotonic() + grace_s
    while True:
        gone = [w for w in workers if w not in _alive(client)]
        if gone or time.monotonic() > deadline:
            return gone
        time.sleep(0.1)


def _wait_alive(client, futures, workers, what, timeout_s=None, poll_s=0.5):
    """Wait for ``futures`` while checking that every grid worker is still there.

    Raises :class:`WorkerLost` when one left (its pinned tasks would wait forever) or
    stopped answering (no heartbeat for ``dask-ipar.hung-after``: it is restarted first),
    IparError on timeout, and re-raises a task's own error.
    """
    from distributed import wait

    futures = list(futures)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            with client.as_current():  # not a client the caller made current
                wait(futures, timeout=poll_s)
            break
        except TimeoutError:
            pass
        except Exception:  # cancelled: lost dependencies, forgotten keys
            gone = _gone_soon(client, workers)
            if gone:
                raise WorkerLost(gone, what) from None
            raise
        info = scheduler_workers(client)
        gone = [w for w in workers if w not in info]
        if gone:
            raise WorkerLost(gone, what)
        hung = hung_workers(info, workers, hung_after_s())
        if hung:  # a stopped worker would hold the save forever: restart it, recover
            release_hung_workers(client, [w for w, _ in hung])
            raise WorkerLost([w for w, _ in hung], f"{what} (it stopped answering for "
                             f"{max(s for _, s in hung):.0f} s and was restarted)")
        if deadline is not None and time.monotonic() > deadline:
            raise IparError(f"{what} did not finish within {timeout_s:.0f} s.")
    bad = [f for f in futures if f.status != "finished"]
    errored = [f for f in bad if f.status == "error"]
    if errored and not [w for w in workers if w not in _alive(client)]:
        errored[0].result()  # the task's own error (e.g. a damaged chunk), raised at once
    if bad:
        gone = _gone_soon(client, workers)
        if gone:
            raise WorkerLost(gone, what)
        bad[0].result()  # raises the task's error
        raise WorkerLost([], what)  # pragma: no cover - cancelled without a visible cause
    return futures


@contextlib.contextmanager
def _faults_as_worker_lost(model, what):
    """Turn any cluster error raised while a grid worker is gone into :class:`WorkerLost`.

    A dead worker shows up in many ways (cancelled futures, lost dependencies, closed
    comms), depending on the moment it died; the test is whether a grid worker left.
    """
    workers = model.binding.workers
    try:
        yield
    except (WorkerLost, KeyboardInterrupt, CheckpointStorageError, CheckpointCorrupt):
        raise  # storage and data faults end the run at once: no worker to wait for
    except Exception as exc:  # IparError too: a lineage cut that found a grid worker gone
        gone = _gone_soon(model.client, workers)
        if gone:
            raise WorkerLost(gone, what) from exc
        raise


def _cluster_error(exc) -> bool:
    """Whether ``exc`` is of the kinds a lost worker causes (closed comms, cancelled or
    lost futures, dask's own errors), as opposed to the run's own (a callback's, a bad
    setting, an IparError), which end the run at once."""
    import asyncio
    import concurrent.futures

    kinds = (OSError, TimeoutError, asyncio.CancelledError, concurrent.futures.CancelledError)
    return isinstance(exc, kinds) or type(exc).__module__.split(".")[0] == "distributed"


def as_worker_fault(model, exc, what: str):
    """The :class:`WorkerLost` behind a training run's error ``exc``, or None when no grid
    worker is gone (the run's own error). A hung worker (:class:`WorkerHung`) was restarted
    or removed already, so it counts as lost; for other errors the scheduler is asked,
    allowing it longer to notice a death after the errors a lost worker causes."""
    from dask_ipar.errors import WorkerHung

    if isinstance(exc, WorkerHung):
        return WorkerLost(exc.workers, f"{what} (it stopped answering for "
                          f"{exc.silent_s:.0f} s and was restarted)")
    if isinstance(exc, WorkerLost):
        return exc
    workers = model.binding.workers
    alive = set(scheduler_workers(model.client))
    gone = [w for w in workers if w not in alive] or _gone_soon(
        model.client, workers, 20.0 if _cluster_error(exc) else 2.0)
    return WorkerLost(gone, what) if gone else None
