"""Writing benchmark results: atomic JSON / markdown files, markdown tables, matplotlib PNG plots."""
from __future__ import annotations

import math
import statistics
from contextlib import contextmanager
from pathlib import Path

from mamba_draft.io import atomic_path, write_json, write_text  # noqa: F401  (bench and demo write through these)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1, as Spec-Bench); std is 0 for a single value."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def fmt_mean_std(values: list[float], digits: int = 2) -> str:
    mean, std = mean_std(values)
    if math.isnan(mean):
        return "–"
    return f"{mean:.{digits}f}" if len(values) < 2 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub-flavoured markdown table; cells are str()-ed and pipes escaped."""
    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


@contextmanager
def figure(path: str | Path, figsize: tuple[float, float], title: str, ylabel: str, baseline: float | None):
    """A new matplotlib axes (non-interactive backend) to draw on; then its title, y label and an optional dashed
    horizontal reference line, and the PNG, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    try:
        yield ax
        if baseline is not None:
            ax.axhline(baseline, color="grey", linestyle="--", linewidth=1)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)


def bar_plot(path: str | Path, labels: list[str], values: list[list[float]], title: str, ylabel: str,
             baseline: float | None = None, lossy: list[bool] | None = None) -> None:
    """One bar per label with mean ± std error bars over its repeat values; lossy methods in orange."""
    stats = [mean_std(v) for v in values]
    with figure(path, (max(4.0, 0.9 * len(labels) + 1.5), 3.6), title, ylabel, baseline) as ax:
        colors = ["#DD8452" if flag else "#4C72B0" for flag in (lossy or [False] * len(labels))]
        ax.bar(range(len(labels)), [m for m, _ in stats], yerr=[s for _, s in stats], capsize=3, color=colors)
        if lossy and any(lossy):
            from matplotlib.patches import Patch

            ax.legend(handles=[Patch(color="#4C72B0", label="lossless"), Patch(color="#DD8452", label="lossy")])
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
        ax.grid(axis="y", alpha=0.3)


def line_plot(path: str | Path, x: list[float], series: dict[str, list[float]], title: str, xlabel: str,
              ylabel: str, baseline: float | None = None) -> None:
    """Several named series over the same x values, on a log-2 x axis (e.g. drafter latency vs context
    length, speedup vs batch size)."""
    with figure(path, (5.0, 3.6), title, ylabel, baseline) as ax:
        for name, ys in series.items():
            ax.plot(x, ys, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(int(v)) for v in x])
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend()
