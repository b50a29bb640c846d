"""Client side of the dashboard: install its plugins, and publish a run's progress.

:func:`install_dashboard` registers :class:`~dask_ipar.dashboard.page.IparDashboard` on
the scheduler and :class:`~dask_ipar.dashboard.recorder.TimelineRecorder` on the workers
(once per client); :class:`DashboardFeed`, a training-loop callback, publishes the run
and its steps with ``Client.log_event`` (at most one message a second while training,
plus two per epoch). Both are off when the dask config key
``dask-ipar.dashboard`` is False (``DASK_DASK_IPAR__DASHBOARD=False``).
"""

from __future__ import annotations

import logging
import time
import uuid
import weakref

import dask

from dask_ipar.runtime.loop import Callback

__all__ = ["install_dashboard", "dashboard_enabled", "page_url", "DashboardFeed",
           "publish_test"]

logger = logging.getLogger("dask_ipar")

_installed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def dashboard_enabled() -> bool:
    return bool(dask.config.get("dask-ipar.dashboard", True))


def install_dashboard(client) -> bool:
    """Register the dashboard's scheduler and worker plugins on ``client``'s cluster (once
    per client). Returns whether the page can be served; a scheduler that cannot import
    dask-ipar only loses the page (a warning says so)."""
    if not dashboard_enabled():
        return False
    done = _installed.get(client)
    if done is not None:
        return done
    from dask_ipar.dashboard.page import PLUGIN_NAME, IparDashboard
    from dask_ipar.dashboard.recorder import install_recorder

    ok = True
    try:
        install_recorder(client)
        client.register_plugin(IparDashboard(), name=PLUGIN_NAME)
    except Exception as exc:  # noqa: BLE001 - training goes on without the page
        ok = False
        logger.warning("dask-ipar: no /ipar dashboard page on this scheduler (%s: %s); "
                       "the scheduler needs dask-ipar installed in its Python environment.",
                       type(exc).__name__, exc)
    _installed[client] = ok
    return ok


def page_url(client) -> str | None:
    """Where the ``/ipar`` page is served, from this machine's point of view, or None: the
    scheduler's web server (on 127.0.0.1 for clusters dask-ipar starts, as the dashboard)
    answering at ``/ipar``."""
    from dask_ipar.dashboard.page import ROUTE

    if not _installed.get(client):
        return None
    port = client.scheduler_info().get("services", {}).get("dashboard")
    if port is None:
        return None
    if getattr(client, "cluster", None) is not None:
        base = f"http://127.0.0.1:{port}"
    else:
        from urllib.parse import urlsplit

        host = urlsplit(client.scheduler.address.replace("tls://", "https://")
                        .replace("tcp://", "http://")).hostname
        base = f"http://{host}:{port}"
    url = base + ROUTE
    from dask_ipar.runtime.cluster import serves

    return url if serves(url) else None


def _cells(model) -> list:
    return [[i, j, model.binding.worker(i, j)] for i, j in model.binding.grid.cells()]


class DashboardFeed(Callback):
    """Publishes a run to the scheduler's ``/ipar`` page: the run when it begins, its
    steps (batched, at most one message a second), each epoch with the comm table (at an
    epoch's end every step has finished and the meter has drained the workers' logs, so
    the measured bytes are those of whole steps), and the end."""

    def __init__(self, meter=None, machine=None, interval_s: float = 1.0):
        self.meter = meter
        self.machine = machine
        self.interval_s = interval_s
        self._steps: list = []
        self._last = 0.0
        self.uid = None

    def _send(self, client, msg):
        from dask_ipar.dashboard.page import TOPIC

        try:
            client.log_event(TOPIC, msg)
        except Exception as exc:  # noqa: BLE001 - the page is a view; training goes on
            logger.warning("dask-ipar: dashboard event not sent: %s", exc)

    def on_train_begin(self, loop):
        model = loop.model
        grid = model.binding.grid
        self.uid = f"{model.uid}.{uuid.uuid4().hex[:6]}"
        loop.history.dashboard_uid = self.uid
        self._offset = time.time() - time.perf_counter()
        pred, note = None, "n/a"
        if self.machine is not None and getattr(self.machine, "flops_per_s", None):
            try:
                pred = float(model.predict_step_s(
                    loop.plan.batch, self.machine,
                    steps_per_program=loop.steps_per_program).seconds)
            except Exception as exc:  # noqa: BLE001 - the page is a view; training goes on
                note = f"n/a ({exc})"
        else:
            note = "n/a (needs a calibrated machine: dask-ipar calibrate, --machine)"
        self._send(model.client, {
            "kind": "run", "uid": self.uid, "model_uid": model.uid, "model": repr(model),
            "grid": str(grid), "pr": grid.pr, "pc": grid.pc, "executor": model.executor,
            "cells": _cells(model),
            "layers": [lay.name for lay in model.engine.layouts],
            "batch": int(loop.plan.batch), "total_steps": int(loop.total_steps),
            "predicted_step_s": pred, "predicted_note": note, "started": time.time()})

    def on_rewind(self, loop, step):
        if self.uid is not None and loop.model.binding is not None:  # the grid's new workers
            self._steps = [s for s in self._steps if s[0] <= step]
            self._send(loop.model.client, {"kind": "rewind", "uid": self.uid, "step": int(step),
                                           "cells": _cells(loop.model)})

    def on_step_end(self, loop, stats):
        self._steps.append([int(stats.step), float(stats.loss), float(stats.accuracy),
                            float(stats.done_s + self._offset), int(stats.batch)])
        if stats.done_s - self._last >= self.interval_s:
            self._flush(loop)

    def _flush(self, loop):
        if self._steps:
            self._send(loop.model.client, {"kind": "steps", "uid": self.uid,
                                           "steps": self._steps})
            self._steps = []
        self._last = time.perf_counter()

    def _send_comm(self, loop):
        rep = self.meter.report()
        self._send(loop.model.client, {"kind": "comm", "uid": self.uid, "rows": [
            [r.layer, r.phase, float(r.predicted_bytes), float(r.measured_bytes),
             float(r.predicted_s), float(r.measured_s)] for r in rep.rows]})

    def on_epoch_end(self, loop, record):
        self._flush(loop)
        if self.meter is not None:
            self._send_comm(loop)
        self._send(loop.model.client, {"kind": "epoch", "uid": self.uid, "record": {
            k: (v if isinstance(v, str) else int(v) if isinstance(v, int) else float(v))
            for k, v in record.items() if isinstance(v, (int, float, str))}})

    def _end(self, loop, reason):
        if self.uid is None:
            return
        self._flush(loop)
        self._send(loop.model.client, {"kind": "end", "uid": self.uid, "reason": reason})

    def on_train_end(self, loop):
        self._end(loop, "finished")

    def on_interrupt(self, loop, step):
        self._end(loop, f"stopped at step {step}")

    def on_train_abort(self, loop, exc):
        self._end(loop, f"stopped: {type(exc).__name__}")


def publish_test(client, history, figures: dict) -> None:
    """Add a finished run's test figures (``test_loss``, ``test_accuracy``) to its page
    (the run of ``history``, as :class:`DashboardFeed` published it)."""
    from dask_ipar.dashboard.page import TOPIC

    uid = getattr(history, "dashboard_uid", None)
    if uid is None:
        return
    try:
        client.log_event(TOPIC, {"kind": "test", "uid": uid, "figures": {
            k: float(v) for k, v in figures.items() if isinstance(v, (int, float))}})
    except Exception as exc:  # noqa: BLE001
        logger.debug("dask-ipar dashboard event not sent: %s", exc)
