"""Line charts as standalone SVG (no plotting library): the bench's GB/s against request size.

One chart: x on a log-2 axis (request sizes grow by factors), y linear from zero, one polyline
with labelled points per series, a legend. The file is plain SVG 1.1 any browser or viewer opens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from xml.sax.saxutils import escape

from kvbridge.base.errors import ConfigError

WIDTH, HEIGHT = 760, 420
LEFT, RIGHT, TOP, BOTTOM = 70, 230, 50, 60
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def _nice_max(value: float) -> float:
    """A round axis maximum at or above `value` (1, 2 or 5 times a power of ten)."""
    if value <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    return next(m * exp for m in (1, 2, 5, 10) if m * exp >= value)


def line_chart_svg(
    title: str,
    x_label: str,
    y_label: str,
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    log_y: bool = False,
) -> str:
    """The SVG text of a chart of `series` ({label: [(x, y), ...]}, x > 0); `log_y`: y on a log-10 axis (y > 0)."""
    if log_y:
        series = {label: [(x, y) for x, y in pts if y > 0] for label, pts in series.items()}
    points = [p for pts in series.values() for p in pts]
    if not points:
        raise ConfigError("nothing to plot: no measured points")
    xs = sorted({x for x, _ in points})
    if xs[0] <= 0:
        raise ConfigError(f"plot x values must be positive, got {xs[0]}")
    lo, hi = math.log2(xs[0]), math.log2(xs[-1])
    span = hi - lo or 1.0
    y_max = _nice_max(max(y for _, y in points))
    y_lo = math.floor(math.log10(min(y for _, y in points))) if log_y else 0
    y_hi = max(y_lo + 1, math.ceil(math.log10(y_max))) if log_y else 0
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (math.log2(x) - lo) / span * plot_w if hi > lo else LEFT + plot_w / 2

    def py(y: float) -> float:
        if log_y:
            return TOP + plot_h - (math.log10(y) - y_lo) / (y_hi - y_lo) * plot_h
        return TOP + plot_h - y / y_max * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{LEFT}" y="24" font-size="15" font-weight="bold">{escape(title)}</text>',
    ]
    ticks = [10.0**e for e in range(y_lo, y_hi + 1)] if log_y else [y_max * i / 5 for i in range(6)]
    for y in ticks:  # y grid and ticks
        out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 8}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    for x in xs:  # x ticks at the measured sizes
        out.append(f'<line x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{TOP}" y2="{TOP + plot_h}" stroke="#eee"/>')
        out.append(f'<text x="{px(x):.1f}" y="{TOP + plot_h + 18}" text-anchor="middle">{x:g}</text>')
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>')
    out.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 16}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(
        f'<text transform="translate(18 {TOP + plot_h / 2:.1f}) rotate(-90)" text-anchor="middle">'
        f"{escape(y_label)}</text>"
    )
    for i, (label, pts) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(pts))
        out.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for x, y in pts:
            out.append(
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{colour}"><title>'
                f"{escape(label)}: {y:.3g} at {x:g}</title></circle>"
            )
        ly = TOP + 10 + i * 20
        out.append(
            f'<line x1="{WIDTH - RIGHT + 15}" x2="{WIDTH - RIGHT + 40}" y1="{ly}" y2="{ly}" '
            f'stroke="{colour}" stroke-width="2"/>'
        )
        out.append(f'<text x="{WIDTH - RIGHT + 46}" y="{ly + 4}">{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def check_path(path: str | Path) -> None:
    """Refuse a file name the chart cannot be written as, before any measuring."""
    if Path(path).suffix.lower() not in (".svg", ".png"):
        raise ConfigError(f"--plot {path}: write .svg (or .png where matplotlib is installed)")


def write_chart(
    path: str | Path,
    title: str,
    x_label: str,
    y_label: str,
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    log_y: bool = False,
) -> Path:
    """Write the chart to `path`: SVG, or PNG when matplotlib happens to be installed."""
    check_path(path)
    path = Path(path)
    if path.suffix.lower() == ".svg":
        path.write_text(line_chart_svg(title, x_label, y_label, series, log_y=log_y))
        return path
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(f"--plot {path}: PNG needs matplotlib (pip install matplotlib); .svg needs nothing") from None
    fig, ax = plt.subplots(figsize=(WIDTH / 100, HEIGHT / 100))
    for label, pts in series.items():
        ax.plot(*zip(*sorted(pts)), marker="o", label=label)
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set(title=title, xlabel=x_label, ylabel=y_label, ylim=(None if log_y else 0, None))
    ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
