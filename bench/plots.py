"""The report's PNG plots (matplotlib, Agg backend: no display needed).

- ratios.png: every figure's ratio on a log scale around 1 (the reference), a bar per
  figure coloured by bench, the previous run's ratio as a hollow marker;
- sweep-<bench>.png: for a bench whose results carry `size` and `series`, ours (one line
  per series) and the reference (one dashed line per reference) against the size, one
  panel per unit.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import defaultdict
from typing import TYPE_CHECKING

import matplotlib as mpl

mpl.use("Agg")
from matplotlib import pyplot as plt  # after choosing the backend
from matplotlib.patches import Rectangle
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from pathlib import Path

    from bench.report import Figure

DPI = 100
MIN_SWEEP_POINTS = 2
TAIL_LABEL = "tail latency: not compared between runs"


def ratio_chart(
    figures: Sequence[Figure], previous: Mapping[tuple[str, str], float], path: Path
) -> Path:
    """Bar per figure from 1 to its ratio (log scale), previous ratios as markers."""
    shown = [f for f in figures if f.ratio is not None]
    benches = list(dict.fromkeys(f.bench for f in shown))
    palette = [f"C{i}" for i in range(10)]  # matplotlib's default colour cycle
    colours = dict(zip(benches, itertools.cycle(palette), strict=False))
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.28 * max(len(shown), 1)))
    ys = range(len(shown))
    ratios = [f.ratio or 1.0 for f in shown]
    bars = ax.barh(
        list(ys),
        [r - 1 for r in ratios],
        left=1,
        color=[colours[f.bench] for f in shown],
        height=0.7,
    )
    for bar, figure in zip(bars, shown, strict=True):
        if figure.tolerance is None:  # not compared between runs: drawn faint
            bar.set_alpha(0.45)
            bar.set_hatch("//")
    for y, ratio in zip(ys, ratios, strict=True):  # the values, in a column right of the axes
        ax.text(
            1.01, y, f"{ratio:.3g}x", transform=ax.get_yaxis_transform(), va="center", fontsize=8
        )
    prior = [(y, previous[f.key]) for y, f in zip(ys, shown, strict=True) if f.key in previous]
    if prior:
        ax.scatter(
            [r for _, r in prior],
            [y for y, _ in prior],
            marker="o",
            facecolors="none",
            edgecolors="black",
            zorder=3,
            label="previous run",
        )
    if any(f.tolerance is None for f in shown):
        ax.add_patch(
            Rectangle((0, 0), 0, 0, facecolor="grey", alpha=0.45, hatch="//", label=TAIL_LABEL)
        )
    if prior or any(f.tolerance is None for f in shown):
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    values = ratios + [r for _, r in prior] + [1.0]
    low, high = min(values), max(values)
    ax.set_xlim(low / 1.6, high * 1.6)
    ax.axvline(1, color="black", linewidth=0.8)
    ax.set_yticks(list(ys), [f.label for f in shown], fontsize=8)
    for tick, figure in zip(ax.get_yticklabels(), shown, strict=True):
        tick.set_color(colours[figure.bench])
    ax.invert_yaxis()
    ax.set_xlabel("ratio ours / reference (latencies inverted): > 1 is better than the reference")
    ax.set_title("Every headline figure against its same-run reference")
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def sweep_charts(figures: Sequence[Figure], plots_dir: Path) -> list[Path]:
    """One PNG per bench with a size sweep of at least two sizes."""
    by_bench: dict[str, list[Figure]] = defaultdict(list)
    for figure in figures:
        if figure.size is not None and figure.series:
            by_bench[figure.bench].append(figure)
    written = []
    for bench, swept in by_bench.items():
        by_unit: dict[str, list[Figure]] = defaultdict(list)
        for figure in swept:
            by_unit[figure.unit].append(figure)
        panels = {
            unit: group
            for unit, group in by_unit.items()
            if len({f.size for f in group}) >= MIN_SWEEP_POINTS
        }
        if panels:
            path = plots_dir / f"sweep-{_slug(bench)}.png"
            _sweep_chart(bench, panels, path)
            written.append(path)
    return written


def _sweep_chart(bench: str, panels: Mapping[str, Sequence[Figure]], path: Path) -> None:
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, (unit, group) in zip(axes[0], panels.items(), strict=True):
        series: dict[str, dict[int, float]] = defaultdict(dict)
        references: dict[str, dict[int, float]] = defaultdict(dict)
        for figure in group:
            assert figure.size is not None  # noqa: S101 - sweep_charts kept sized ones only
            series[str(figure.series)][figure.size] = figure.ours
            references[figure.reference_name][figure.size] = figure.reference
        for name, points in series.items():
            sizes = sorted(points)
            ax.plot(sizes, [points[s] for s in sizes], marker="o", label=name)
        for name, points in references.items():
            sizes = sorted(points)
            ax.plot(
                sizes,
                [points[s] for s in sizes],
                marker="s",
                linestyle="--",
                color="black",
                alpha=0.7,
                label=f"reference: {name}",
            )
        sizes = sorted({s for points in series.values() for s in points})
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(sizes, [size_label(s) for s in sizes])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("message size")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{bench}: ours and the same-run reference against message size")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def size_label(size: int) -> str:
    """`512 B`, `4 KiB`, `1 MiB`, `1.5 MiB`."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            value = size / (1 << shift)
            return f"{value:g} {unit}" if math.isclose(value, round(value, 1)) else f"{size} B"
    return f"{size} B"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "bench"
