"""Inline SVG charts shared by the dashboard page and the run card: a per-cell step
timeline and line charts with axes, ticks and units. Plain strings, no JavaScript, no
dependency, so the same markup renders live on the scheduler and in a saved HTML file.
"""

from __future__ import annotations

import html
import math

__all__ = ["PHASE_COLORS", "phase_color", "timeline_svg", "line_chart", "nice_ticks",
           "legend_html"]

#: One colour per phase name (the dashboard spans' names); collectives in warm colours.
PHASE_COLORS = {
    "input": "#8c959f",
    "forward": "#0969da",
    "loss": "#6639ba",
    "backward": "#1a7f37",
    "update": "#9a6700",
    "to_host": "#57606a",
    "fwd_gather": "#bf3989",
    "dx_reduce": "#cf222e",
    "dw_reduce": "#e16f24",
    "w_gather": "#d4a72c",
    "halo_fwd": "#8250df",
    "halo_bwd": "#a475f9",
    "redistribute": "#1b7c83",
    "grad_norm": "#953800",
}
_OTHER = "#6e7781"


def phase_color(phase: str) -> str:
    return PHASE_COLORS.get(phase, _OTHER)


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering ``[lo, hi]``.

    >>> nice_ticks(0, 1)
    [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    """
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    out, v = [], start
    while v <= hi + step * 1e-9:
        if v >= lo - step * 1e-9:
            out.append(round(v, 12))
        v += step
    return out


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def line_chart(series: dict, *, x_label: str, y_label: str, title: str, width: int = 640,
               height: int = 240, chart_id: str | None = None) -> str:
    """Inline SVG: ``name -> (xs, ys)`` series on shared, labelled x and y axes.

    A series of one point is drawn as a dot (e.g. a test figure at the last epoch).
    """
    pts = [(x, y) for xs, ys in series.values() for x, y in zip(xs, ys)
           if y is not None and math.isfinite(y)]
    ident = f' id="{html.escape(chart_id)}"' if chart_id else ""
    if not pts:
        return f'<p class="muted"{ident}>{html.escape(title)}: no data yet.</p>'
    left, right, top, bottom = 58, 16, 28, 42
    pw, ph = width - left - right, height - top - bottom
    x_lo, x_hi = min(p[0] for p in pts), max(p[0] for p in pts)
    y_lo, y_hi = min(p[1] for p in pts), max(p[1] for p in pts)
    if x_hi <= x_lo:
        x_hi = x_lo + 1
    if y_hi <= y_lo:
        y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
    xt, yt = nice_ticks(x_lo, x_hi), nice_ticks(y_lo, y_hi)
    x_lo, x_hi = min(x_lo, xt[0]), max(x_hi, xt[-1])
    y_lo, y_hi = min(y_lo, yt[0]), max(y_hi, yt[-1])

    def sx(x):
        return left + pw * (x - x_lo) / (x_hi - x_lo)

    def sy(y):
        return top + ph - ph * (y - y_lo) / (y_hi - y_lo)

    colors = ["#0969da", "#bf3989", "#1a7f37", "#9a6700", "#8250df"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg"{ident} class="chart" width="{width}" '
           f'height="{height}" role="img" aria-label="{html.escape(title)}">',
           f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fbfcfe"/>',
           f'<text x="{left}" y="16" font-size="13" font-weight="600">{html.escape(title)}</text>']
    for v in xt:
        out.append(f'<line x1="{sx(v):.1f}" y1="{top}" x2="{sx(v):.1f}" y2="{top + ph}" '
                   'stroke="#e6e9ef"/>')
        out.append(f'<text x="{sx(v):.1f}" y="{top + ph + 14}" font-size="10" '
                   f'text-anchor="middle">{_fmt(v)}</text>')
    for v in yt:
        out.append(f'<line x1="{left}" y1="{sy(v):.1f}" x2="{left + pw}" y2="{sy(v):.1f}" '
                   'stroke="#e6e9ef"/>')
        out.append(f'<text x="{left - 4}" y="{sy(v) + 3:.1f}" font-size="10" '
                   f'text-anchor="end">{_fmt(v)}</text>')
    out.append(f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" '
               'stroke="#57606a"/>')
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}" stroke="#57606a"/>')
    out.append(f'<text x="{left + pw / 2:.1f}" y="{height - 6}" font-size="11" '
               f'text-anchor="middle">{html.escape(x_label)}</text>')
    out.append(f'<text x="12" y="{top + ph / 2:.1f}" font-size="11" text-anchor="middle" '
               f'transform="rotate(-90 12 {top + ph / 2:.1f})">{html.escape(y_label)}</text>')
    lx = left + pw
    for k, (name, (xs, ys)) in enumerate(series.items()):
        c = colors[k % len(colors)]
        p = [(sx(x), sy(y)) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
        if not p:
            continue
        if len(p) == 1:
            out.append(f'<circle cx="{p[0][0]:.1f}" cy="{p[0][1]:.1f}" r="4" fill="{c}"/>')
        else:
            out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.6" points="'
                       + " ".join(f"{a:.1f},{b:.1f}" for a, b in p) + '"/>')
        out.append(f'<text x="{lx}" y="16" dx="{-130 * (len(series) - 1 - k)}" '
                   f'font-size="11" text-anchor="end" fill="{c}">&#9632; '
                   f'{html.escape(name)}</text>')
    out.append("</svg>")
    return "".join(out)


def legend_html(phases) -> str:
    """A legend of phase colours (HTML, wraps with the page's width)."""
    items = "".join(
        f'<span class="lg"><i style="background:{phase_color(p)}"></i>{html.escape(p)}</span>'
        for p in phases)
    return (f'<div class="legend">{items}<span class="lg"><i class="wait"></i>wait for a '
            'block</span><span class="lg"><i class="send"></i>block in transit (thin row)'
            '</span></div>')


def timeline_svg(timelines, cells, *, width: int = 1300, lane_h: int = 26,
                 svg_id: str = "timeline") -> str:
    """Inline SVG of recorded steps side by side: one lane per grid cell, a bar per
    kernel (colour: its phase), hatched bars for waits, a thin row under each lane for
    blocks in transit; a time axis in milliseconds. ``cells``: ``[((i, j), worker)]``.
    Every bar carries a ``<title>`` (layer, phase, what, milliseconds)."""
    if not timelines:
        return '<p class="muted" id="%s">No step recorded yet.</p>' % html.escape(svg_id)
    left, right, top = 150, 16, 30
    gap = 0.04  # share of the axis between two steps
    span = sum(max(tl.seconds, 1e-6) for tl in timelines)
    total = span * (1 + gap * (len(timelines) - 1))
    pw = width - left - right
    sub = 6  # the thin row of blocks in transit
    height = top + len(cells) * (lane_h + sub + 6) + 40
    lane_of = {cell: n for n, (cell, _) in enumerate(cells)}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" id="{html.escape(svg_id)}" width="{width}" '
           f'height="{height}" role="img" aria-label="per-cell timeline of recorded steps">',
           '<defs><pattern id="hatch" width="5" height="5" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="5" height="5" fill="#ffffff"/>'
           '<line x1="0" y1="0" x2="0" y2="5" stroke="#6e7781" stroke-width="2"/></pattern>'
           '</defs>',
           f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fbfcfe"/>']
    for n, (cell, worker) in enumerate(cells):
        y = top + n * (lane_h + sub + 6)
        out.append(f'<text x="4" y="{y + lane_h / 2 + 4:.1f}" font-size="11">cell '
                   f'({cell[0]}, {cell[1]})</text>')
        out.append(f'<text x="4" y="{y + lane_h + 4:.1f}" font-size="8" fill="#57606a">'
                   f'{html.escape(str(worker))[-22:]}</text>')
    scale = pw / total
    x0 = left
    axis_y = top + len(cells) * (lane_h + sub + 6) + 4
    for tl in timelines:
        dur = max(tl.seconds, 1e-6)
        out.append(f'<text x="{x0:.1f}" y="{top - 10}" font-size="11" font-weight="600">step '
                   f'{tl.step} ({1e3 * dur:.1f} ms)</text>')
        out.append(f'<line x1="{x0:.1f}" y1="{top - 4}" x2="{x0:.1f}" y2="{axis_y}" '
                   'stroke="#d0d7de"/>')
        for t in nice_ticks(0, 1e3 * dur, 4):
            tx = x0 + t / 1e3 * scale
            out.append(f'<line x1="{tx:.1f}" y1="{axis_y}" x2="{tx:.1f}" y2="{axis_y + 4}" '
                       'stroke="#57606a"/>')
            out.append(f'<text x="{tx:.1f}" y="{axis_y + 15}" font-size="9" '
                       f'text-anchor="middle">{_fmt(t)}</text>')
        for b in tl.bars:
            if b.cell not in lane_of:
                continue
            y = top + lane_of[b.cell] * (lane_h + sub + 6)
            bx = x0 + b.start_s * scale
            bw = max(b.seconds * scale, 0.8)
            c = phase_color(b.phase)
            title = f"<title>{html.escape(b.label)}</title>"
            if b.kind == "compute":
                out.append(f'<rect class="bar" data-layer="{html.escape(b.layer)}" '
                           f'data-phase="{html.escape(b.phase)}" x="{bx:.2f}" y="{y}" '
                           f'width="{bw:.2f}" height="{lane_h}" fill="{c}">{title}</rect>')
            elif b.kind == "wait":
                out.append(f'<rect class="wait" data-layer="{html.escape(b.layer)}" '
                           f'data-phase="{html.escape(b.phase)}" x="{bx:.2f}" y="{y + 4}" '
                           f'width="{bw:.2f}" height="{lane_h - 8}" fill="url(#hatch)" '
                           f'stroke="{c}" stroke-width="1">{title}</rect>')
            else:  # a block in transit: the thin row under the lane
                out.append(f'<rect class="{b.kind}" x="{bx:.2f}" y="{y + lane_h + 1}" '
                           f'width="{bw:.2f}" height="{sub}" fill="{c}" opacity="0.7">'
                           f'{title}</rect>')
        x0 += dur * scale * (1 + gap)
    out.append(f'<text x="{left + pw / 2:.1f}" y="{height - 4}" font-size="11" '
               'text-anchor="middle">milliseconds from each step\'s start</text>')
    out.append("</svg>")
    return "".join(out)
