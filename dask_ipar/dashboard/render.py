"""HTML sections of a run, shared by the live dashboard page and the run card.

Pure functions of plain data (no dask): the grid of cells, the per-layer and per-phase
table (predicted vs measured bytes and seconds, measured compute and waits from the
timeline, the critical phase), the step time, and the training curves.
"""

from __future__ import annotations

import html
import math
import statistics

from dask_ipar.dashboard.svg import legend_html, line_chart, phase_color, timeline_svg
from dask_ipar.dashboard.timeline import layer_phase, phase_summary

__all__ = ["CSS", "grid_html", "phase_table_html", "timeline_html", "curves_html",
           "step_time_s", "fmt_bytes", "fmt_ms"]

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:1.2em auto;max-width:1340px;
padding:0 20px;color:#1d2430;background:#fff}
h1{font-size:1.5em;margin:.2em 0}h2{font-size:1.15em;margin-top:1.4em;border-bottom:1px solid
#dde;padding-bottom:.2em}
table{border-collapse:collapse;margin:.5em 0;font-size:.9em}
th,td{border:1px solid #cfd6e0;padding:.22em .55em;text-align:right}
th{background:#eef2f7}td.l,th.l{text-align:left}
.ok{color:#1a7f37;font-weight:600}.bad{color:#cf222e;font-weight:600}
.kv td{text-align:left}.muted{color:#667}
.charts{display:flex;flex-wrap:wrap;gap:12px}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;font-size:.85em;margin:.3em 0}
.lg i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-1px}
.lg i.wait{background:repeating-linear-gradient(45deg,#6e7781 0 2px,#fff 2px 5px);
border:1px solid #6e7781;box-sizing:border-box}
.lg i.send{height:5px;background:#6e7781;vertical-align:2px}
td.cell{text-align:left;vertical-align:top;min-width:220px}
.state-computing{color:#1a7f37;font-weight:600}.state-waiting{color:#9a6700;font-weight:600}
.state-idle{color:#57606a}.state-gone{color:#cf222e;font-weight:600}
tr.critical td{background:#fff8c5}
.swatch{display:inline-block;width:10px;height:10px;margin-right:5px}
"""


#: Phases in the order a step runs them (the table's order within a layer).
PHASE_ORDER = ["input", "w_gather", "halo_fwd", "forward", "fwd_gather", "redistribute",
               "loss", "backward", "halo_bwd", "dx_reduce", "dw_reduce", "grad_norm",
               "update", "to_host"]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def fmt_ms(seconds: float) -> str:
    """Seconds as milliseconds in a table cell: two decimals, and two significant digits
    below 0.01 ms, so a transfer of a few microseconds reads as measured, not as zero."""
    ms = 1e3 * seconds
    return f"{ms:.2f}" if ms == 0 or abs(ms) >= 0.01 else f"{ms:.2g}"


def grid_html(grid, cells, status: dict, cell_of: dict) -> str:
    """The grid as a ``Pr x Pc`` table: each cell's worker, what it does now, its memory.

    ``cells``: ``[((i, j), worker)]``; ``status``: worker -> ``{"state", "what", "peer",
    "memory"}`` (missing: the worker is gone)."""
    esc = html.escape
    pr, pc = grid
    at = {cell: w for cell, w in cells}
    out = ["<table id='grid'><tr><th></th>"
           + "".join(f"<th>column {j} (batch)</th>" for j in range(pc)) + "</tr>"]
    for i in range(pr):
        out.append(f"<tr><th>row {i} (model)</th>")
        for j in range(pc):
            w = at.get((i, j), "?")
            st = status.get(w)
            if st is None:
                state, detail = "gone", "not connected to the scheduler"
            else:
                state = st.get("state", "idle")
                detail = ""
                if state == "computing" and st.get("what"):
                    detail = " ".join(_what(st["what"]))
                elif state == "waiting":
                    peer = cell_of.get(st.get("peer"))
                    who = f"cell ({peer[0]}, {peer[1]})" if peer else str(st.get("peer"))
                    detail = f"{' '.join(_what(st.get('what', ''), block=True))} from {who}"
                elif st.get("what"):
                    detail = st["what"]
            mem = "" if st is None or st.get("memory") is None else \
                f"<br><span class='muted'>memory {fmt_bytes(st['memory'])}</span>"
            out.append(f"<td class='cell' data-cell='{i},{j}'><b>({i}, {j})</b> "
                       f"<span class='muted'>{esc(w)}</span><br>"
                       f"<span class='state-{esc(state)}'>{esc(state)}</span> {esc(detail)}"
                       f"{mem}</td>")
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


def _what(name: str, block: bool = False) -> tuple:
    try:
        return layer_phase(name, "wait" if block else "compute")
    except Exception:  # noqa: BLE001 - a name of another kind: shown as it is
        return (name,)


def step_time_s(done_s: list) -> float | None:
    """Measured seconds per step: the median gap between consecutive steps' completions
    (steps overlap in flight, so this is the rate the run reaches)."""
    gaps = [b - a for a, b in zip(done_s, done_s[1:]) if b > a]
    return statistics.median(gaps) if gaps else None


def phase_table_html(comm_rows, timelines, *, table_id="phase-table") -> str:
    """Per layer and phase: predicted and measured bytes and communication seconds (the
    comm table's rows ``(layer, phase, pred B, meas B, pred s, meas s)``), then measured
    compute and wait seconds per step from the timeline (the largest over cells) and the
    time on the critical cell; the phase with the most of it is marked critical."""
    esc = html.escape
    summary, critical = phase_summary(timelines)
    comm = {(r[0], r[1]): r for r in comm_rows}
    order, seen = [], set()
    for key in [(r["layer"], r["phase"]) for r in summary] + list(comm):
        if key not in seen:
            seen.add(key)
            order.append(key)
    layers = list(dict.fromkeys([lp[0] for lp in comm] + [lp[0] for lp in order]))
    order.sort(key=lambda lp: (layers.index(lp[0]), PHASE_ORDER.index(lp[1])
                               if lp[1] in PHASE_ORDER else len(PHASE_ORDER)))
    by = {(r["layer"], r["phase"]): r for r in summary}
    out = [f"<table id='{esc(table_id)}'><tr><th class='l'>layer</th><th class='l'>phase</th>"
           "<th>predicted bytes</th><th>measured bytes</th><th>predicted comm ms</th>"
           "<th>measured comm ms</th><th>compute ms</th><th>wait ms</th>"
           "<th>ms on critical cell</th></tr>"]
    for layer, phase in order:
        c = comm.get((layer, phase))
        s = by.get((layer, phase), {})
        crit = critical is not None and (critical["layer"], critical["phase"]) == (layer, phase)
        cells = [f"{c[2]:.0f}" if c else "", f"{c[3]:.0f}" if c else "",
                 fmt_ms(c[4]) if c else "", fmt_ms(c[5]) if c else "",
                 fmt_ms(s['compute_s']) if s else "", fmt_ms(s['wait_s']) if s else "",
                 fmt_ms(s['critical_s']) if s else ""]
        mark = " <b>&#9664; critical</b>" if crit else ""
        out.append(f"<tr{' class=critical' if crit else ''} data-layer='{esc(layer)}' "
                   f"data-phase='{esc(phase)}'><td class='l'>{esc(layer)}</td>"
                   f"<td class='l'><span class='swatch' style='background:"
                   f"{phase_color(phase)}'></span>{esc(phase)}{mark}</td>"
                   + "".join(f"<td>{v}</td>" for v in cells) + "</tr>")
    out.append("</table>")
    if critical is not None:
        out.append(f"<p id='critical'>Critical path: each step ends when its slowest cell "
                   f"does; on that cell <b>{esc(critical['layer'])} {esc(critical['phase'])}"
                   f"</b> takes the most time ({1e3 * critical['critical_s']:.2f} ms per step, "
                   "compute and waits).</p>")
    return "".join(out)


def timeline_html(timelines, cells, width=1300) -> str:
    """The timeline of the recorded steps with its legend."""
    phases = []
    for tl in timelines:
        for b in tl.bars:
            if b.phase not in phases:
                phases.append(b.phase)
    return legend_html(phases) + timeline_svg(timelines, cells, width=width)


def _smooth(xs, ys, window):
    out_x, out_y = [], []
    for k in range(0, len(ys), window):
        chunk = [y for y in ys[k:k + window] if y is not None and math.isfinite(y)]
        if chunk:
            out_x.append(xs[min(k + window, len(xs)) - 1])
            out_y.append(sum(chunk) / len(chunk))
    return out_x, out_y


def curves_html(steps, epochs, test: dict | None = None, width=640) -> str:
    """Loss, accuracy and throughput charts.

    ``steps``: ``[(step, loss, accuracy, done_s, batch)]``; ``epochs``: the per-epoch
    records (``val_loss``/``val_accuracy`` when validated); ``test``: ``{"test_loss",
    "test_accuracy"}`` figures of the finished run, drawn at its last step."""
    if not steps:
        return "<p class='muted'>No step finished yet.</p>"
    window = max(1, len(steps) // 300)  # a few hundred points at most
    xs = [s[0] for s in steps]
    loss = _smooth(xs, [s[1] for s in steps], window)
    acc = _smooth(xs, [s[2] for s in steps], window)
    rate_x, rate_y = [], []
    for a, b in zip(steps, steps[1:]):
        if b[3] > a[3]:
            rate_x.append(b[0])
            rate_y.append(b[4] / (b[3] - a[3]))
    rate = _smooth(rate_x, rate_y, max(window, 5))
    ep_steps = [e.get("steps") for e in epochs]
    loss_series = {"training loss": loss}
    acc_series = {"training accuracy": acc}
    if any("val_loss" in e for e in epochs):
        loss_series["validation loss"] = (ep_steps, [e.get("val_loss") for e in epochs])
        acc_series["validation accuracy"] = (ep_steps, [e.get("val_accuracy") for e in epochs])
    test = test or {}
    if test.get("test_loss") is not None:
        loss_series["test loss"] = ([xs[-1]], [test["test_loss"]])
    if test.get("test_accuracy") is not None:
        acc_series["test accuracy"] = ([xs[-1]], [test["test_accuracy"]])
    unit = f" (mean of {window} steps)" if window > 1 else ""
    return ("<div class='charts'>"
            + line_chart(loss_series, x_label="step", y_label="cross-entropy loss",
                         title="loss" + unit, width=width, chart_id="chart-loss")
            + line_chart(acc_series, x_label="step", y_label="accuracy (fraction correct)",
                         title="accuracy" + unit, width=width, chart_id="chart-accuracy")
            + line_chart({"training": rate}, x_label="step", y_label="samples per second",
                         title="throughput", width=width, chart_id="chart-throughput")
            + "</div>")
