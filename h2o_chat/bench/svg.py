"""A line chart as an SVG file, by plain string formatting: one polyline per series, axes with
ticks and labels, a legend. For the figures that go into docs/ (a text file a reviewer can diff,
no plotting library needed to read or make it)."""

import math
from html import escape
from pathlib import Path

WIDTH, HEIGHT = 760, 440
LEFT, RIGHT, TOP, BOTTOM = 70, 230, 40, 60  # margins: the legend sits in the right one
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
          "#bcbd22", "#000000", "#aec7e8", "#98df8a", "#ff9896"]
REFERENCE = "#555555"  # a dashed reference line (the full cache)


def nice_ticks(low, high, count=5):
    """About `count` round tick values covering [low, high] (steps of 1, 2 or 5 times a power of ten)."""
    if high <= low:
        low, high = low - 1, high + 1
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(low / step) * step
    ticks, t = [], first
    while t <= high + step * 1e-9:
        ticks.append(round(t, 10))
        t += step
    if ticks[-1] < high:
        ticks.append(round(t, 10))
    return ticks


def line_chart(series, title, x_label, y_label, dashed=(), y_max=None):
    """The SVG text of a chart: `series` maps a label to its points [(x, y), ...] (drawn in x
    order, one polyline each, a dot at every point); labels in `dashed` are drawn dashed (a
    reference, e.g. the full cache). y_max: the axis ends there; a point above it is drawn on the
    top edge with its value written beside it, so one outlier does not flatten every other line."""
    points = [p for pts in series.values() for p in pts]
    if not points:
        raise ValueError("a chart needs at least one point")
    top = max(p[1] for p in points) if y_max is None else min(y_max, max(p[1] for p in points))
    xs, ys = nice_ticks(min(p[0] for p in points), max(p[0] for p in points)), \
        nice_ticks(min(p[1] for p in points), top)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x):
        return LEFT + (x - xs[0]) / (xs[-1] - xs[0]) * plot_w

    def sy(y):
        return TOP + plot_h - (min(y, ys[-1]) - ys[0]) / (ys[-1] - ys[0]) * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{LEFT + plot_w / 2:.1f}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>']
    for x in xs:  # vertical grid and x ticks
        out.append(f'<line x1="{sx(x):.1f}" y1="{TOP}" x2="{sx(x):.1f}" y2="{TOP + plot_h}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{sx(x):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{x:g}</text>')
    for y in ys:
        out.append(f'<line x1="{LEFT}" y1="{sy(y):.1f}" x2="{LEFT + plot_w}" y2="{sy(y):.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{LEFT - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>')
    out.append(f'<text class="x-label" x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 18}" text-anchor="middle">'
               f'{escape(x_label)}</text>')
    out.append(f'<text class="y-label" x="18" y="{TOP + plot_h / 2:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 18 {TOP + plot_h / 2:.1f})">{escape(y_label)}</text>')
    for i, (label, pts) in enumerate(series.items()):
        color, pts = REFERENCE if label in dashed else COLORS[i % len(COLORS)], sorted(pts)
        dash = ' stroke-dasharray="6 4"' if label in dashed else ""
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(f'<polyline data-series="{escape(label)}" points="{coords}" fill="none" stroke="{color}" '
                   f'stroke-width="2"{dash}/>')
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>' for x, y in pts]
        out += [f'<text x="{sx(x) + 5:.1f}" y="{sy(y) + 12:.1f}" fill="{color}">{y:g} (off the axis)</text>'
                for x, y in pts if y > ys[-1]]
        ly = TOP + 8 + 18 * i
        out.append(f'<line x1="{WIDTH - RIGHT + 14}" y1="{ly}" x2="{WIDTH - RIGHT + 38}" y2="{ly}" stroke="{color}" '
                   f'stroke-width="2"{dash}/>')
        out.append(f'<text x="{WIDTH - RIGHT + 44}" y="{ly + 4}">{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_chart(path, series, title, x_label, y_label, dashed=(), y_max=None):
    Path(path).write_text(line_chart(series, title, x_label, y_label, dashed, y_max), encoding="utf-8")
