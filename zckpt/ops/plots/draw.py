"""Drawing the diff figure, and the heatmap helpers the other figures share, with matplotlib's object API on
an Agg canvas (no pyplot, no global state, no display).

Colour scale: logarithmic over the positive finite values of the grids that share it. A value of exactly 0
(nothing changed) is drawn white (below the scale), ``inf`` black (above it), a cell without a value grey
(no tensor there, or only a tensor missing on one side / reshaped, which its marker letter says). Drawn
arrays hold the grid's values except those two: 0 becomes ``vmin / 10`` and ``inf`` ``vmax * 10`` so that
the colour map's under/over colours show them; every axis carries a label (``ax.get_label()``) naming it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from zckpt.ops.plots.grids import MARKS, DiffPlot, Heat

NO_VALUE = "#d0d0d0"
UNCHANGED = "#ffffff"
INFINITE = "#000000"
FONT = 8
MAX_LABEL = 48


def new_figure(width: float, height: float, *, constrained: bool = False) -> Figure:
    fig = Figure(figsize=(min(width, 60), min(height, 80)), layout="constrained" if constrained else None)
    FigureCanvasAgg(fig)
    return fig


def short(text: str, n: int = MAX_LABEL) -> str:
    """Cut long names from the left (their end says most: ``...layers.31.mlp.down_proj.weight``)."""
    return text if len(text) <= n else "…" + text[-(n - 1) :]


def log_norm(grids: Sequence[Sequence[Sequence[float]]]) -> LogNorm:
    """One log scale over the positive finite values of ``grids`` (any when there are none)."""
    vals = [v for g in grids for row in g for v in row if math.isfinite(v) and v > 0]
    if not vals:
        return LogNorm(1e-3, 1.0)
    lo, hi = min(vals), max(vals)
    return LogNorm(lo if lo < hi else hi / 10, hi)


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


def _marks_of(h: Heat, infinite: bool) -> list[list[str]]:
    out = []
    for row in h.cells:
        line = []
        for c in row:
            text = "" if c is None else c.marks
            if infinite and c is not None and c.rel is not None and math.isinf(c.rel):
                text = (text + " inf").strip()
            line.append(text)
        out.append(line)
    return out


LEGEND = ("white: unchanged   grey: no tensor / no value   black: inf   "
          + "   ".join(f"{k}: {v}" for k, v in MARKS.items()))  # fmt: skip
CHAR = 0.062
"""Inches per character of a tick label at ``FONT`` points (DejaVu Sans, generous)."""


class _Layout:
    """Axes placed in inches, top-down (no constrained layout: its repeated text measuring would cost more
    than the rest of the figure). ``rect`` turns an inch box into figure fractions."""

    def __init__(self, d: DiffPlot) -> None:
        rows, cols, mods = d.layers.rows, d.layers.cols, d.strip.cols
        self.ylab = 0.45 + CHAR * max((len(r) for r in (*rows, "non-layer")), default=4)
        self.heat_w = max(1.8, 0.36 * len(cols), 0.24 * len(mods))
        self.bar_lab = 0.2 + CHAR * min(MAX_LABEL, max((len(b.key) for b in d.top), default=8))
        self.heat_h = max(1.0, 0.2 * len(rows)) if rows else 1.0
        self.xlab = 0.45 + 0.72 * CHAR * max((len(c) for c in cols), default=4)
        self.strip_h = 0.32 if mods else 0.0
        self.strip_lab = (0.15 + CHAR * min(28, max(len(m) for m in mods))) if mods else 0.0
        self.top = 0.75
        stack = 0.3 + self.heat_h + self.xlab + self.strip_h + self.strip_lab
        self.bars_h = max(0.22 * len(d.top) + 0.1, 1.0)
        self.height = self.top + max(stack, 0.3 + self.bars_h + 0.5) + 0.45
        self.panel = self.ylab + self.heat_w + 0.95  # heat + its colorbar and labels
        self.width = 2 * self.panel + self.bar_lab + 3.6

    def rect(self, x: float, y_top: float, w: float, h: float) -> tuple[float, float, float, float]:
        """``[left, bottom, width, height]`` in figure fractions of an inch box ``y_top`` from the top."""
        return (x / self.width, 1 - (y_top + h) / self.height, w / self.width, h / self.height)


def diff_figure(d: DiffPlot) -> Figure:
    """Layer x role heatmaps of ||B-A||/||A|| and 1-cosine, the non-layer strip under each, top-N bars."""
    lay = _Layout(d)
    fig = new_figure(lay.width, lay.height)
    fig.text(0.5, 1 - 0.12 / lay.height, f"{d.title}\n{d.summary}", ha="center", va="top", fontsize=9)
    fig.text(0.5, 0.12 / lay.height, "   ".join([LEGEND, *d.notes]), ha="center", va="bottom", fontsize=7)
    rel, cos = d.layers.values("rel"), d.layers.values("1-cos")
    srel, scos = d.strip.values("rel"), d.strip.values("1-cos")
    every = max(1, len(d.layers.rows) // 60)
    y_heat = lay.top + 0.3
    y_strip = y_heat + lay.heat_h + lay.xlab
    for col, (what, grid, sgrid, name, title) in enumerate((
        ("rel", rel, srel, "viridis", "||B - A|| / ||A||"),
        ("cos", cos, scos, "plasma", "1 - cosine(A, B)"),
    )):  # fmt: skip
        x = col * lay.panel + lay.ylab
        norm = log_norm([grid, sgrid])
        if not any(v > 0 for g in (grid, sgrid) for row in g for v in row):  # NaN > 0 is False
            title += "\n(all white: nothing changed)"
        ax = fig.add_axes(lay.rect(x, y_heat, lay.heat_w, lay.heat_h), label=what)
        _heat_panel(ax, d.layers, grid, norm, name, title, every if col == 0 else 0, infinite=what == "rel")
        if d.strip.cols:
            sx = fig.add_axes(lay.rect(x, y_strip, lay.heat_w, lay.strip_h), label=f"strip_{what}")
            _strip_panel(sx, d.strip, sgrid, norm, name, infinite=what == "rel")
        images = [a.images[0] for a in fig.axes[-2:] if a.images]
        if images:
            span = (y_strip + lay.strip_h if d.strip.cols else y_heat + lay.heat_h) - y_heat
            cax = fig.add_axes(lay.rect(x + lay.heat_w + 0.12, y_heat, 0.13, span), label=f"colorbar_{what}")
            log_ticks(fig.colorbar(images[0], cax=cax, extend="both").ax, "y")
    bars = fig.add_axes(lay.rect(2 * lay.panel + lay.bar_lab, y_heat, 3.3, lay.bars_h), label="top")
    _bars(bars, d)
    return fig


def log_ticks(ax: Any, which: str) -> None:
    """Plain ``1e-03`` labels at the decades, no minor ticks: mathtext labels cost more than the image."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    axis = ax.yaxis if which == "y" else ax.xaxis
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0), numticks=9))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0e}"))
    axis.set_minor_locator(NullLocator())
    ax.tick_params(axis=which, labelsize=FONT - 1)


def _heat_panel(
    ax: Any,
    h: Heat,
    grid: list[list[float]],
    norm: LogNorm,
    name: str,
    title: str,
    every: int,
    infinite: bool,
) -> None:
    ax.set_title(title, fontsize=9)
    if not h.rows:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no layer stack recognised\n(names like layers.N. / h.N. / blocks.N.)",
                ha="center", va="center", fontsize=FONT, transform=ax.transAxes)  # fmt: skip
        return
    im = heat(ax, grid, norm, name)
    ticks(ax, h.cols, h.rows, every=every)
    ax.set_xlabel("role", fontsize=FONT)
    if every:
        ax.set_ylabel("layer", fontsize=FONT)
    mark(ax, _marks_of(h, infinite), im.get_array().filled(np.nan), norm, im.get_cmap())


def _strip_panel(ax: Any, h: Heat, grid: list[list[float]], norm: LogNorm, name: str, infinite: bool) -> None:
    if not h.cols:
        ax.set_axis_off()
        return
    im = heat(ax, grid, norm, name)
    ticks(ax, h.cols, ["non-layer"], rotate=90)
    ax.tick_params(axis="y", length=0)
    mark(ax, _marks_of(h, infinite), im.get_array().filled(np.nan), norm, im.get_cmap())


def _bars(ax: Any, d: DiffPlot) -> None:
    bars = list(d.top)
    ax.set_title(
        f"top {len(bars)} changed tensors: ||B - A|| / ||A||" if bars else "top changed tensors", fontsize=9
    )
    if not bars:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no tensor changed", ha="center", va="center", transform=ax.transAxes)
        return
    finite = [b.rel for b in bars if math.isfinite(b.rel)]
    cap = max(finite) * 10 if finite else 1.0
    widths = [b.rel if math.isfinite(b.rel) else cap for b in bars]
    y = list(range(len(bars)))
    ax.barh(y, widths, color="#3b6ea8", label="rel")
    ax.set_xscale("log")
    log_ticks(ax, "x")
    ax.set_yticks(y, [short(b.key) for b in bars], fontsize=FONT)
    ax.invert_yaxis()
    for i, b in enumerate(bars):
        cos = "" if b.cosine is None else f"cos {b.cosine:.6g}"
        note = " ".join(x for x in ("inf" if math.isinf(b.rel) else f"{b.rel:.3g}", cos, b.marks) if x)
        ax.text(widths[i], i, f" {note}", va="center", fontsize=FONT - 1)
    ax.set_xlim(min(widths) / 3, max(widths) * 30)
