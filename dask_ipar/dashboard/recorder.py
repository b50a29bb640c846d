"""Worker side of the dashboard: what each worker did in the last steps, and what it does now.

:class:`TimelineRecorder` (a worker plugin, one per worker, shared by every model) keeps
the last :data:`RECORDS` intervals of dask-ipar tasks as records
``(key_name, kind, start, stop, peer)`` (:mod:`dask_ipar.dashboard.timeline`):

* worker programs (:func:`dask_ipar.runtime.programs.run_program`) add their kernels,
  their waits for blocks and their sends themselves, and say what they are doing now
  (:meth:`TimelineRecorder.now`); when a program ends its kernels and waits go to the
  scheduler for dask's task stream (:meth:`TimelineRecorder.program_done`);
* tasks of the task-graph executor are read from dask's own records when they finish
  (the worker's ``startstops`` of a computed task, its incoming transfer log of a
  fetched block), in the plugin's ``transition`` hook.

Recording costs a tuple per kernel; apart from a program's one message at its end,
nothing leaves the worker until someone asks:
the dashboard page (over the ``ipar_timeline`` handler, from the scheduler) or the run
card (:func:`collect_records`, from the client).
"""

from __future__ import annotations

import time
from collections import deque

import msgpack
from distributed.diagnostics.plugin import WorkerPlugin

from dask_ipar.dashboard.stream import STREAM_TOPIC, stream_groups

__all__ = ["TimelineRecorder", "RECORDER_NAME", "RECORDS", "recorder", "collect_records",
           "install_recorder"]

#: Name of the worker plugin.
RECORDER_NAME = "dask-ipar-timeline"
#: Records a worker keeps (the oldest go first): several steps of a large grid.
RECORDS = 6000


def _name(key):
    name = key[0] if isinstance(key, tuple) else key
    return name if isinstance(name, str) and "." in name and "-s" in name else None


class TimelineRecorder(WorkerPlugin):
    """Worker plugin: the recent intervals of dask-ipar tasks and the current activity."""

    name = RECORDER_NAME
    idempotent = True

    def setup(self, worker):
        self.worker = worker
        self.records: deque = deque(maxlen=RECORDS)
        self.state = ("idle", "", None, time.time())  # (state, what, peer, since)
        worker.handlers["ipar_timeline"] = self.report

    def teardown(self, worker):
        worker.handlers.pop("ipar_timeline", None)

    # programs (a worker thread): append is atomic on a deque
    def add(self, name, kind, t0, t1, peer=None):
        self.records.append((name, kind, t0, t1, peer))

    def program_done(self, key, trace, rename=None) -> None:
        """Send what program ``key`` did (its kernels and waits, ``[name, kind, start,
        stop]``; ``rename``: of the names' groups, see
        :func:`~dask_ipar.dashboard.stream.stream_groups`) to the scheduler, which shows it
        in dask's task stream in place of the program's one bar
        (:mod:`dask_ipar.dashboard.stream`)."""
        groups = stream_groups(trace, rename)
        if groups:  # packed: dask checks an event's every item (~1 us each) before it goes
            self.worker.log_event(STREAM_TOPIC, {
                "program": list(key), "groups": msgpack.packb(groups),
                "delay": float(getattr(self.worker, "scheduler_delay", 0.0))})

    def now(self, state, what="", peer=None):
        """Say what this worker's program does now: ``computing``, ``waiting``, ``idle``."""
        self.state = (state, what, peer, time.time())

    # task-graph executor (the event loop)
    def transition(self, key, start, finish, **kwargs):
        if finish != "memory" or start not in ("executing", "flight"):
            return
        name = _name(key)
        if name is None or name.startswith("step."):  # programs record their own kernels
            return
        ts = self.worker.state.tasks.get(key)
        if start == "executing":
            func = getattr(getattr(ts, "run_spec", None), "func", None)
            if getattr(func, "__name__", "") == "pick":
                return  # an output taken from a program's result: not a kernel
            for ss in reversed(ts.startstops if ts is not None else ()):
                if ss.get("action") == "compute":
                    self.records.append((name, "compute", ss["start"], ss["stop"], None))
                    break
            return
        # a fetched block: its entry in dask's incoming transfer log (the newest ones)
        log = self.worker.transfer_incoming_log
        for k in range(1, min(len(log), 8) + 1):
            e = log[-k]
            if key in e.get("keys", ()):
                self.records.append((name, "recv", e["start"], e["stop"], e["who"]))
                break

    def report(self, since: float = 0.0, uid: str | None = None):
        """``{"records": [...], "state": ..., "executing": n}`` (the ``ipar_timeline``
        handler): records that ended after ``since`` (of model ``uid`` if given)."""
        recs = [r for r in list(self.records) if r[3] > since
                and (uid is None or f"-{uid}-" in r[0])]
        executing = sum(1 for ts in self.worker.state.tasks.values()
                        if ts.state == "executing")
        return {"records": recs, "state": list(self.state), "executing": executing,
                "time": time.time()}


def recorder(worker):
    """The worker's :class:`TimelineRecorder`, or None when it has none."""
    return worker.plugins.get(RECORDER_NAME)


def install_recorder(client) -> None:
    """Add :class:`TimelineRecorder` to every worker of ``client`` (and to later ones)."""
    client.register_plugin(TimelineRecorder(), name=RECORDER_NAME)


def _records_here(uid=None, dask_worker=None):
    rec = dask_worker.plugins.get(RECORDER_NAME)
    return [] if rec is None else rec.report(uid=uid)["records"]


def collect_records(client, workers, uid: str | None = None) -> dict:
    """``{worker: [record, ...]}`` of ``workers`` (what the run card draws)."""
    try:
        return client.run(_records_here, uid, workers=list(workers), on_error="ignore")
    except Exception:  # noqa: BLE001 - a gone cluster leaves the card without a timeline
        return {}
