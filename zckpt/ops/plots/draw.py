"""The heatmap helpers of the matplotlib figures (inspect, series: ``draw_more``), with matplotlib's object
API on an Agg canvas (no pyplot, no global state, no display). The diff figure is drawn without matplotlib
(``diff_scene``) on the same colour conventions (``colours``).

Colour scale: logarithmic over the positive finite values of the grids that share it. A value of exactly 0
(nothing changed) is drawn white (below the scale), ``inf`` black (above it), a cell without a value grey
(no tensor there, or only a tensor missing on one side / reshaped, which its marker letter says). Drawn
arrays hold the grid's values except those two: 0 becomes ``vmin / 10`` and ``inf`` ``vmax * 10`` so that
the colour map's under/over colours show them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from zckpt.ops.plots.colours import INFINITE, NO_VALUE, UNCHANGED, log_range
from zckpt.ops.plots.names import short

FONT = 8


def new_figure(width: float, height: float, *, constrained: bool = False) -> Figure:
    fig = Figure(figsize=(min(width, 60), min(height, 80)), layout="constrained" if constrained else None)
    FigureCanvasAgg(fig)
    return fig


def log_norm(grids: Sequence[Sequence[Sequence[float]]]) -> LogNorm:
    """One log scale over the positive finite values of ``grids`` (any when there are none)."""
    return LogNorm(*log_range(grids))


def drawable(values: Sequence[Sequence[float]], norm: LogNorm) -> np.ndarray:
    """The array to draw: NaN stays (grey), 0 -> below the scale (white), inf -> above it (black)."""
    a = np.array(values, dtype=np.float64).reshape(len(values), -1)
    lo, hi = float(norm.vmin or 1e-3), float(norm.vmax or 1.0)
    a[a == 0] = lo / 10
    a[np.isposinf(a)] = hi * 10
    return a


def cmap(name: str) -> Any:
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad=NO_VALUE, under=UNCHANGED, over=INFINITE)


def heat(ax: Any, values: Sequence[Sequence[float]], norm: LogNorm, cmap_name: str) -> Any:
    """``imshow`` one grid (rows top down) on ``ax`` with the shared ``norm``."""
    return ax.imshow(drawable(values, norm), cmap=cmap(cmap_name), norm=norm, aspect="auto",
                     interpolation="nearest")  # fmt: skip


def ticks(ax: Any, xs: Sequence[str], ys: Sequence[str], *, rotate: int = 45, every: int = 1) -> None:
    """Tick labels on both axes; with ``every`` > 1 only each ``every``-th row is labelled, with 0 none (a
    panel beside one that has them)."""
    labels = [short(x, 28) for x in xs]
    ax.set_xticks(range(len(xs)), labels, rotation=rotate, ha="right" if rotate else "center", fontsize=FONT)
    if every == 0:
        ax.set_yticks([])
        return
    rows = list(range(0, len(ys), every))
    ax.set_yticks(rows, [short(ys[i], 28) for i in rows], fontsize=FONT)


def mark(ax: Any, grid: Sequence[Sequence[str]], drawn: np.ndarray, norm: LogNorm, cm: Any) -> None:
    """Write each cell's marker letters in it, black or white for contrast with the cell's colour."""
    for i, row in enumerate(grid):
        for j, text in enumerate(row):
            if text:
                v = drawn[i, j]
                rgb = cm(norm(v))[:3] if math.isfinite(v) else (0.8, 0.8, 0.8)
                light = 0.3 * rgb[0] + 0.6 * rgb[1] + 0.1 * rgb[2] > 0.5
                ax.text(j, i, text, ha="center", va="center", fontsize=FONT, fontweight="bold",
                        color="black" if light else "white")  # fmt: skip
