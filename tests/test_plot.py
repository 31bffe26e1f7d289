"""The dependency-free log-log SVG plot: valid XML, points where a log scale puts them."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path

from kdagen.plot import loglog_svg, ticks_for

SVG = "{http://www.w3.org/2000/svg}"


def _polylines(path: Path) -> dict[str, list[tuple[float, float]]]:
    root = ET.parse(path).getroot()
    lines = {}
    for line in root.iter(f"{SVG}polyline"):
        points = [tuple(map(float, p.split(","))) for p in line.get("points", "").split()]
        lines[line.get("data-series")] = (points, line.get("stroke-dasharray"))
    return lines  # type: ignore[return-value]


def test_plot_is_xml_with_monotone_points_and_a_dashed_floor(tmp_path: Path) -> None:
    batches = [1, 4, 16, 64, 256, 512]
    series = {
        "kdagen (best variant)": [(b, 5.0 + 0.15 * b) for b in batches],
        "flashinfer": [(b, 7.0 + 0.18 * b) for b in reversed(batches)],  # order does not matter
        "HBM floor": [(b, 0.145 * b) for b in batches],
    }
    path = loglog_svg(series, "h12-q8 <verify>", "batch", "us", tmp_path / "sub" / "p.svg")
    assert path.exists()
    lines = _polylines(path)
    assert set(lines) == set(series)
    for name, (points, dash) in lines.items():
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        assert len(points) == len(batches)
        assert xs == sorted(xs) and len(set(xs)) == len(xs), name  # left to right
        assert ys == sorted(ys, reverse=True), name  # rising latency: up the page
        assert (dash is not None) == (name == "HBM floor")
    # equal ratios in x are equal distances on a log axis (1 -> 4 -> 16 -> 64)
    xs = [p[0] for p in lines["HBM floor"][0]]
    assert math.isclose(xs[1] - xs[0], xs[2] - xs[1], rel_tol=1e-2)
    text = path.read_text()
    assert "h12-q8 &lt;verify&gt;" in text and "flashinfer" in text


def test_points_a_log_axis_cannot_hold_are_dropped(tmp_path: Path) -> None:
    series = {"a": [(1, 2.0), (2, 0.0), (0, 3.0), (4, float("nan")), (8, 5.0)], "empty": []}
    lines = _polylines(loglog_svg(series, "t", "x", "y", tmp_path / "p.svg"))
    assert len(lines["a"][0]) == 2
    assert lines["empty"][0] == []


def test_ticks_are_powers_of_two_or_ten() -> None:
    assert ticks_for(1, 512) == [2.0**e for e in range(10)]
    assert ticks_for(3, 700) == [2.0**e for e in range(1, 11)]
    assert ticks_for(0.15, 1071.39) == [0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0]
    assert ticks_for(512, 512) == [512.0, 1024.0]
