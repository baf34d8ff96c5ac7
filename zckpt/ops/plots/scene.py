"""A figure as plain data: boxes, lines, polygons, text and grids of coloured cells in pixels (origin top
left, y down), which ``raster`` paints into a PNG (Pillow) and ``svg`` writes as SVG, without matplotlib.

The diff figure is built this way (``diff_scene``) because drawing it through matplotlib cost more than the
diff of a 468M-param pair (issue 18 asks for <= 5%). Beside the drawing, a ``Scene`` keeps one ``Panel``
per axes-like part (``rel``, ``cos``, ``strip_rel``, ``strip_cos``, ``colorbar_rel``, ``colorbar_cos``,
``top``) with the labels and values drawn in it: what the tests read back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

DPI = 100
PT = DPI / 72
"""Pixels per point (matplotlib's sizes are in points at ``DPI`` dots per inch)."""
FONT = 8 * PT
"""Tick labels and cell markers (matplotlib's 8 pt)."""

HAlign = Literal["left", "center", "right"]
VAlign = Literal["top", "center", "bottom"]


@dataclass(frozen=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str | None
    stroke: str | None = None
    width: float = 0.8 * PT


@dataclass(frozen=True)
class Line:
    x1: float
    y1: float
    x2: float
    y2: float
    colour: str = "#000000"
    width: float = 0.8 * PT


@dataclass(frozen=True)
class Poly:
    points: tuple[tuple[float, float], ...]
    fill: str | None
    stroke: str | None = "#000000"
    width: float = 0.8 * PT


@dataclass(frozen=True)
class Text:
    """One line of text at ``(x, y)``; rotated ``rotate`` degrees counter-clockwise, the rotated text's
    bounding box is aligned to the point by ``ha`` / ``va`` (matplotlib's default rotation mode)."""

    x: float
    y: float
    text: str
    size: float = FONT
    ha: HAlign = "left"
    va: VAlign = "center"
    colour: str = "#000000"
    bold: bool = False
    rotate: int = 0


@dataclass(frozen=True)
class Cells:
    """A grid of cells filling the box, ``rgb[i, j]`` (uint8) the colour of row ``i`` (top down), column
    ``j``; ``tips[i][j]`` says what the cell holds (an SVG tooltip)."""

    x: float
    y: float
    w: float
    h: float
    rgb: np.ndarray
    tips: tuple[tuple[str, ...], ...] = ()


Item = Rect | Line | Poly | Text | Cells


@dataclass
class Panel:
    """What one part of the figure shows, in data terms: its box, title, tick labels, the values drawn
    (a heat grid's, NaN for no value; the bars' widths) on the scale ``vmin..vmax``, and the letters
    written in cells, ``marks[(column, row)]``."""

    label: str
    box: tuple[float, float, float, float]
    title: str = ""
    xticks: tuple[str, ...] = ()
    yticks: tuple[str, ...] = ()
    values: np.ndarray | None = None
    vmin: float | None = None
    vmax: float | None = None
    marks: dict[tuple[int, int], str] = field(default_factory=dict)


@dataclass
class Scene:
    width: float
    height: float
    items: list[Item] = field(default_factory=list)
    panels: dict[str, Panel] = field(default_factory=dict)
    title: str = ""

    def add(self, *items: Item) -> None:
        self.items.extend(items)


def log_ticks(lo: float, hi: float, numticks: int = 9) -> list[float]:
    """Tick values of a log axis over ``lo..hi``: 1, 2 and 5 times each decade, only every ``stride``-th
    decade once there are more than ``numticks`` decades (as matplotlib's ``LogLocator(subs=(1, 2, 5))``)."""
    k0, k1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    stride = 1 + (k1 - k0) // (numticks + 1)
    subs = (1.0, 2.0, 5.0) if stride == 1 else (1.0,)
    out = []
    for k in range(k0, k1 + 1):
        if (k - k0) % stride:
            continue
        for m in subs:
            v = m * 10.0**k
            if lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9):
                out.append(v)
    return out


def tick_label(v: float, digits: int = 1) -> str:
    """``1e-03`` at the decades and their 2s and 5s; with more ``digits``, ``1.3e-06`` (trailing zeros of
    the mantissa dropped: ``1e-06``, not ``1.0e-06``)."""
    text = f"{v:.{max(0, digits - 1)}e}"
    mant, exp = text.split("e")
    if "." in mant:
        mant = mant.rstrip("0").rstrip(".")
    return f"{mant}e{exp}"


def end_labels(lo: float, hi: float) -> tuple[str, str]:
    """Labels of a scale's two ends with the fewest significant digits (2 to 8) that tell them apart."""
    for digits in range(2, 9):
        a, b = tick_label(lo, digits), tick_label(hi, digits)
        if a != b:
            return a, b
    return a, b


def thin(candidates: list[tuple[float, str]], extent: Callable[[float, str], tuple[float, float]],
         gap: float, fixed: int = 0) -> list[tuple[float, str]]:  # fmt: skip
    """Keep the ticks whose labels do not overlap: ``candidates`` in priority order (the first ``fixed``
    always kept), ``extent(value, label)`` the label's span along the axis, ``gap`` the space kept between
    two labels. A label that repeats a kept one is dropped."""
    kept: list[tuple[float, str]] = []
    spans: list[tuple[float, float]] = []
    for i, (v, lab) in enumerate(candidates):
        lo, hi = extent(v, lab)
        clash = any(lo < b + gap and a < hi + gap for a, b in spans) or any(lab == k for _, k in kept)
        if i < fixed or not clash:
            kept.append((v, lab))
            spans.append((lo, hi))
    return sorted(kept)


def fitting_log_ticks(lo: float, hi: float, extent: Callable[[float, str], tuple[float, float]],
                      gap: float) -> list[float]:  # fmt: skip
    """The densest evenly spaced log ticks over ``lo..hi`` whose labels (``tick_label``) do not overlap:
    1, 2 and 5 times each decade, else each decade, else every 2nd, 3rd, ... decade (matplotlib's
    ``LogLocator`` thins the same way); ``extent(value, label)`` is a label's span along the axis."""
    k0, k1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    sets = [[m * 10.0**k for k in range(k0, k1 + 1) for m in (1.0, 2.0, 5.0)]]
    sets += [
        [10.0**k for k in range(k0, k1 + 1) if (k - k0) % stride == 0] for stride in range(1, k1 - k0 + 2)
    ]
    for vals in sets:
        ticks = [v for v in vals if lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9)]
        cands = [(v, tick_label(v)) for v in ticks]
        if ticks and len(thin(cands, extent, gap)) == len(cands):
            return ticks
    return []
