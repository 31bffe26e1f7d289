"""Log-log line plots as standalone SVG, without a plotting library.

Benchmarks run on GPU hosts with no package index, so the plot must come from the standard
library. Latency against batch spans decades on both axes: both are logarithmic, with ticks at
powers of 2 (a range of at most 2^12) or of 10 (wider).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from xml.sax.saxutils import escape

Point = tuple[float, float]

WIDTH, HEIGHT = 760, 480
LEFT, RIGHT, TOP, BOTTOM = 70, 190, 40, 60  # margins; the legend sits in the right one
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2")
DASHED_COLOUR = "#555555"
POWER_OF_2_SPAN = 4096  # widest max/min ratio labelled at powers of 2


def loglog_svg(
    series: dict[str, list[Point]],
    title: str,
    xlabel: str,
    ylabel: str,
    path: str | Path,
    dashed: Collection[str] | None = None,
) -> Path:
    """Write a log-log line plot of ``series`` (name -> (x, y) points) to ``path``.

    Points with a non-positive or non-finite coordinate are dropped (no place on a log axis).
    Series in ``dashed`` (default: those whose name contains "floor") are drawn grey and
    dashed, so a bound reads differently from a measurement.
    """
    dashed = {n for n in series if "floor" in n.lower()} if dashed is None else set(dashed)
    clean = {name: _plottable(points) for name, points in series.items()}
    xs = [x for pts in clean.values() for x, _ in pts]
    ys = [y for pts in clean.values() for _, y in pts]
    xr, yr = _log_range(xs), _log_range(ys)
    body = [_frame(title, xlabel, ylabel)]
    body += _axis_ticks(xr, yr)
    colours = iter(COLOURS * (1 + len(series) // len(COLOURS)))
    for index, (name, points) in enumerate(clean.items()):
        colour = DASHED_COLOUR if name in dashed else next(colours)
        body.append(_line(name, points, xr, yr, colour, name in dashed))
        body.append(_legend_entry(index, name, colour, name in dashed))
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">\n'
        + "\n".join(body)
        + "\n</svg>\n"
    )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(svg)
    return out


def _plottable(points: Sequence[Point]) -> list[Point]:
    good = [
        (float(x), float(y))
        for x, y in points
        if x is not None and y is not None and _positive(x) and _positive(y)
    ]
    return sorted(good)


def _positive(v: float) -> bool:
    return math.isfinite(v) and v > 0


def _log_range(values: list[float]) -> tuple[float, float]:
    """log10 bounds of the axis: the data padded out to the enclosing ticks."""
    if not values:
        return 0.0, 1.0
    lo, hi = min(values), max(values)
    ticks = ticks_for(lo, hi)
    lo, hi = min(lo, ticks[0]), max(hi, ticks[-1])
    if hi <= lo:
        lo, hi = lo / 2, hi * 2
    return math.log10(lo), math.log10(hi)


def ticks_for(lo: float, hi: float) -> list[float]:
    """Tick values covering [lo, hi]: powers of 2 for a narrow range, of 10 for a wide one."""
    base = 2 if hi / lo <= POWER_OF_2_SPAN else 10
    first = math.floor(math.log(lo, base) + 1e-9)
    last = math.ceil(math.log(hi, base) - 1e-9)
    return [float(base**e) for e in range(first, max(last, first + 1) + 1)]


def _px(value: float, axis: tuple[float, float], start: float, length: float) -> float:
    lo, hi = axis
    return start + (math.log10(value) - lo) / (hi - lo) * length


def _x(value: float, xr: tuple[float, float]) -> float:
    return _px(value, xr, LEFT, WIDTH - LEFT - RIGHT)


def _y(value: float, yr: tuple[float, float]) -> float:
    plot_h = HEIGHT - TOP - BOTTOM
    return TOP + plot_h - (_px(value, yr, 0, plot_h))


def _label(value: float) -> str:
    return f"{value:g}"


def _frame(title: str, xlabel: str, ylabel: str) -> str:
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    cy = TOP + plot_h / 2
    return "\n".join(
        [
            f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
            f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" '
            'stroke="black"/>',
            f'<text x="{LEFT + plot_w / 2}" y="{TOP - 14}" text-anchor="middle" '
            f'font-size="15">{escape(title)}</text>',
            f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 18}" text-anchor="middle">'
            f"{escape(xlabel)}</text>",
            f'<text x="18" y="{cy}" text-anchor="middle" transform="rotate(-90 18 {cy})">'
            f"{escape(ylabel)}</text>",
        ]
    )


def _axis_ticks(xr: tuple[float, float], yr: tuple[float, float]) -> list[str]:
    bottom, right = HEIGHT - BOTTOM, WIDTH - RIGHT
    xs = [
        f'<line class="xtick" x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{bottom}" '
        'stroke="#dddddd"/>'
        f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{_label(v)}</text>'
        for v, x in _ticks_inside(xr, _x, LEFT, right)
    ]
    ys = [
        f'<line class="ytick" x1="{LEFT}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" '
        'stroke="#dddddd"/>'
        f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_label(v)}</text>'
        for v, y in _ticks_inside(yr, _y, TOP, bottom)
    ]
    return xs + ys


def _ticks_inside(
    log_range: tuple[float, float],
    place: Callable[[float, tuple[float, float]], float],
    lo: float,
    hi: float,
) -> list[Point]:
    """(value, pixel) of an axis' ticks that fall within the frame's pixels ``lo..hi``, with
    half a pixel's slack so that a tick on the frame's edge survives rounding."""
    placed = ((v, place(v, log_range)) for v in ticks_for(10 ** log_range[0], 10 ** log_range[1]))
    return [(v, p) for v, p in placed if lo - 0.5 <= p <= hi + 0.5]


def _line(
    name: str,
    points: list[Point],
    xr: tuple[float, float],
    yr: tuple[float, float],
    colour: str,
    dashed: bool,
) -> str:
    coords = [(_x(x, xr), _y(y, yr)) for x, y in points]
    dash = ' stroke-dasharray="6 4"' if dashed else ""
    parts = [
        f'<polyline data-series="{escape(name, {chr(34): "&quot;"})}" fill="none" '
        f'stroke="{colour}" stroke-width="2"{dash} '
        f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in coords)}"/>'
    ]
    if not dashed:
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>' for x, y in coords]
    return "\n".join(parts)


def _legend_entry(index: int, name: str, colour: str, dashed: bool) -> str:
    x, y = WIDTH - RIGHT + 14, TOP + 10 + 20 * index
    dash = ' stroke-dasharray="6 4"' if dashed else ""
    return (
        f'<line x1="{x}" y1="{y}" x2="{x + 24}" y2="{y}" stroke="{colour}" stroke-width="2"'
        f"{dash}/>"
        f'<text x="{x + 30}" y="{y + 4}">{escape(name)}</text>'
    )
