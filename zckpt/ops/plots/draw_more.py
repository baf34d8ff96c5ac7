"""Drawing the inspect figure (stored bytes by rank x kind as stacked bars, parameters per layer, bytes per
dtype) and the series figure (the whole model's update size per step over a layer x step heatmap), on
``draw``'s Agg canvas and colour conventions. Axes carry labels (``bytes``, ``params``, ``dtypes``,
``total``, ``series``); each bar container is labelled with its kind."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from zckpt.ops.plots.draw import FONT, heat, log_norm, mark, new_figure, ticks
from zckpt.ops.plots.grids import InspectPlot
from zckpt.ops.plots.names import short
from zckpt.ops.plots.series_grid import SeriesPlot

UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B"))
COUNTS = ((10**9, "B"), (10**6, "M"), (10**3, "K"), (1, ""))
KIND_LABELS = {"param": "params (masters)", "frozen": "frozen params", "buffer": "buffers"}
"""Legend names of the byte kinds; optimizer states keep their own names (``exp_avg``...)."""


def _unit(n: float, table: tuple[tuple[int, str], ...]) -> tuple[int, str]:
    return next(((s, u) for s, u in table if n >= s), table[-1])


def inspect_figure(d: InspectPlot) -> Figure:
    """Three panels: bytes per rank stacked by kind, parameters per layer/module, bytes per dtype."""
    w_bytes = max(3.5, 0.35 * len(d.ranks) + 2)
    w_params = max(4.0, 0.22 * len(d.groups) + 2)
    fig = new_figure(w_bytes + w_params + 3.5, 5.2, constrained=True)
    gs = fig.add_gridspec(1, 3, width_ratios=[w_bytes, w_params, 2.6])
    fig.suptitle(d.title, fontsize=9)
    _rank_bars(fig.add_subplot(gs[0, 0], label="bytes"), d)
    _param_bars(fig.add_subplot(gs[0, 1], label="params"), d)
    _dtype_bars(fig.add_subplot(gs[0, 2], label="dtypes"), d)
    return fig


def _rank_bars(ax: Any, d: InspectPlot) -> None:
    totals = [sum(col) for col in zip(*d.nbytes, strict=True)] if d.nbytes else []
    scale, unit = _unit(max(totals, default=0), UNITS)
    x = np.arange(len(d.ranks))
    bottom = np.zeros(len(d.ranks))
    colors = _colors(len(d.kinds))
    for k, (kind, row) in enumerate(zip(d.kinds, d.nbytes, strict=True)):
        h = np.array(row, dtype=np.float64) / scale
        ax.bar(x, h, bottom=bottom, color=colors[k], label=KIND_LABELS.get(kind, kind), width=0.75)
        bottom += h
    ranked = [t for t, r in zip(totals, d.ranks, strict=True) if r != "file"]
    balance = f"\nmax/mean over ranks {max(ranked) / (sum(ranked) / len(ranked)):.3f}" if ranked else ""
    ax.set_title(f"stored bytes by rank and kind{balance}", fontsize=9)
    ax.set_xticks(x, d.ranks, fontsize=FONT)
    ax.set_xlabel("rank", fontsize=FONT)
    ax.set_ylabel(unit, fontsize=FONT)
    ax.tick_params(axis="y", labelsize=FONT)
    if d.kinds:
        ncol = min(3, len(d.kinds))
        ax.legend(fontsize=FONT - 1, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=ncol,
                  frameon=False)  # fmt: skip


def _colors(n: int) -> list[Any]:
    import matplotlib

    cm = matplotlib.colormaps["tab20" if n > 10 else "tab10"]
    return [cm(i % cm.N) for i in range(n)]


def _param_bars(ax: Any, d: InspectPlot) -> None:
    scale, unit = _unit(max(d.params, default=0), COUNTS)
    x = np.arange(len(d.groups))
    colors = ["#3b6ea8" if i < d.layer_groups else "#c8793a" for i in range(len(d.groups))]
    ax.bar(x, np.array(d.params, dtype=np.float64) / scale, color=colors, width=0.8, label="params")
    ax.set_title(f"parameters per layer ({d.layer_groups} layers), then non-layer modules", fontsize=9)
    every = max(1, len(d.groups) // 50)
    labels = [short(g, 24) if i % every == 0 or i >= d.layer_groups else "" for i, g in enumerate(d.groups)]
    ax.set_xticks(x, labels, rotation=90, fontsize=FONT)
    ax.set_ylabel(f"parameters{f' ({unit})' if unit else ''}", fontsize=FONT)
    ax.tick_params(axis="y", labelsize=FONT)
    if 0 < d.layer_groups < len(d.groups):
        ax.axvline(d.layer_groups - 0.5, color="#888", lw=0.8, ls="--")


def _dtype_bars(ax: Any, d: InspectPlot) -> None:
    scale, unit = _unit(max((n for _, n in d.dtypes), default=0), UNITS)
    y = np.arange(len(d.dtypes))
    ax.barh(y, [n / scale for _, n in d.dtypes], color="#6a9f58", label="dtypes")
    ax.set_yticks(y, [t for t, _ in d.dtypes], fontsize=FONT)
    ax.invert_yaxis()
    ax.set_title("stored bytes per dtype", fontsize=9)
    ax.set_xlabel(unit, fontsize=FONT)
    ax.tick_params(axis="x", labelsize=FONT)


def series_figure(d: SeriesPlot) -> Figure:
    """Top: the whole model's ||A-B||/||B|| per pair; below: the layer x step heatmap of the same."""
    nrows, ncols = len(d.rows), len(d.steps)
    heat_h = max(2.5, 0.22 * nrows + 1.0)
    fig = new_figure(max(6.5, 0.32 * ncols + 4), heat_h + 2.6, constrained=True)
    gs = fig.add_gridspec(2, 1, height_ratios=[1.6, heat_h])
    fig.suptitle(d.title, fontsize=9)
    if d.notes:
        fig.supxlabel("   ".join(d.notes), fontsize=7)
    _totals(fig.add_subplot(gs[0, 0], label="total"), d)
    ax = fig.add_subplot(gs[1, 0], label="series")
    grid = [[math.nan if v is None else v for v in row] for row in d.values]
    norm = log_norm([grid])
    im = heat(ax, grid, norm, "viridis")
    ticks(ax, [str(s) for s in d.steps], d.rows, rotate=90 if ncols > 12 else 0, every=max(1, nrows // 60))
    ax.set_xlabel("step (newer checkpoint of each consecutive pair)", fontsize=FONT)
    ax.set_ylabel("layer", fontsize=FONT)
    if 0 < d.layer_rows < nrows:
        ax.axhline(d.layer_rows - 0.5, color="white", lw=1.5)
    marks = [[m + (" inf" if v is not None and math.isinf(v) else "") for m, v in zip(mr, vr, strict=True)]
             for mr, vr in zip(d.marks, d.values, strict=True)]  # fmt: skip
    mark(ax, marks, im.get_array().filled(np.nan), norm, im.get_cmap())
    fig.colorbar(im, ax=ax, extend="both", label="||B - A|| / ||A||").ax.tick_params(labelsize=FONT)
    return fig


def _totals(ax: Any, d: SeriesPlot) -> None:
    x = np.arange(len(d.steps))
    y = [v if math.isfinite(v) and v > 0 else math.nan for v in d.totals]
    ax.plot(x, y, marker="o", ms=3, lw=1.2, color="#3b6ea8", label="total")
    if any(math.isfinite(v) and v > 0 for v in y):
        ax.set_yscale("log")
    ax.set_xlim(-0.5, len(d.steps) - 0.5)
    ax.set_xticks(x, [""] * len(x))
    ax.set_title("whole model: ||B - A|| / ||A|| per consecutive pair", fontsize=9)
    ax.tick_params(axis="y", which="both", labelsize=FONT)
    ax.grid(True, axis="y", lw=0.3)
