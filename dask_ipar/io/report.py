"""The run card: one self-contained HTML page per training run.

It holds the model and grid, the training curves (loss, accuracy, throughput, with the
validation and test figures), the per-cell timeline of the last recorded steps with the
per-layer, per-phase table of the dashboard page (:mod:`dask_ipar.dashboard.render`),
the predicted-vs-measured communication table and bytes per worker. Charts are
inline SVG, so the card needs no JavaScript, no network and no extra dependency to
render. Dask's own performance report, when recorded, is a file of its own beside the
card (linked from it): its panels do not read well inside another page.
"""

from __future__ import annotations

import datetime as _dt
import html

from dask_ipar.dashboard.render import (CSS, curves_html, fmt_bytes, fmt_ms,
                                        phase_table_html, timeline_html)
from dask_ipar.dashboard.timeline import step_timelines

__all__ = ["render_run_card", "write_run_card"]



def _bar_chart(rows, width=1000, bar_h=14) -> str:
    """Inline SVG: predicted vs measured bytes per layer and phase."""
    rows = [r for r in rows if r.predicted_bytes or r.measured_bytes]
    if not rows:
        return '<p class="muted">No bytes moved between workers (a 1x1 grid).</p>'
    top = max(max(r.predicted_bytes, r.measured_bytes) for r in rows)
    label_w = 190
    scale = (width - label_w - 90) / top
    h = len(rows) * (2 * bar_h + 8) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" role="img" '
             'aria-label="predicted vs measured bytes">',
             '<text x="0" y="12" font-size="11" fill="#0969da">predicted</text>',
             '<text x="80" y="12" font-size="11" fill="#bf3989">measured</text>']
    y = 24
    for r in rows:
        parts.append(f'<text x="0" y="{y + bar_h + 3}" font-size="11">'
                     f'{html.escape(r.layer)} {html.escape(r.phase)}</text>')
        for k, (v, c) in enumerate(((r.predicted_bytes, "#0969da"), (r.measured_bytes, "#bf3989"))):
            parts.append(f'<rect x="{label_w}" y="{y + k * bar_h}" width="{max(v * scale, 1):.1f}" '
                         f'height="{bar_h - 2}" fill="{c}"/>')
            parts.append(f'<text x="{label_w + v * scale + 4:.1f}" y="{y + k * bar_h + 10}" '
                         f'font-size="10">{fmt_bytes(v)}</text>')
        y += 2 * bar_h + 8
    parts.append("</svg>")
    return "".join(parts)


def render_run_card(summary: dict, history, model, perf_report: str | None = None,
                    records: dict | None = None) -> str:
    """The run card as an HTML string (see :func:`write_run_card`)."""
    esc = html.escape
    grid = model.binding.grid if model.binding is not None else None
    out = ["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
           f"<title>dask-ipar run card: {esc(str(summary.get('model', '')))} on "
           f"{esc(str(grid))}</title><style>{CSS}</style></head><body>",
           "<h1>dask-ipar run card</h1>",
           f"<p class='muted'>{_dt.datetime.now().isoformat(timespec='seconds')}</p>",
           "<h2>Run</h2><table class='kv' id='summary'>"]
    for k, v in summary.items():
        if k in ("comm", "history", "input"):  # tables of their own below
            continue
        val = f"{v:.4g}" if isinstance(v, float) else str(v)
        out.append(f"<tr><th class='l'>{esc(str(k))}</th><td>{esc(val)}</td></tr>")
    out.append("</table>")

    out.append("<h2>Model and grid</h2><table id='layers'><tr><th class='l'>layer</th>"
               "<th>inputs</th><th>outputs</th><th class='l'>activation</th><th>weights</th>"
               "<th class='l'>rows over Pr</th><th class='l'>weight columns over Pc</th></tr>")
    for lay in model.engine.layouts:
        out.append(
            f"<tr><td class='l'>{lay.name}</td><td>{lay.n_in}</td><td>{lay.n_out}</td>"
            f"<td class='l'>{lay.activation}</td><td>{lay.n_out * lay.n_cols}</td>"
            f"<td class='l'>{[b - a for a, b in lay.rows]}</td>"
            f"<td class='l'>{[b - a for a, b in lay.wcols]}</td></tr>")
    out.append("</table>")
    if grid is not None:
        out.append("<table id='cells'><tr><th class='l'>cell (i, j)</th>"
                   "<th class='l'>worker</th></tr>")
        for (i, j) in grid.cells():
            out.append(f"<tr><td class='l'>({i}, {j})</td>"
                       f"<td class='l'>{esc(model.binding.worker(i, j))}</td></tr>")
        out.append("</table>")

    if history.steps:
        out.append("<h2>Training</h2>")
        steps = [(s.step, s.loss, s.accuracy, s.done_s, s.batch) for s in history.steps]
        out.append(curves_html(steps, history.epochs,
                               {k: summary.get(k) for k in ("test_loss", "test_accuracy")}))
    if history.epochs:
        cols = [k for k in ("epoch", "loss", "accuracy", "val_loss", "val_accuracy", "lr",
                            "samples_per_s", "seconds") if k in history.epochs[0]]
        out.append("<table id='epochs'><tr>" + "".join(f"<th>{c}</th>" for c in cols)
                   + "</tr>")
        for e in history.epochs:
            out.append("<tr>" + "".join(
                f"<td>{e[c]:.4g}</td>" if isinstance(e.get(c), float) else f"<td>{e.get(c)}</td>"
                for c in cols) + "</tr>")
        out.append("</table>")
        if history.stopped:
            out.append(f"<p>{esc(history.stopped)}</p>")

    comm = history.comm
    if grid is not None and records and any(records.values()):  # none: recorder off
        cells = [((i, j), model.binding.worker(i, j)) for i, j in grid.cells()]
        tls = step_timelines(records, {w: c for c, w in cells}, model.uid,
                             complete_only=False)
        out.append(f"<h2>Timeline of the last {len(tls)} recorded steps</h2>")
        out.append(timeline_html(tls, cells))
        out.append("<h2>Per layer and phase (per step)</h2>")
        rows = [] if comm is None else [(r.layer, r.phase, r.predicted_bytes,
                                         r.measured_bytes, r.predicted_s, r.measured_s)
                                        for r in comm.rows]
        out.append(phase_table_html(rows, tls))
    if comm is not None:
        out.append(f"<h2>Communication: predicted vs measured (per step, mean of {comm.steps} "
                   "steps)</h2>")
        out.append("<p>Predicted: <code>dask_ipar.cost</code>, engine convention. Measured: "
                   "the workers' transfer logs, attributed to layer and phase by key name. "
                   "Seconds: alpha-beta prediction vs the busiest receiver's transfer time.</p>")
        out.append("<table id='comm-table'><tr><th class='l'>layer</th><th class='l'>phase</th>"
                   "<th>predicted bytes</th><th>measured bytes</th><th>ratio</th>"
                   "<th>predicted ms</th><th>measured ms</th></tr>")
        for r in comm.rows:
            cls = "ok" if abs(r.ratio - 1) <= 0.02 else "bad"
            out.append(
                f"<tr><td class='l'>{esc(r.layer)}</td><td class='l'>{esc(r.phase)}</td>"
                f"<td>{r.predicted_bytes:.0f}</td><td>{r.measured_bytes:.0f}</td>"
                f"<td class='{cls}'>{r.ratio:.3f}</td><td>{fmt_ms(r.predicted_s)}</td>"
                f"<td>{fmt_ms(r.measured_s)}</td></tr>")
        out.append("</table>")
        if getattr(comm, "input_rows", None):
            out.append("<h2>Input data per step</h2><p>client: bytes of data blocks the "
                       "client sent to the workers; storage: bytes the cells read from "
                       "storage themselves (measured: as the store returned them, compressed "
                       "whole chunks; predicted: the rows they need).</p><table id='input-table'>"
                       "<tr><th class='l'>source</th><th>predicted bytes</th>"
                       "<th>measured bytes</th></tr>")
            for r in comm.input_rows:
                out.append(f"<tr><td class='l'>{esc(r.phase)}</td><td>{r.predicted_bytes:.0f}"
                           f"</td><td>{r.measured_bytes:.0f}</td></tr>")
            out.append("</table>")
        out.append(_bar_chart(comm.rows))
        out.append("<h2>Bytes per worker (whole run)</h2><table id='workers'><tr>"
                   "<th class='l'>worker</th><th>sent</th><th>received</th></tr>")
        for w in sorted(set(comm.sent_bytes) | set(comm.received_bytes)):
            out.append(f"<tr><td class='l'>{esc(w)}</td>"
                       f"<td>{fmt_bytes(comm.sent_bytes.get(w, 0))}</td>"
                       f"<td>{fmt_bytes(comm.received_bytes.get(w, 0))}</td></tr>")
        out.append("</table>")

    if perf_report:
        out.append(f"<h2>Dask performance report</h2><p>dask's own report of this run (task "
                   f"stream, worker profile, bandwidth): <a href='{esc(perf_report)}'>"
                   f"{esc(perf_report)}</a>.</p>")
    out.append("</body></html>")
    return "\n".join(out)


def write_run_card(path, summary: dict, history, model, perf_report: str | None = None,
                   records: dict | None = None):
    """Write the run card of a finished ``fit`` to ``path`` (one self-contained HTML file).

    ``perf_report``: the file name of dask's performance report beside it, to link;
    ``records``: the workers' timeline records
    (:func:`dask_ipar.dashboard.recorder.collect_records`), drawn as the timeline."""
    from pathlib import Path

    Path(path).write_text(render_run_card(summary, history, model, perf_report, records),
                          encoding="utf-8")
