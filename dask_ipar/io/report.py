"""The run card: one self-contained HTML page per training run.

It holds the model and grid, the training curve, the per-layer, per-phase
predicted-vs-measured communication table, bytes per worker, and (when bokeh
is installed) dask's own performance report embedded inline. Charts are
plain inline SVG, so the card needs no JavaScript, no network and no extra
dependency to render.
"""

from __future__ import annotations

import datetime as _dt
import html

__all__ = ["render_run_card", "write_run_card"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1100px;
color:#1d2430;background:#fff}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid
#dde;padding-bottom:.2em}
table{border-collapse:collapse;margin:.5em 0;font-size:.92em}
th,td{border:1px solid #cfd6e0;padding:.25em .6em;text-align:right}
th{background:#eef2f7}td.l,th.l{text-align:left}
.ok{color:#1a7f37;font-weight:600}.bad{color:#cf222e;font-weight:600}
.kv td{text-align:left}.muted{color:#667}
iframe{width:100%;height:900px;border:1px solid #cfd6e0}
"""


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _line_chart(series: dict, width=520, height=200, title="") -> str:
    """Inline SVG of one or more ``name -> [y, ...]`` series on a shared x axis."""
    pad = 36
    colors = ["#0969da", "#bf3989", "#1a7f37", "#9a6700"]
    all_y = [v for ys in series.values() for v in ys]
    if not all_y:
        return ""
    lo, hi = min(all_y), max(all_y)
    hi = hi if hi > lo else lo + 1
    n = max(len(ys) for ys in series.values())
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'role="img" aria-label="{html.escape(title)}">',
             f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fbfcfe"/>',
             f'<text x="{pad}" y="16" font-size="12">{html.escape(title)}</text>',
             f'<text x="4" y="{pad}" font-size="10">{hi:.3g}</text>',
             f'<text x="4" y="{height - pad + 10}" font-size="10">{lo:.3g}</text>']
    for k, (name, ys) in enumerate(series.items()):
        pts = " ".join(
            f"{pad + (width - 2 * pad) * (i / max(n - 1, 1)):.1f},"
            f"{height - pad - (height - 2 * pad) * ((y - lo) / (hi - lo)):.1f}"
            for i, y in enumerate(ys))
        c = colors[k % len(colors)]
        parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{pts}"/>')
        parts.append(f'<text x="{width - 150}" y="{16 + 14 * k}" font-size="11" fill="{c}">'
                     f'{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


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
                         f'font-size="10">{_fmt_bytes(v)}</text>')
        y += 2 * bar_h + 8
    parts.append("</svg>")
    return "".join(parts)


def render_run_card(summary: dict, history, model, perf_report_html: str | None = None) -> str:
    """The run card as an HTML string (see :func:`write_run_card`)."""
    esc = html.escape
    grid = model.binding.grid if model.binding is not None else None
    out = ["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
           f"<title>dask-ipar run card: {esc(str(summary.get('model', '')))} on "
           f"{esc(str(grid))}</title><style>{_CSS}</style></head><body>",
           "<h1>dask-ipar run card</h1>",
           f"<p class='muted'>{_dt.datetime.now().isoformat(timespec='seconds')}</p>",
           "<h2>Run</h2><table class='kv' id='summary'>"]
    for k, v in summary.items():
        if k in ("comm", "history"):
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
        out.append(_line_chart({"loss per step": [s.loss for s in history.steps]},
                               title="loss per step"))
        out.append(_line_chart({"accuracy per step": [s.accuracy for s in history.steps]},
                               title="training accuracy per step"))
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
        if "val_loss" in history.epochs[0]:
            out.append(_line_chart({"training loss": [e["loss"] for e in history.epochs],
                                    "validation loss": [e["val_loss"] for e in history.epochs]},
                                   title="loss per epoch"))
        if history.stopped:
            out.append(f"<p>{esc(history.stopped)}</p>")

    comm = history.comm
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
                f"<td class='{cls}'>{r.ratio:.3f}</td><td>{1e3 * r.predicted_s:.2f}</td>"
                f"<td>{1e3 * r.measured_s:.2f}</td></tr>")
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
                       f"<td>{_fmt_bytes(comm.sent_bytes.get(w, 0))}</td>"
                       f"<td>{_fmt_bytes(comm.received_bytes.get(w, 0))}</td></tr>")
        out.append("</table>")

    out.append("<h2>Dask performance report</h2>")
    if perf_report_html:
        out.append(f"<iframe title='dask performance report' srcdoc=\"{esc(perf_report_html)}\">"
                   "</iframe>")
    else:
        out.append("<p class='muted'>Not recorded (needs bokeh: pip install 'dask-ipar[train]')."
                   "</p>")
    out.append("</body></html>")
    return "\n".join(out)


def write_run_card(path, summary: dict, history, model, perf_report_html: str | None = None):
    """Write the run card of a finished ``fit`` to ``path`` (one self-contained HTML file)."""
    from pathlib import Path

    Path(path).write_text(render_run_card(summary, history, model, perf_report_html),
                          encoding="utf-8")
