"""Scheduler side of the dashboard: the ``/ipar`` page of the scheduler's web server.

:class:`IparDashboard` is a scheduler plugin that dask-ipar registers on the scheduler a
model uses (local, external or batch-system; :func:`dask_ipar.dashboard.install_dashboard`).
It

* keeps what training clients publish under the event topic :data:`TOPIC` (through
  ``Client.log_event``): the run (model, grid, cells, executor, predicted step time), the
  finished steps (loss, accuracy, time), the epochs, the comm table;
* adds three routes to the scheduler's HTTP server (tornado; the server that also serves
  dask's dashboard, or only ``/health`` where that is off): ``/ipar`` (the page),
  ``/ipar/fragment`` (its live part, which the page fetches every two seconds) and
  ``/ipar/data.json``;
* puts the kernels and waits of each worker program (sent under :data:`STREAM_TOPIC` when
  it ends) into dask's own task stream in place of the program's one bar
  (:mod:`dask_ipar.dashboard.stream`);
* asks the grid's workers, when the page is fetched, what they did since the last fetch
  and what they do now (the ``ipar_timeline`` handler of
  :class:`~dask_ipar.dashboard.recorder.TimelineRecorder`), and reads their memory from
  the scheduler.

Nothing is fetched from the workers while nobody looks at the page.
"""

from __future__ import annotations

import html
import json
from collections import deque

import msgpack

from distributed.diagnostics.plugin import SchedulerPlugin

from dask_ipar.dashboard.render import (CSS, curves_html, grid_html, phase_table_html,
                                        step_time_s, timeline_html)
from dask_ipar.dashboard.stream import STREAM_TOPIC, splice
from dask_ipar.dashboard.timeline import step_timelines

__all__ = ["IparDashboard", "PLUGIN_NAME", "TOPIC", "ROUTE"]

#: Name of the scheduler plugin.
PLUGIN_NAME = "dask-ipar-dashboard"
#: Event topic the training clients publish on.
TOPIC = "dask-ipar"
#: Path of the page on the scheduler's web server.
ROUTE = "/ipar"
#: Steps (loss, accuracy, time) a run keeps for its curves: past this many, the older
#: half is thinned to every second step, so a run of any length holds at most this many
#: points (the newest at full resolution) and the scheduler's memory stays flat.
STEPS_KEPT = 4000
#: Records per worker kept between page fetches.
RECORDS_KEPT = 6000
#: Epoch records a run keeps (the newest).
EPOCHS_KEPT = 1000


class _Run:
    """What the scheduler knows of one training run."""

    def __init__(self, info: dict):
        self.info = info
        self.steps: deque = deque()
        self.epochs: list = []
        self.comm: list = []
        self.test: dict = {}
        self.ended: str | None = None
        self.records: dict = {}  # worker -> deque of records
        self.since: dict = {}  # worker -> end time of its newest record seen

    def thin(self):
        """Keep every second of the older half of the steps (curves of long runs)."""
        steps = list(self.steps)
        half = len(steps) // 2
        self.steps = deque(steps[:half:2] + steps[half:])

    @property
    def cells(self):
        return [((c[0], c[1]), c[2]) for c in self.info["cells"]]

    @property
    def cell_of(self):
        return {w: cell for cell, w in self.cells}


def _unstored(scheduler, topics) -> None:
    """Have dask's event broker keep no copy of ``topics`` (this plugin keeps what it
    needs; subscribers still get every message). Without it the scheduler keeps the last
    1,000 messages of each (``distributed.admin.low-level-log-length``): about 2.4 MB of
    step curves and 4 MB of program traces, filling for the first ~5,500 steps of a run.
    (``Scheduler._broker._topics``: a dask internal, see docs/concepts.md.)"""
    topics_of = getattr(getattr(scheduler, "_broker", None), "_topics", None)
    if topics_of is None:
        return
    for t in topics:
        topic = topics_of[t]
        if getattr(topic, "events", None) is not None:
            topic.events = deque(maxlen=0)


class IparDashboard(SchedulerPlugin):
    """Scheduler plugin: the runs that clients report, and the ``/ipar`` page."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self):
        self.runs: dict = {}
        self._stream_pending: dict = {}  # program key -> its bars, until it finishes

    async def start(self, scheduler):
        self.scheduler = scheduler
        _unstored(scheduler, (TOPIC, STREAM_TOPIC))
        app = getattr(scheduler, "http_application", None)
        if app is None:  # a scheduler without an HTTP server: the events are still kept
            return
        from tornado import web

        plugin = self

        class _Handler(web.RequestHandler):
            def initialize(self, kind):
                self.kind = kind

            async def get(self):
                uid = self.get_argument("uid", None)
                if self.kind == "json":
                    self.set_header("Content-Type", "application/json")
                    self.write(json.dumps(await plugin.data(uid), default=str))
                    return
                self.set_header("Cache-Control", "no-store")
                body = await plugin.fragment(uid)
                self.write(body if self.kind == "fragment" else plugin.page(body))

        app.add_handlers(r".*$", [
            (ROUTE + r"/?", _Handler, {"kind": "page"}),
            (ROUTE + r"/fragment", _Handler, {"kind": "fragment"}),
            (ROUTE + r"/data\.json", _Handler, {"kind": "json"}),
        ])

    # ------------------------------------------------------------ task stream
    def _task_stream(self):
        """dask's task-stream plugin, where something reads the task stream (the
        dashboard's pages, ``get_task_stream``, ``performance_report``), else None."""
        return self.scheduler.plugins.get("task-stream")

    def _program_ended(self, msg):
        """A worker program's kernels and waits: into the task stream, in place of the
        program's bar (now, or once the scheduler hears that the program finished)."""
        stream = self._task_stream()
        if stream is None:
            return
        key = tuple(msg["program"])
        if isinstance(msg["groups"], bytes):  # packed by the worker (see program_done)
            msg = {**msg, "groups": msgpack.unpackb(msg["groups"])}
        if not splice(stream, key, msg["groups"], msg.get("delay", 0.0)):
            self._stream_pending[key] = msg
            while len(self._stream_pending) > 4096:  # programs whose end never came
                self._stream_pending.pop(next(iter(self._stream_pending)))

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "memory" and self._stream_pending and key in self._stream_pending:
            msg = self._stream_pending.pop(key)
            # after every plugin's hook: the task stream's entry is added by its own
            self.scheduler.loop.add_callback(
                lambda: (s := self._task_stream()) is not None
                and splice(s, key, msg["groups"], msg.get("delay", 0.0)))

    # ------------------------------------------------------------ events
    def log_event(self, topic, msg):
        if topic == STREAM_TOPIC and isinstance(msg, dict):
            self._program_ended(msg)
            return
        if topic != TOPIC or not isinstance(msg, dict):
            return
        kind, uid = msg.get("kind"), msg.get("uid")
        if kind == "run":
            self.runs[uid] = _Run(msg)
            while len(self.runs) > 8:  # the oldest runs go
                self.runs.pop(next(iter(self.runs)))
            return
        run = self.runs.get(uid)
        if run is None:
            return
        if kind == "steps":
            run.steps.extend(tuple(s) for s in msg["steps"])
            if len(run.steps) > STEPS_KEPT:
                run.thin()
        elif kind == "epoch":
            run.epochs.append(msg["record"])
            del run.epochs[:-EPOCHS_KEPT]
        elif kind == "rewind":  # back to a checkpoint, perhaps on other workers
            run.info["cells"] = msg["cells"]
            kept = [s for s in run.steps if s[0] <= msg["step"]]
            run.steps.clear()
            run.steps.extend(kept)
            run.epochs = [e for e in run.epochs if e.get("steps", 0) <= msg["step"]]
        elif kind == "comm":
            run.comm = msg["rows"]
        elif kind == "end":
            run.ended = msg.get("reason", "finished")
        elif kind == "test":
            run.test = msg.get("figures") or {}

    def _run(self, uid):
        if uid is not None:
            return self.runs.get(uid)
        return max(self.runs.values(), key=lambda r: r.info.get("started", 0), default=None)

    # ------------------------------------------------------------ workers
    async def _poll(self, run) -> dict:
        """Ask the grid's workers for their new records and state; returns status per
        worker (``state``, ``what``, ``peer``, ``memory``) for those connected."""
        workers = [w for _, w in run.cells if w in self.scheduler.workers]
        status = {}
        if not workers:
            return status
        since = min((run.since.get(w, 0.0) for w in workers), default=0.0)
        got = await self.scheduler.broadcast(
            msg={"op": "ipar_timeline", "since": since, "uid": run.info["model_uid"]},
            workers=workers, on_error="return")
        for w, rep in got.items():
            ws = self.scheduler.workers.get(w)
            mem = ws.memory.process if ws is not None else None
            if not isinstance(rep, dict):  # no recorder there, or an error
                status[w] = {"state": "idle", "what": "no timeline recorder", "memory": mem}
                continue
            box = run.records.setdefault(w, deque(maxlen=RECORDS_KEPT))
            newest = run.since.get(w, 0.0)
            for r in rep["records"]:
                if r[3] > newest:
                    box.append(tuple(r))
            if box:
                run.since[w] = max(newest, max(r[3] for r in box))
            state, what, peer, _ = rep["state"]
            if state == "idle" and rep.get("executing"):  # a task of the task-graph executor
                state, what = "computing", "dask tasks"
            status[w] = {"state": state, "what": what, "peer": peer, "memory": mem}
        return status

    async def data(self, uid=None) -> dict:
        """The page's figures as plain data (``/ipar/data.json``)."""
        run = self._run(uid)
        if run is None:
            return {"runs": []}
        status = await self._poll(run)
        tls = step_timelines(run.records, run.cell_of, run.info["model_uid"],
                             complete_only=not run.ended)
        return {"run": run.info, "status": status, "steps": list(run.steps)[-1000:],
                "epochs": run.epochs, "comm": run.comm, "ended": run.ended,
                "timeline": [{"step": tl.step, "bars": [b.__dict__ for b in tl.bars]}
                             for tl in tls],
                "runs": [r.info["uid"] for r in self.runs.values()]}

    # ------------------------------------------------------------ HTML
    async def fragment(self, uid=None) -> str:
        """The live part of the page."""
        esc = html.escape
        run = self._run(uid)
        if run is None:
            return ("<p id='no-run'>No dask-ipar model has trained on this scheduler yet. "
                    "Start <code>dask-ipar train</code> or <code>model.fit(...)</code>; this "
                    "page follows the newest run.</p>")
        status = await self._poll(run)
        info = run.info
        tls = step_timelines(run.records, run.cell_of, info["model_uid"],
                             complete_only=not run.ended)
        steps = list(run.steps)
        measured = step_time_s([s[3] for s in steps[-200:]])
        pred = info.get("predicted_step_s")
        state = run.ended or "training"
        last = steps[-1] if steps else None
        out = [f"<h1>{esc(info.get('model', 'model'))} on grid {esc(info['grid'])}</h1>",
               "<table class='kv' id='run'>",
               f"<tr><th class='l'>state</th><td id='run-state'>{esc(state)}</td></tr>",
               f"<tr><th class='l'>executor</th><td>{esc(info.get('executor', ''))}</td></tr>",
               f"<tr><th class='l'>step</th><td id='run-step'>"
               f"{last[0] if last else 0} of {info.get('total_steps', '?')}</td></tr>",
               f"<tr><th class='l'>batch</th><td>{info.get('batch', '')} samples</td></tr>",
               "<tr><th class='l'>step time</th><td id='step-time'>measured "
               + (f"{1e3 * measured:.1f} ms" if measured else "n/a")
               + ", predicted " + (f"{1e3 * pred:.1f} ms" if pred else
                                   esc(info.get("predicted_note", "n/a")))
               + "</td></tr>"]
        if last:
            out.append(f"<tr><th class='l'>loss, accuracy</th><td>{last[1]:.4f}, "
                       f"{last[2]:.4f}</td></tr>")
        out.append("</table>")
        if len(self.runs) > 1:
            out.append("<p class='muted'>Other runs: " + " ".join(
                f"<a href='?uid={esc(r.info['uid'])}'>{esc(r.info.get('model', ''))} "
                f"{esc(r.info['grid'])}</a>" for r in self.runs.values() if r is not run)
                + "</p>")
        out.append("<h2>Grid</h2>")
        out.append(grid_html((info["pr"], info["pc"]), run.cells, status, run.cell_of))
        out.append(f"<h2>Timeline of the last {len(tls)} recorded steps</h2>")
        out.append(timeline_html(tls, run.cells))
        out.append("<h2>Per layer and phase (per step)</h2>")
        out.append("<p class='muted'>Bytes and communication seconds: the cost model beside "
                   "the workers' transfer logs (mean over the steps measured so far, "
                   "updated at each epoch's end). Compute and wait: from the timeline above "
                   "(the largest over cells, mean of the recorded steps).</p>")
        out.append(phase_table_html(run.comm, tls))
        out.append("<h2>Training</h2>")
        out.append(curves_html(steps, run.epochs, run.test))
        return "\n".join(out)

    @staticmethod
    def page(fragment: str) -> str:
        return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
                f"<title>dask-ipar</title><style>{CSS}</style></head><body>"
                "<p class='muted'>dask-ipar &middot; <a href='status'>dask dashboard</a> "
                "&middot; updates every 2 s</p>"
                f"<div id='live'>{fragment}</div>"
                "<script>const live=document.getElementById('live');"
                "const src=location.pathname.replace(/\\/?$/,'')+'/fragment'+location.search;"
                "setInterval(()=>fetch(src,{cache:'no-store'}).then(r=>r.ok?r.text():null)"
                ".then(t=>{if(t!==null)live.innerHTML=t}).catch(()=>{}),2000);</script>"
                "</body></html>")
