"""Gang safety: one training run at a time on a grid worker.

A training step runs as one program per grid worker that waits for its peers' blocks
(:mod:`dask_ipar.runtime.programs`). Two runs sharing workers interleave their programs
on each worker's threads, and each run's programs wait behind the other's: steps slow
down by their sum and more, and with one thread per worker they wait until a program
secedes. So a run holds a ``distributed.MultiLock`` on its grid workers' names while it
trains (as xgboost.dask holds one on its workers); a second run on any of them waits for
the first, or stops at once with an error, as the dask config key ``dask-ipar.gang``
says: ``"error"`` (the default), ``"wait"`` or ``"off"``.

A run whose client died (SIGKILL, a lost laptop) cannot release its lock; the scheduler
would keep it forever. So the holder's client id and lock id are recorded in the
scheduler's metadata, and a run that finds a lock held by a client the scheduler no
longer knows releases it and goes on. (``Scheduler.clients`` and the ``multi_lock_release``
handler are dask internals: see the table in docs/concepts.md.)
"""

from __future__ import annotations

import time

from dask_ipar.errors import IparError

__all__ = ["GangLock", "gang_mode", "MODES"]

#: Values of ``dask-ipar.gang``.
MODES = ("error", "wait", "off")
_META = "dask-ipar-gang"


def gang_mode() -> str:
    """The dask config key ``dask-ipar.gang`` (``DASK_DASK_IPAR__GANG``), checked."""
    import dask

    mode = str(dask.config.get("dask-ipar.gang", "error")).lower()
    if mode not in MODES:
        raise IparError(f"the dask config key dask-ipar.gang is {mode!r}; expected one of "
                        f"{', '.join(MODES)}.")
    return mode


def _lock_name(worker: str) -> str:
    return f"dask-ipar-gang-{worker}"


def _clients(dask_scheduler=None):
    return list(dask_scheduler.clients)


class GangLock:
    """The lock of one training run on ``workers`` (``acquire``, ``release``, ``rebind``)."""

    def __init__(self, client, workers, what: str, mode: str | None = None, log=None,
                 poll_s: float = 1.0):
        self.client, self.what, self.log, self.poll_s = client, what, log, poll_s
        self.mode = gang_mode() if mode is None else mode
        self.workers: list = list(workers)
        self.lock = None

    # ------------------------------------------------------------------ holders
    def _holders(self) -> dict:
        """``{worker: {"client", "lock", "what"}}`` of the runs holding these workers."""
        out = {}
        for w in self.workers:
            try:
                out[w] = self.client.get_metadata([_META, w], None)
            except Exception:  # noqa: BLE001 - no record: nobody to name
                out[w] = None
        return {w: h for w, h in out.items() if isinstance(h, dict)}

    def _release_orphans(self, holders: dict) -> bool:
        """Release the locks of holders whose client is gone, and forget their records;
        whether a lock was released (then the acquisition is worth another try)."""
        alive = set(self.client.run_on_scheduler(_clients))
        stale = {w: h for w, h in holders.items() if h.get("client") not in alive}
        released = False
        for lock_id in {h["lock"] for h in stale.values()}:
            try:
                self.client.sync(self.client.scheduler.multi_lock_release, id=lock_id)
                released = True
            except Exception:  # noqa: BLE001 - released already (another run took over)
                pass
        for w in stale:
            try:
                self.client.set_metadata([_META, w], None)
            except Exception:  # noqa: BLE001 - the record goes with the scheduler
                pass
        return released

    def _busy_message(self, holders: dict) -> str:
        held = sorted(holders) or self.workers
        who = {h.get("what", "another run") for h in holders.values()} or {"another run"}
        return (f"grid worker(s) {', '.join(held)} are training {', '.join(sorted(who))} "
                "(another model or client): two runs on the same workers would interleave "
                "their worker programs and stall each other. Wait for it to end, train on "
                "other workers (a cluster of its own), or let this run wait for them "
                "(dask config dask-ipar.gang: wait; DASK_DASK_IPAR__GANG=wait).")

    # ------------------------------------------------------------------ lock
    def acquire(self) -> None:
        if self.mode == "off" or not self.workers:
            return
        from distributed import MultiLock

        lock = MultiLock(names=[_lock_name(w) for w in self.workers], client=self.client)
        said = False
        while not lock.acquire(blocking=False):
            holders = self._holders()
            if self._release_orphans(holders):
                continue
            if self.mode == "error":
                raise IparError(self._busy_message(holders))
            if not said and self.log is not None:
                self.log("waiting: " + self._busy_message(holders).split(": two runs")[0])
                said = True
            time.sleep(self.poll_s)
        self.lock = lock
        mine = {"client": self.client.id, "lock": lock.id, "what": self.what}
        for w in self.workers:
            self.client.set_metadata([_META, w], mine)

    def release(self) -> None:
        lock, self.lock = self.lock, None
        if lock is None:
            return
        try:
            lock.release()
        except Exception:  # noqa: BLE001 - the scheduler is gone: so is the lock
            return
        for w in self.workers:
            try:
                self.client.set_metadata([_META, w], None)
            except Exception:  # noqa: BLE001 - the next run finds a record of no live lock
                pass

    def rebind(self, workers) -> None:
        """Hold ``workers`` instead (the grid moved to replacement workers)."""
        workers = list(workers)
        if workers == self.workers or self.lock is None:
            self.workers = workers
            return
        self.release()
        self.workers = workers
        self.acquire()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
