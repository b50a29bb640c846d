"""What each grid cell did in a training step: records to bars, and a step's critical phase.

A *record* is what a worker's :class:`~dask_ipar.dashboard.recorder.TimelineRecorder`
keeps of one interval: ``(key_name, kind, start, stop, peer)`` with wall-clock seconds
(``time.time()``, comparable across the processes of one host and NTP-synced hosts):

* ``"compute"``: a kernel of the step graph ran (a task of the task-graph executor, or a
  task inside a worker program);
* ``"wait"``: a worker program waited for a block (``key_name``) from ``peer``;
* ``"send"``: a block pushed by a worker program was on its way to ``peer``;
* ``"recv"``: dask fetched the block from ``peer`` (task-graph executor; drawn on the
  sender's lane as a send too).

Both executors give the same records, so the dashboard page and the run card draw the
same timeline whichever runs the steps. This module is pure Python: no dask, no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from dask_ipar.nn.graph import phase_of_key, span_of_name

__all__ = ["Bar", "StepTimeline", "bars_of", "step_timelines", "phase_summary", "step_of_name",
           "uid_of_name", "layer_phase", "KINDS"]

#: Record kinds: computing, waiting for a block, a block travelling out, one fetched in.
KINDS = ("compute", "wait", "send", "recv")


def step_of_name(name: str) -> int | None:
    """The training step of a key name ``"<layer>.<task>-<uid>-s<step>"``, else None.

    >>> step_of_name("dense1.act-0a1b2c3d-s7")
    7
    >>> step_of_name("dense1.w-0a1b2c3d-c2") is None
    True
    """
    head, sep, tail = name.rpartition("-s")
    return int(tail) if sep and tail.isdigit() and "." in head else None


def uid_of_name(name: str) -> str | None:
    """The model uid in a key name ``"<layer>.<task>-<uid>-s<step>"``, else None.

    >>> uid_of_name("dense1.act-0a1b2c3d-s7")
    '0a1b2c3d'
    """
    head, sep, _ = name.rpartition("-s")
    if not sep or "-" not in head:
        return None
    return head.split("-", 1)[1]


@dataclass(frozen=True)
class Bar:
    """One interval of one grid cell, in seconds from its step's start."""

    cell: tuple  # (i, j)
    layer: str
    phase: str  # forward, backward, update, fwd_gather, dw_reduce, ... (the spans' names)
    kind: str  # one of KINDS
    start_s: float
    stop_s: float
    peer: tuple | None = None  # the other cell of a wait, send or receive

    @property
    def seconds(self) -> float:
        return self.stop_s - self.start_s

    @property
    def label(self) -> str:
        who = "" if self.peer is None else f" {'from' if self.kind != 'send' else 'to'} " \
            f"cell ({self.peer[0]}, {self.peer[1]})"
        verb = {"compute": "", "wait": " wait", "send": " send", "recv": " receive"}[self.kind]
        return f"{self.layer} {self.phase}{verb}{who}: {1e3 * self.seconds:.2f} ms"


def layer_phase(name: str, kind: str) -> tuple[str, str]:
    """``(layer, phase)`` of a key name: a kernel's span, or the collective moving a block."""
    if kind != "compute":  # a block in transit: the collective that moves it
        lp = phase_of_key(name)
        if lp is not None:
            return lp
    layer, phase = span_of_name(name)["name"][1:]
    return layer, phase


@dataclass
class StepTimeline:
    """The bars of every cell in one step; times from the step's first record."""

    step: int
    bars: list
    t0: float  # wall-clock start

    @property
    def seconds(self) -> float:
        """From the first record's start to the last one's end (compute and waits)."""
        main = [b for b in self.bars if b.kind in ("compute", "wait")] or self.bars
        return max((b.stop_s for b in main), default=0.0)

    def critical_cell(self):
        """The cell whose compute and waits end last: the one the step waited for."""
        main = [b for b in self.bars if b.kind in ("compute", "wait")]
        return max(main, key=lambda b: b.stop_s).cell if main else None

    def by_phase(self, cell=None) -> dict:
        """``{(layer, phase, kind): seconds}`` on ``cell`` (every cell when None, max)."""
        per = defaultdict(lambda: defaultdict(float))
        for b in self.bars:
            per[b.cell][(b.layer, b.phase, b.kind)] += b.seconds
        if cell is not None:
            return dict(per.get(cell, {}))
        out: dict = defaultdict(float)
        for d in per.values():
            for k, s in d.items():
                out[k] = max(out[k], s)
        return dict(out)


def bars_of(records, cell_of, uid: str | None = None):
    """``{step: [Bar, ...]}`` with absolute times from ``{worker: [record, ...]}``.

    ``cell_of``: worker address -> ``(i, j)`` (workers outside the grid are skipped);
    ``uid``: keep the records of that model only.
    """
    out = defaultdict(list)
    for worker, recs in records.items():
        cell = cell_of.get(worker)
        if cell is None:
            continue
        for name, kind, t0, t1, peer in recs:
            step = step_of_name(name)
            if step is None or (uid is not None and uid_of_name(name) != uid):
                continue
            layer, phase = layer_phase(name, kind)
            other = cell_of.get(peer) if peer else None
            out[step].append(Bar(cell, layer, phase, kind, t0, t1, other))
            if kind == "recv" and other is not None:  # dask's fetch: the sender's side too
                out[step].append(Bar(other, layer, phase, "send", t0, t1, cell))
    return out


def step_timelines(records, cell_of, uid: str | None = None, last: int = 3,
                   complete_only: bool = True) -> list:
    """The :class:`StepTimeline` of the ``last`` recorded training steps, oldest first.

    A step counts as complete when a later step has records too (its own last
    records may still be running otherwise); with ``complete_only=False`` the newest
    step is taken as it is.
    """
    per = bars_of(records, cell_of, uid)
    # training steps only (inference and validation graphs have no backward pass)
    steps = sorted(s for s, bars in per.items() if any(b.phase == "backward" for b in bars))
    if complete_only and len(steps) > 1:
        steps = steps[:-1]
    out = []
    for s in steps[-last:]:
        bars = per[s]
        t0 = min(b.start_s for b in bars)
        out.append(StepTimeline(s, sorted(
            (Bar(b.cell, b.layer, b.phase, b.kind, b.start_s - t0, b.stop_s - t0, b.peer)
             for b in bars), key=lambda b: (b.cell, b.start_s)), t0))
    return out


def phase_summary(timelines) -> tuple[list, dict | None]:
    """Per layer and phase, seconds per step (mean over ``timelines``) on the slowest cell.

    Returns ``(rows, critical)``: ``rows`` = ``[{"layer", "phase", "compute_s", "wait_s",
    "critical_s"}]`` in first-seen order, where ``compute_s``/``wait_s`` are the largest
    over cells and ``critical_s`` the time on each step's critical cell (compute + wait);
    ``critical`` is the row with the most time on the critical cells, or None.
    """
    if not timelines:
        return [], None
    n = len(timelines)
    acc: dict = {}
    for tl in timelines:
        crit = tl.critical_cell()
        on_crit = tl.by_phase(crit) if crit is not None else {}
        for (layer, phase, kind), s in tl.by_phase().items():
            row = acc.setdefault((layer, phase), {"layer": layer, "phase": phase,
                                                  "compute_s": 0.0, "wait_s": 0.0,
                                                  "critical_s": 0.0})
            if kind == "compute":
                row["compute_s"] += s / n
            elif kind == "wait":
                row["wait_s"] += s / n
        for (layer, phase, kind), s in on_crit.items():
            if kind in ("compute", "wait"):
                acc[(layer, phase)]["critical_s"] += s / n
    rows = list(acc.values())
    critical = max(rows, key=lambda r: r["critical_s"]) if rows else None
    return rows, critical
