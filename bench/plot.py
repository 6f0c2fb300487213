"""The PNG beside each benchmark's table: charts described as plain data, drawn with matplotlib.

The benchmarks build `LineChart`s and `BarChart`s from their own results (no matplotlib needed
there); `write_png` draws them, one panel each. matplotlib is an optional extra
(`pip install 'graphar[plot]'`), imported only here and only when a plot is written: without it
the tables are written all the same and `write_png` says how to get the plot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Cell = float | str
INSTALL_HINT = "pip install 'graphar[plot]' (or pip install matplotlib)"
_DASHES = ("-", "--", ":", "-.")


@dataclass(frozen=True)
class Line:
    """One line of a LineChart: (x, y) points; lines with one colour_key (dash_key) share a colour (dash)."""

    label: str
    points: Sequence[tuple[float, float]]
    colour_key: str = ""
    dash_key: str = ""


@dataclass(frozen=True)
class LineChart:
    title: str
    xlabel: str
    ylabel: str
    lines: Sequence[Line]
    xticks: Sequence[tuple[float, str]] = ()  # (position, label); empty: matplotlib's own
    log: bool = True  # log-log


@dataclass(frozen=True)
class BarChart:
    """Grouped bars: one group per x label, one bar per series; a cell that is not a float is no bar."""

    title: str
    ylabel: str
    groups: Sequence[str]
    bars: Mapping[str, Sequence[Cell]] = field(default_factory=dict)
    log: bool = False


Chart = LineChart | BarChart


def points(xs: Sequence[float], cells: Sequence[Cell]) -> list[tuple[float, float]]:
    """(x, y) for the cells that are numbers: "-", "n/a", "err" and the like leave a gap."""
    return [(x, c) for x, c in zip(xs, cells) if isinstance(c, float)]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def write_png(charts: Sequence[Chart], path: Path, title: str) -> str:
    """Draw the charts, one panel each, into `path`; returns the line to print about it."""
    try:
        plt = _pyplot()
    except ImportError:
        return f"plot not written: matplotlib is not installed ({INSTALL_HINT})"
    fig, axes = plt.subplots(len(charts), 1, figsize=(11, 4.8 * len(charts)), squeeze=False)
    for ax, chart in zip(axes[:, 0], charts):
        (_draw_lines if isinstance(chart, LineChart) else _draw_bars)(ax, chart)
    fig.suptitle(title)
    fig.tight_layout()
    write_whole(path, lambda partial: fig.savefig(partial, dpi=110, format="png"))
    plt.close(fig)
    return f"plot written to {path}"


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """write() a file beside `path`, then rename it over `path`: a run killed meanwhile leaves the
    previous file whole, never part of one (the reports are rewritten after every unit)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    write(partial)
    partial.replace(path)


def _style_map(keys: Sequence[str], values: Sequence[Any]) -> dict[str, Any]:
    return {key: values[i % len(values)] for i, key in enumerate(dict.fromkeys(keys))}


def _draw_lines(ax: Any, chart: LineChart) -> None:
    palette = [f"C{i}" for i in range(10)]
    colours = _style_map([line.colour_key or line.label for line in chart.lines], palette)
    dashes = _style_map([line.dash_key for line in chart.lines], _DASHES)
    for line in chart.lines:
        if not line.points:
            continue  # nothing measured (n/a, refused): the legend would only mislead
        xs, ys = zip(*line.points)
        ax.plot(
            xs,
            ys,
            marker="o",
            markersize=3,
            label=line.label,
            color=colours[line.colour_key or line.label],
            linestyle=dashes[line.dash_key],
        )
    if chart.log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    if chart.xticks:
        ax.set_xticks([x for x, _ in chart.xticks], [label for _, label in chart.xticks], rotation=45)
        ax.minorticks_off()
    _finish(ax, chart.title, chart.xlabel, chart.ylabel)


def _draw_bars(ax: Any, chart: BarChart) -> None:
    width = 0.8 / max(len(chart.bars), 1)
    for i, (label, cells) in enumerate(chart.bars.items()):
        xs = [g + (i - (len(chart.bars) - 1) / 2) * width for g in range(len(chart.groups))]
        bar_points = points(xs, cells)
        if bar_points:
            ax.bar(*zip(*bar_points), width=width, label=label)
    ax.set_xticks(range(len(chart.groups)), chart.groups)
    if chart.log:
        ax.set_yscale("log")
    _finish(ax, chart.title, "", chart.ylabel)


def _finish(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
