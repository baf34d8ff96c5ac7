"""Writing a ``Scene`` as SVG text: a standalone ``.svg`` file, or the ``<svg>`` element an ``.html`` page
carries inline. Text stays text (DejaVu Sans where the reader has it, else the browser's sans-serif), each
heat cell is a ``<rect>`` whose ``<title>`` (the hover tooltip) names the cell, its value and its tensors.
"""

from __future__ import annotations

from html import escape

from zckpt.ops.plots.scene import Cells, Line, Poly, Rect, Scene, Text

_ANCHOR = {"left": "start", "center": "middle", "right": "end"}
_DROP = {"top": 0.76, "center": 0.36, "bottom": -0.24}
"""Baseline below the anchor, in font sizes, for text aligned by its top, middle or bottom (DejaVu Sans'
cap height and descent): only the alphabetic baseline, which every SVG reader places alike."""


def _n(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


def svg(scene: Scene, *, standalone: bool = True) -> str:
    """The scene as one ``<svg>`` element (with the XML declaration when ``standalone``)."""
    w, h = _n(scene.width), _n(scene.height)
    out = ['<?xml version="1.0" encoding="utf-8"?>'] if standalone else []
    out.append(f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
               'font-family="DejaVu Sans, Verdana, sans-serif" xml:space="preserve" role="img" '
               f'aria-label="{escape(scene.title)}">')  # fmt: skip
    out.append(f'<rect width="{w}" height="{h}" fill="#ffffff"/>')
    for it in scene.items:
        if isinstance(it, Cells):
            out.extend(_cells(it))
        elif isinstance(it, Rect):
            out.append(f'<rect x="{_n(it.x)}" y="{_n(it.y)}" width="{_n(it.w)}" height="{_n(it.h)}" '
                       f'fill="{it.fill or "none"}"{_stroke(it.stroke, it.width)}/>')  # fmt: skip
        elif isinstance(it, Line):
            out.append(f'<line x1="{_n(it.x1)}" y1="{_n(it.y1)}" x2="{_n(it.x2)}" y2="{_n(it.y2)}"'
                       f'{_stroke(it.colour, it.width)}/>')  # fmt: skip
        elif isinstance(it, Poly):
            pts = " ".join(f"{_n(x)},{_n(y)}" for x, y in it.points)
            out.append(f'<polygon points="{pts}" fill="{it.fill or "none"}"{_stroke(it.stroke, it.width)}/>')
        elif isinstance(it, Text):
            out.append(_text(it))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _stroke(colour: str | None, width: float) -> str:
    return f' stroke="{colour}" stroke-width="{_n(width)}"' if colour else ""


def _cells(c: Cells) -> list[str]:
    rows, cols = c.rgb.shape[:2]
    cw, ch = c.w / cols, c.h / rows
    out = ['<g shape-rendering="crispEdges">']
    for i in range(rows):
        for j in range(cols):
            r, g, b = (int(v) for v in c.rgb[i, j])
            rect = (f'<rect x="{_n(c.x + j * cw)}" y="{_n(c.y + i * ch)}" width="{_n(cw + 0.05)}" '
                    f'height="{_n(ch + 0.05)}" fill="#{r:02x}{g:02x}{b:02x}"')  # fmt: skip
            tip = c.tips[i][j] if c.tips else ""
            out.append(f"{rect}><title>{escape(tip)}</title></rect>" if tip else f"{rect}/>")
    out.append("</g>")
    return out


def _text(t: Text) -> str:
    """Rotated text turns about its anchor; the anchor is moved so the turned text sits where the raster's
    turned box does (its end at the point for 45 degrees right-aligned, centred for 90 degrees)."""
    attrs = f'font-size="{_n(t.size)}"'
    if t.colour != "#000000":
        attrs += f' fill="{t.colour}"'
    if t.bold:
        attrs += ' font-weight="bold"'
    x, y, ha, va = t.x, t.y, str(t.ha), str(t.va)
    if t.rotate == 45:
        x, y, va = x - 0.25 * t.size, y + 0.25 * t.size, "center"
    elif t.rotate == 90:
        ha, va = {"top": "right", "center": "center", "bottom": "left"}[t.va], "center"
        x -= {"left": -0.5, "center": 0.0, "right": 0.5}[t.ha] * t.size
    if t.rotate:
        attrs += f' transform="rotate({-t.rotate} {_n(x)} {_n(y)})"'
    return (f'<text x="{_n(x)}" y="{_n(y + _DROP[va] * t.size)}" text-anchor="{_ANCHOR[ha]}" {attrs}>'
            f"{escape(t.text)}</text>")  # fmt: skip
