"""Figures of an evaluation: the speed–quality trade-off, per-position heatmaps, sample grids, simulated
vs real acceptance per depth (PNG).

Figures are built with matplotlib's object API, not pyplot, and rendered by Agg: no display, no global
backend switch and no figure registry, so plotting is safe from servers and training callbacks.
"""

from __future__ import annotations

import logging
import os
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from vdtrain.eval.acceptance import AcceptanceReport
from vdtrain.eval.runner import EvalResult
from vdtrain.eval.table import EvalRow, quality_names

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)

MAP_TITLES = {"accepted_length": "accepted length", "tree_depth": "tree depth"}


def _matplotlib() -> tuple[Any, type[Figure]]:
    """matplotlib's colormaps and Figure, imported when a figure is drawn: ``benchmarks.step_cost`` imports
    this module (through ``vdtrain.evaluate``) on GPU machines that have no matplotlib."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    return colormaps, Figure


def first_quality_metric(rows: list[EvalRow]) -> str | None:
    """The first metric with a measured value in some row (metrics are in table order)."""
    for name in quality_names(rows):
        if any(r.quality.get(name) is not None and r.quality[name].value is not None for r in rows):
            return name
    return None


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def plot_tradeoff(rows: list[EvalRow], path: str | os.PathLike[str]) -> Path | None:
    """Quality against step compression S (left) and latency speedup (right), a labelled point per
    (method, T). None (and no file) when no quality metric was measured."""
    colormaps, Figure = _matplotlib()
    metric = first_quality_metric(rows)
    if metric is None:
        log.info("no speed-quality plot: no quality metric was measured")
        return None
    scored = [r for r in rows if r.quality.get(metric) is not None and r.quality[metric].value is not None]
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    methods = list(dict.fromkeys(r.method for r in scored))
    colours = {m: colormaps["tab10"](i % 10) for i, m in enumerate(methods)}
    panels = [("S", "step compression S"), ("speedup", "latency speedup (×)")]
    for ax, (field, label) in zip(axes, panels, strict=True):
        points = [
            (getattr(r, field), r.quality[metric].value, f"{r.method} T={r.temperature:g}") for r in scored
        ]
        for r, (x, y, _) in zip(scored, points, strict=True):
            ax.scatter(x, y, color=colours[r.method], marker="o" if r.temperature == 0 else "s")
        for x, y, text in label_groups(points):
            ax.annotate(text, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points", va="bottom")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(metric)
    fig.suptitle(f"speed vs {metric} (circles: T = 0, squares: T > 0)")
    return _save(fig, Path(path))


def label_groups(
    points: list[tuple[float, float, str]], near: float = 0.02
) -> list[tuple[float, float, str]]:
    """One label per group of points closer than ``near`` of the axes' spans (AR and the exact methods at
    T = 0 share a quality; rows can share an S): their names stacked at the group's first point, where
    separate labels would print over each other."""
    if not points:
        return []
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    span_x, span_y = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    groups: list[list[tuple[float, float, str]]] = []
    for point in points:
        for group in groups:
            x, y, _ = group[0]
            if abs(point[0] - x) <= near * span_x and abs(point[1] - y) <= near * span_y:
                group.append(point)
                break
        else:
            groups.append([point])
    return [(g[0][0], g[0][1], "\n".join(p[2] for p in g)) for g in groups]


def plot_position_maps(
    maps: dict[tuple[str, float], dict[str, np.ndarray]], temperature: float, path: str | os.PathLike[str]
) -> Path | None:
    """Accepted length and tree depth per image position (the step's root), averaged over prompts: a row
    per method at ``temperature`` (AR left out: it drafts nothing), one colour scale per column; cells
    where no step was rooted are blank. None when no speculative method ran at ``temperature``."""
    colormaps, Figure = _matplotlib()
    keys = [k for k in maps if k[1] == temperature and k[0] != "ar"]
    if not keys:
        return None
    names = list(MAP_TITLES)
    fig = Figure(figsize=(4 * len(names), 3.2 * len(keys)), layout="constrained")
    axes = fig.subplots(len(keys), len(names), squeeze=False)
    for col, name in enumerate(names):
        stack = np.stack([maps[k][name] for k in keys])
        finite = stack[np.isfinite(stack)]
        vmin, vmax = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)
        cmap = colormaps["viridis"].with_extremes(bad="white")
        for row, key in enumerate(keys):
            ax = axes[row, col]
            image = ax.imshow(np.ma.masked_invalid(maps[key][name]), cmap=cmap, vmin=vmin, vmax=vmax)
            ax.set_title(f"{key[0]} T={temperature:g}: {MAP_TITLES[name]}", fontsize=9)
            ax.set_xlabel("column")
            ax.set_ylabel("row")
            fig.colorbar(image, ax=ax, shrink=0.8)
    return _save(fig, Path(path))


def plot_samples(
    result: EvalResult, temperature: float, path: str | os.PathLike[str], num_prompts: int = 4
) -> Path | None:
    """The first ``num_prompts`` prompts (rows) as AR and every method decoded them at ``temperature``
    with the same seeds (columns), each row's caption underneath. None when nothing ran at it."""
    Figure = _matplotlib()[1]
    methods = [m for m, t in result.images if t == temperature]
    n = min(num_prompts, len(result.prompts))
    if not methods or n == 0:
        return None
    fig = Figure(figsize=(1.9 * len(methods), 2.5 * n))
    grid = fig.add_gridspec(2 * n, len(methods), height_ratios=[1.0, 0.3] * n, hspace=0.05, wspace=0.05)
    for row in range(n):
        for col, method in enumerate(methods):
            ax = fig.add_subplot(grid[2 * row, col])
            ax.imshow(result.images[(method, temperature)][row], interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(f"{method} T={temperature:g}", fontsize=9)
        caption = fig.add_subplot(grid[2 * row + 1, :])
        caption.axis("off")
        width = 30 * len(methods)  # characters of 7-point text across the row
        text = textwrap.shorten(result.prompts[row], 2 * width, placeholder=" …")
        caption.text(0.5, 0.9, textwrap.fill(text, width), ha="center", va="top", fontsize=7)
    return _save(fig, Path(path))


def write_plots(result: EvalResult, folder: str | os.PathLike[str], num_samples: int = 4) -> list[Path]:
    """``tradeoff.png``, and per temperature ``position_maps_T<t>.png`` and ``samples_T<t>.png``."""
    out = Path(folder)
    temperatures = list(dict.fromkeys(t for _, t in result.images))
    paths = [plot_tradeoff(result.rows, out / "tradeoff.png")]
    for t in temperatures:
        paths.append(plot_position_maps(result.position_maps, t, out / f"position_maps_T{t:g}.png"))
        paths.append(plot_samples(result, t, out / f"samples_T{t:g}.png", num_samples))
    return [p for p in paths if p is not None]


def plot_acceptance(reports: list[AcceptanceReport], path: str | os.PathLike[str]) -> Path | None:
    """P_sim(≥d) (teacher-forced chain) and P_real(≥d) (real decode) against draft depth d, a panel per
    temperature, τ_sim and τ_real in the title. None when there is no report."""
    Figure = _matplotlib()[1]
    if not reports:
        return None
    fig = Figure(figsize=(4.5 * len(reports), 3.6), layout="constrained")
    axes = fig.subplots(1, len(reports), sharey=True, squeeze=False)[0]
    for ax, r in zip(axes, reports, strict=True):
        depths = [d.depth for d in r.depths]
        ax.plot(depths, [d.p_sim for d in r.depths], "o--", label="simulated P_sim(≥d)")
        ax.plot(depths, [d.p_real for d in r.depths], "s-", label="real P_real(≥d)")
        title = f"{r.method} T={r.temperature:g}: τ_sim {r.tau_sim:.2f}, τ_real {r.tau_real:.2f}"
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("draft depth d")
        ax.set_xticks(depths)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("P(accept ≥ d drafts)")
    axes[0].legend(fontsize=8)
    return _save(fig, Path(path))
