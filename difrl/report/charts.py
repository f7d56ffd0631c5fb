"""The report's curves as inline SVG (no JavaScript, no plotting library) and the numbers in its captions.

    from difrl.report.charts import chart_figure, fmt
    chart_figure(series)                      # '<figure class="curve"><svg class="chart" ...>...</figure>'
    fmt(0.123456)                             # '0.1235'
"""

from __future__ import annotations

import html
import math

from difrl.report.data import Series


def esc(s) -> str:
    """Text or an attribute value, HTML-escaped (quotes too)."""
    return html.escape(str(s), quote=True)


def fmt(v) -> str:
    """A table / caption number: integers as they are, floats to 4 decimals (4 significant digits when tiny or huge)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.4f}" if 1e-3 <= abs(v) < 1e5 else f"{v:.4g}"


def _nice_step(span: float, target: int) -> float:
    raw = span / max(target, 1)
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _ticks(lo: float, hi: float, target: int) -> tuple[float, float, list[float]]:
    if hi <= lo:
        pad = abs(lo) * 0.05 or 1.0
        lo, hi = lo - pad, hi + pad
    step = _nice_step(hi - lo, target)
    a, b = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    n = int(round((b - a) / step))
    return a, b, [a + i * step for i in range(n + 1)]


def _tick_label(v: float, step: float) -> str:
    if abs(v) < step * 1e-6:
        v = 0.0
    if step >= 1e5 or step < 1e-4:
        return f"{v:.3g}"
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    scaled = step * 10**decimals
    if abs(scaled - round(scaled)) > 1e-6:  # 2.5, 0.25: one more digit
        decimals += 1
    return f"{v:.{decimals}f}"


def svg_chart(s: Series, width: int = 420, height: int = 200) -> str:
    """One series as an inline SVG line chart (axes, ticks, optional band and markers with hover titles)."""
    return svg_lines([s], s.name, "iteration", width, height)


def svg_lines(series: list[Series], name: str, x_label: str = "iteration", width: int = 420, height: int = 200) -> str:
    """Series on shared axes as one inline SVG line chart (`difrl compare` overlays runs; one series is
    svg_chart). Each line keeps its color, its dash (Series.dash) and, with several series, its name in the
    hover titles and in the polyline's data-run attribute."""
    L, R, T, B = 58, 12, 10, 28
    many = len(series) > 1
    ys_all = [y for s in series for y in [*s.ys, *(s.band[0] + s.band[1] if s.band else [])]]
    xs_all = [x for s in series for x in s.xs]
    y0, y1, yt = _ticks(min(ys_all), max(ys_all), 4)
    xlo, xhi = min(xs_all), max(xs_all)
    if xhi == xlo:
        xlo, xhi = xlo - 1, xhi + 1
    x0, x1, xt = _ticks(xlo, xhi, 5)
    if all(float(x).is_integer() for x in xs_all):
        xt = [t for t in xt if float(t).is_integer()]
    pw, ph = width - L - R, height - T - B

    def px(x):
        return L + (x - x0) / (x1 - x0) * pw

    def py(y):
        return T + (y1 - y) / (y1 - y0) * ph

    ystep, xstep = yt[1] - yt[0] if len(yt) > 1 else 1.0, xt[1] - xt[0] if len(xt) > 1 else 1.0
    over = "iterations" if x_label == "iteration" else x_label
    extra = f' data-x="{esc(x_label)}" data-runs="{len(series)}"' if many else ""
    parts = [(f'<svg class="chart" data-series="{esc(name)}" data-points="{len(xs_all)}"{extra} '
              f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
              f'aria-label="{esc(name)} over {esc(over)}">'), f"<title>{esc(name)}</title>"]
    for t in yt:
        parts.append(f'<line class="grid" x1="{L}" x2="{L + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}"/>'
                     f'<text x="{L - 4}" y="{py(t) + 3:.1f}" text-anchor="end">{esc(_tick_label(t, ystep))}</text>')
    for t in xt:
        parts.append(f'<line class="axis" x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{T + ph}" y2="{T + ph + 4}"/>'
                     f'<text x="{px(t):.1f}" y="{T + ph + 15}" text-anchor="middle">{esc(_tick_label(t, xstep))}</text>')
    parts.append(f'<line class="axis" x1="{L}" x2="{L + pw}" y1="{T + ph}" y2="{T + ph}"/>'
                 f'<line class="axis" x1="{L}" x2="{L}" y1="{T}" y2="{T + ph}"/>'
                 f'<text x="{L + pw}" y="{height - 2}" text-anchor="end">{esc(x_label)}</text>')
    for s in series:
        if s.band:
            up = [f"{px(x):.1f},{py(y):.1f}" for x, y in zip(s.xs, s.band[1])]
            down = [f"{px(x):.1f},{py(y):.1f}" for x, y in zip(reversed(s.xs), reversed(s.band[0]))]
            parts.append(f'<polygon class="band" fill="{s.color}" points="{" ".join(up + down)}"/>')
    for s in series:
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(s.xs, s.ys))
        run = f' data-run="{esc(s.name)}"' if many else ""
        dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
        parts.append(f'<polyline class="line" stroke="{s.color}"{dash}{run} points="{pts}"/>')
        if s.markers or len(s.xs) <= 60:
            r = 3.5 if s.markers else 2
            who = f"{s.name}, " if many else ""
            for x, y in zip(s.xs, s.ys):
                parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="{r}" fill="{s.color}">'
                             f"<title>{esc(who)}{esc(x_label)} {esc(fmt(x))}: {esc(fmt(y))}</title></circle>")
    parts.append("</svg>")
    return "".join(parts)


def chart_figure(s: Series) -> str:
    last = s.ys[-1]
    cap = f"<b>{esc(s.name)}</b>: last {esc(fmt(last))}"
    if len(s.ys) > 1:
        cap += f" (first {esc(fmt(s.ys[0]))}, min {esc(fmt(min(s.ys)))}, max {esc(fmt(max(s.ys)))}; {len(s.ys)} points)"
    if s.band:
        cap += "; band: ± reward_std"
    return f'<figure class="curve">{svg_chart(s)}<figcaption>{cap}</figcaption></figure>'


def constants_line(constant: dict, what: str) -> str:
    if not constant:
        return ""
    items = ", ".join(f"<code>{esc(k)}</code> {esc(fmt(v))}" for k, v in constant.items())
    return f'<p class="small">{esc(what)}: {items}</p>'
