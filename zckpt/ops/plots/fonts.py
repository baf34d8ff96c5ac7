"""The diff figure's font (matplotlib's DejaVu Sans, read from its package folder without importing it) and
where a ``Text`` lands once painted: ``text_width`` for the layout (so labels are placed, thinned and fitted
by their real widths, not a per-character guess) and ``text_corners`` for the tests (the painted box, turned
with the text, as ``raster`` paints it). Pillow (matplotlib's own dependency) measures; it is imported only
when a figure is laid out.
"""

from __future__ import annotations

import importlib.util
import math
import os
from functools import lru_cache
from typing import Any

from zckpt.ops.plots.scene import Text

HA = {"left": "l", "center": "m", "right": "r"}
VA = {"top": "a", "center": "m", "bottom": "d"}
"""Pillow anchors of ``Text.ha`` / ``Text.va`` (``a``: ascender, ``d``: descender)."""


@lru_cache(maxsize=16)
def font(size: float, bold: bool = False) -> Any:
    """DejaVu Sans at ``size`` pixels, from matplotlib's package data (Pillow's default font without it)."""
    from PIL import ImageFont

    spec = importlib.util.find_spec("matplotlib")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(
            folder, "mpl-data", "fonts", "ttf", "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
        )
        if os.path.isfile(path):
            return ImageFont.truetype(path, size)
    return ImageFont.load_default(size)


def painted_size(size: float) -> float:
    """The font size ``raster`` paints ``size`` at (quarter pixels)."""
    return round(size * 4) / 4


@lru_cache(maxsize=4096)
def text_width(text: str, size: float, bold: bool = False) -> float:
    """Width in pixels of ``text`` painted at ``size``."""
    return float(font(painted_size(size), bold).getlength(text))


def text_corners(t: Text) -> tuple[tuple[float, float], ...]:
    """The four corners of ``t``'s painted box (its glyphs' box, turned with the text), in pixels: what
    ``raster`` paints. Upright text is anchored by Pillow; turned text's turned box meets the anchor."""
    f = font(painted_size(t.size), t.bold)
    if not t.rotate:
        x0, y0, x1, y1 = f.getbbox(t.text, anchor=HA[t.ha] + VA[t.va])
        return ((t.x + x0, t.y + y0), (t.x + x1, t.y + y0), (t.x + x1, t.y + y1), (t.x + x0, t.y + y1))
    x0, y0, x1, y1 = f.getbbox(t.text, anchor="ls")
    w, h = x1 - x0, y1 - y0
    a = math.radians(t.rotate)  # counter-clockwise on screen: y points down
    c, s = math.cos(a), math.sin(a)
    pts = [(px * c + py * s, -px * s + py * c) for px, py in ((0, 0), (w, 0), (w, h), (0, h))]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    bw, bh = max(xs) - min(xs), max(ys) - min(ys)
    left = t.x - {"left": 0.0, "center": bw / 2, "right": bw}[t.ha]
    top = t.y - {"top": 0.0, "center": bh / 2, "bottom": bh}[t.va]
    return tuple((left + px - min(xs), top + py - min(ys)) for px, py in pts)
