"""Preempted grid workers: a worker about to be stopped lets the run save its step first.

A batch system ends a job with SIGTERM to every process of it, and SIGKILL a grace period
later (SLURM's ``KillWait``, 30 s by default): at the end of its walltime, at ``scancel``,
when a preemptible partition hands the node to another job. Without help the worker
process dies at once and the run loses the steps since its last checkpoint or replica.
With it:

1. :class:`PreemptNotice` (a worker plugin) catches the worker process's SIGTERM and
   :class:`PreemptGrace` (a nanny plugin) holds its nanny's close: each tells the
   scheduler (event topic ``dask-ipar-preempt``) when a training run listens on that
   worker, then waits until the run says its state is saved, for at most the run's grace
   (the dask config key ``dask-ipar.preempt-grace``, 20 s by default, below SLURM's 30 s).
2. The run (:class:`PreemptWatch`, held by :class:`~dask_ipar.runtime.loop.TrainLoop`)
   finishes the step in flight and gives its callbacks :meth:`~dask_ipar.runtime.loop.
   Callback.on_preempt`: the checkpointing one writes a checkpoint of that step, the
   replicas refresh there. Then it answers, and the worker goes.
3. What follows is the dask config key ``dask-ipar.preempt``: ``"recover"`` (the default)
   treats the worker as lost, and recovery starts from the step just saved (on a
   replacement worker or job, or a smaller grid): no step runs twice. ``"stop"`` ends the
   run there as a SIGTERM to the training process does (``dask-ipar train`` exits 143).

A worker no run listens on (the metadata record below is absent) reacts to SIGTERM as
before, at once. The workers of a local cluster the CLI starts ignore SIGTERM
(:class:`~dask_ipar.runtime.cluster.IgnoreStopSignals`): the command stops them itself.
A run's record per worker is the scheduler metadata ``["dask-ipar-preempt", address]``
(``{"run", "grace", "saved"}``), removed when the run ends; a run killed with SIGKILL
leaves it, which costs a later SIGTERM at most the grace.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

from distributed.diagnostics.plugin import NannyPlugin, WorkerPlugin

from dask_ipar.errors import IparError

__all__ = ["PreemptNotice", "PreemptGrace", "PreemptWatch", "preempt_grace_s",
           "preempt_mode", "MODES", "TOPIC", "GRACE_S"]

#: Values of ``dask-ipar.preempt``.
MODES = ("recover", "stop")
#: Event topic of preemption notices.
TOPIC = "dask-ipar-preempt"
#: Default seconds a preempted worker waits for the run's save (SLURM's KillWait is 30 s).
GRACE_S = 20.0
_META = "dask-ipar-preempt"
_RPC_TIMEOUT_S = 3.0


def preempt_mode() -> str:
    """The dask config key ``dask-ipar.preempt`` (``DASK_DASK_IPAR__PREEMPT``), checked."""
    import dask

    mode = str(dask.config.get("dask-ipar.preempt", "recover")).lower()
    if mode not in MODES:
        raise IparError(f"the dask config key dask-ipar.preempt is {mode!r}; expected one of "
                        f"{', '.join(MODES)} (DASK_DASK_IPAR__PREEMPT=stop ends the run "
                        "after the save).")
    return mode


def preempt_grace_s() -> float:
    """The dask config key ``dask-ipar.preempt-grace`` (``"20s"`` by default), checked."""
    from dask_ipar.runtime.worker_env import config_seconds

    return config_seconds("dask-ipar.preempt-grace", GRACE_S,
                          "a positive duration below the batch system's kill wait, such as "
                          "'20s'")


async def _record(scheduler, address: str):
    try:
        rec = await asyncio.wait_for(
            scheduler.get_metadata(keys=[_META, address], default=None), _RPC_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - no scheduler to ask: nobody listens
        return None
    return rec if isinstance(rec, dict) else None


async def notify_and_wait(scheduler, address: str, why: str) -> str:
    """Tell the run listening on worker ``address`` (if any) that it is leaving, and wait
    for the run's save, at most the run's grace. ``scheduler`` is a worker's or nanny's
    rpc to its scheduler. Returns ``"none"`` (no run listens), ``"saved"`` or
    ``"timeout"``."""
    rec = await _record(scheduler, address)
    if rec is None or rec.get("saved") is not None:
        return "none"
    try:
        await asyncio.wait_for(scheduler.log_event(
            topic=TOPIC, msg={"worker": address, "why": why, "run": rec.get("run")}),
            _RPC_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - the scheduler is going: nobody to wait for
        return "none"
    deadline = time.monotonic() + float(rec.get("grace", GRACE_S))
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        now = await _record(scheduler, address)
        if now is None or now.get("run") != rec.get("run") or now.get("saved") is not None:
            return "saved"
    return "timeout"


class PreemptNotice(WorkerPlugin):
    """Worker plugin: the worker process's SIGTERM waits for the listening run's save
    (:func:`notify_and_wait`), then goes on to the handler it replaced (dying, by default).
    Not where the process ignores SIGTERM already (a cluster the CLI started)."""

    name = "dask-ipar-preempt-notice"
    idempotent = True

    def setup(self, worker):
        if threading.current_thread() is not threading.main_thread():
            return  # a thread-based worker: only the main thread may set signal handlers
        previous = signal.getsignal(signal.SIGTERM)
        if previous in (signal.SIG_IGN, None) or getattr(previous, "_dask_ipar", False):
            return
        loop = asyncio.get_running_loop()
        busy = []

        async def leave():
            from distributed.core import Status

            try:
                if worker.status in (Status.running, Status.paused):  # not closing already
                    await notify_and_wait(worker.scheduler, worker.address, "SIGTERM")
            finally:
                signal.signal(signal.SIGTERM, previous)
                os.kill(os.getpid(), signal.SIGTERM)

        def on_term(signum, frame):
            if not busy:
                busy.append(signum)
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(leave()))

        on_term._dask_ipar = True
        signal.signal(signal.SIGTERM, on_term)


class PreemptGrace(NannyPlugin):
    """Nanny plugin: a nanny that closes (its ``dask worker`` process got SIGTERM, or the
    cluster retires it) first waits for the listening run's save (:func:`notify_and_wait`)
    before it stops its worker."""

    name = "dask-ipar-preempt-grace"
    idempotent = True
    restart = False

    async def teardown(self, nanny):
        from distributed.core import Status

        if nanny.status not in (Status.closing, Status.closing_gracefully):
            return  # the plugin is being replaced or removed, not the worker
        address = getattr(nanny, "worker_address", None)
        if address:
            await notify_and_wait(nanny.scheduler, address, "its nanny is closing")


#: client id -> the runs listening through it (a client has one handler per topic)
_WATCHES: dict = {}
_WATCHES_LOCK = threading.Lock()


def _dispatch(client_id, event) -> None:
    with _WATCHES_LOCK:
        watches = list(_WATCHES.get(client_id, ()))
    for w in watches:
        w._on_event(event)


class PreemptWatch:
    """A training run's side: listens for notices on its grid workers and answers them.

    ``pending()`` names the workers that announced their leave since the last ``ack``;
    ``ack(workers, step)`` tells them the state of ``step`` is saved.
    """

    def __init__(self, client, workers, run: str, *, grace_s: float | None = None):
        self.client, self.run = client, run
        self.workers: list = list(workers)
        self.grace_s = preempt_grace_s() if grace_s is None else grace_s
        self.mode = preempt_mode()
        self._notices: dict = {}  # worker -> why
        self._lock = threading.Lock()
        self._started = False

    def start(self) -> None:
        from distributed import LocalCluster

        client = self.client
        client.register_plugin(PreemptNotice(), name=PreemptNotice.name)
        # a LocalCluster's nannies live in this process: its signals are the CLI's
        if not isinstance(getattr(client, "cluster", None), LocalCluster):
            client.register_plugin(PreemptGrace(), name=PreemptGrace.name)
        with _WATCHES_LOCK:  # one handler per client, for every run it trains
            watches = _WATCHES.setdefault(client.id, [])
            if not watches:
                client.subscribe_topic(TOPIC, lambda event, cid=client.id: _dispatch(cid, event))
            watches.append(self)
        self._started = True
        self._listen(self.workers)

    def _listen(self, workers) -> None:
        for w in workers:
            self.client.set_metadata([_META, w], {"run": self.run, "grace": self.grace_s,
                                                  "saved": None})

    def _on_event(self, event) -> None:
        _, msg = event
        if isinstance(msg, dict) and msg.get("run") == self.run:
            with self._lock:
                self._notices.setdefault(msg.get("worker"), msg.get("why", "SIGTERM"))

    def pending(self) -> dict:
        """``{worker: why}`` of grid workers that announced they are leaving."""
        if not self._notices:
            return {}
        with self._lock:
            return {w: why for w, why in self._notices.items() if w in self.workers}

    def ack(self, workers, step: int) -> None:
        """The state of ``step`` is saved (or nothing can save it): ``workers`` may go."""
        with self._lock:
            for w in workers:
                self._notices.pop(w, None)
        for w in workers:
            try:
                self.client.set_metadata([_META, w], {"run": self.run, "grace": self.grace_s,
                                                      "saved": int(step)})
            except Exception:  # noqa: BLE001 - the scheduler is gone: so is the worker
                pass

    def rebind(self, workers) -> None:
        """Listen on ``workers`` instead (the grid moved to replacement workers)."""
        workers = list(workers)
        old = [w for w in self.workers if w not in workers]
        self.workers = workers
        with self._lock:  # notices of workers the run no longer uses
            for w in old:
                self._notices.pop(w, None)
        if self._started:
            self._forget(old)
            self._listen(workers)

    def _forget(self, workers) -> None:
        for w in workers:
            try:
                self.client.set_metadata([_META, w], None)
            except Exception:  # noqa: BLE001 - the record goes with the scheduler
                pass

    def close(self) -> None:
        if not self._started:
            return
        self._started = False
        with _WATCHES_LOCK:
            watches = _WATCHES.get(self.client.id, [])
            if self in watches:
                watches.remove(self)
            if not watches:
                _WATCHES.pop(self.client.id, None)
                try:
                    self.client.unsubscribe_topic(TOPIC)
                except Exception:  # noqa: BLE001 - the client is closing
                    pass
        self._forget(self.workers)
