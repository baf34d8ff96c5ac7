"""Painting a ``Scene`` into a PNG with Pillow (matplotlib's own dependency) and matplotlib's DejaVu Sans
fonts (``fonts``): a few hundredths of a second for the diff figure.

Text is anchored as the scene says (``Text.ha`` / ``va``); rotated text is drawn upright into a mask, turned
and pasted so that its turned box meets the anchor. Cells are scaled up nearest-neighbour. No timestamp or
version goes into the file: the same scene gives the same bytes.
"""

from __future__ import annotations

import io
from typing import Any

from zckpt.ops.plots.colours import rgb
from zckpt.ops.plots.fonts import HA, VA, font, painted_size
from zckpt.ops.plots.scene import Cells, Line, Poly, Rect, Scene, Text


def png(scene: Scene) -> bytes:
    """The PNG bytes of ``scene`` (RGB, 8 bits; zlib level 3: as fast as 1 and nearly as small as 6)."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (round(scene.width), round(scene.height)), (255, 255, 255))
    draw = ImageDraw.Draw(im)
    for it in scene.items:
        if isinstance(it, Cells):
            x0, y0 = round(it.x), round(it.y)
            size = (round(it.x + it.w) - x0, round(it.y + it.h) - y0)
            im.paste(Image.fromarray(it.rgb, "RGB").resize(size, Image.Resampling.NEAREST), (x0, y0))
        elif isinstance(it, Rect):
            box = (round(it.x), round(it.y), round(it.x + it.w) - 1, round(it.y + it.h) - 1)
            if it.fill:
                draw.rectangle(box, fill=it.fill)
            if it.stroke:
                draw.rectangle(box, outline=it.stroke, width=max(1, round(it.width)))
        elif isinstance(it, Line):
            draw.line((it.x1, it.y1, it.x2, it.y2), fill=it.colour, width=max(1, round(it.width)))
        elif isinstance(it, Poly):
            if it.fill:
                draw.polygon(it.points, fill=it.fill)
            if it.stroke:
                draw.line(
                    (*it.points, it.points[0]), fill=it.stroke, width=max(1, round(it.width)), joint="curve"
                )
        elif isinstance(it, Text):
            _text(im, draw, it)
    buf = io.BytesIO()
    im.save(buf, format="png", compress_level=3)
    return buf.getvalue()


def _text(im: Any, draw: Any, t: Text) -> None:
    f = font(painted_size(t.size), t.bold)
    if not t.rotate:
        draw.text((t.x, t.y), t.text, font=f, fill=t.colour, anchor=HA[t.ha] + VA[t.va])
        return
    from PIL import Image, ImageDraw

    left, top, right, bottom = f.getbbox(t.text, anchor="ls")
    mask = Image.new("L", (right - left + 2, bottom - top + 2), 0)
    ImageDraw.Draw(mask).text((1 - left, 1 - top), t.text, font=f, fill=255, anchor="ls")
    mask = mask.rotate(t.rotate, resample=Image.Resampling.BICUBIC, expand=True)
    w, h = mask.size
    x = t.x - {"left": 0, "center": w / 2, "right": w}[t.ha]
    y = t.y - {"top": 0, "center": h / 2, "bottom": h}[t.va]
    im.paste(rgb(t.colour), (round(x), round(y)), mask)
