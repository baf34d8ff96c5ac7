"""The diff figure as a ``Scene`` (pure Python and numpy, no matplotlib): layer x role heatmaps of
``||A-B|| / ||B||`` and ``1 - cosine`` with the non-layer strip under each and a log colour bar beside them,
then the top-N changed tensors as bars on a log axis. ``raster`` and ``svg`` write it.

Colours: ``colours``' log scale per panel pair (heat and its strip share one), white = exactly unchanged,
grey = no value, black = infinite; cell letters from ``grids.MARKS`` in black or white for contrast. The
layout is in inches as matplotlib's figure was (``_Layout``), sized by the labels' real widths
(``fonts.text_width``), so no label leaves its panel and none overlaps another:

- a colour bar labels both ends of its scale (with the digits that tell them apart: ``1.07e-03`` /
  ``2.13e-03``) and the densest even set of 1-2-5 / decade ticks in between whose labels do not touch them or
  each other, over any range (one value: ``hi/10 .. hi``; tiny or huge ranges);
- the bars' log axis keeps the densest even tick set whose labels fit (1-2-5, each decade, every n-th decade)
  inside the panel, and reaches far enough right that each bar's numbers (``0.0021 cos 0.99998 D``) end
  inside the panel; the panel widens so that they take at most about half of it;
- the figure is at least as wide as its title, summary and legend lines.
"""

from __future__ import annotations

import math

import numpy as np

from zckpt.ops.plots.colours import colours, light, log_range, lut
from zckpt.ops.plots.fonts import text_width
from zckpt.ops.plots.grids import MARKS, Bar, DiffPlot, Heat
from zckpt.ops.plots.names import short
from zckpt.ops.plots.scene import (
    DPI,
    FONT,
    PT,
    Cells,
    HAlign,
    Line,
    Panel,
    Poly,
    Rect,
    Scene,
    Text,
    end_labels,
    fitting_log_ticks,
    thin,
)
from zckpt.ops.plots.scene import tick_label as tlabel

TICK, PAD = 3.5 * PT, 3.5 * PT
TITLE = 9 * PT
SMALL = 7 * PT
BAR = "#3b6ea8"
LEGEND = ("white: unchanged   grey: no tensor / no value   black: inf   "
          + "   ".join(f"{k}: {v}" for k, v in MARKS.items()))  # fmt: skip
BARS_W = 3.3
"""Inches of the bars' axis, at least."""
WIDEST_END = "8.88e-88"
"""The widest colour-bar label the layout leaves room for (3 significant digits)."""
Box = tuple[float, float, float, float]
SIN45 = math.sqrt(0.5)


def _inch(text: str, size: float = FONT, bold: bool = False) -> float:
    """Width of ``text`` in inches, as painted."""
    return text_width(text, size, bold) / DPI


def bar_note(b: Bar) -> str:
    """The numbers written after a bar: ``0.00213 cos 0.999998 D``."""
    cos = "" if b.cosine is None else f"cos {b.cosine:.6g}"
    return " ".join(t for t in ("inf" if math.isinf(b.rel) else f"{b.rel:.3g}", cos, b.marks) if t)


class _Layout:
    """Boxes in inches, top-down; ``box`` turns one into pixels (``left`` centres the panels in a figure
    widened for its title)."""

    def __init__(self, d: DiffPlot) -> None:
        rows, cols, mods = d.layers.rows, d.layers.cols, d.strip.cols
        tick = (TICK + PAD) / DPI
        col_w = max((_inch(short(c, 28)) for c in cols), default=0.0)
        turned = SIN45 * (col_w + FONT / DPI)  # a 45-degree label's reach, down and to the left
        self.heat_w = max(1.8, 0.36 * len(cols), 0.24 * len(mods))
        cell = self.heat_w / len(cols) if cols else 0.0
        row_w = max(_inch(short(r, 28)) for r in (*rows, "non-layer"))
        self.ylab = max(tick + row_w + 4 * PT / DPI + 1.2 * FONT / DPI + 0.15, turned - cell / 2 + 0.15)
        self.bar_lab = 0.2 + max((_inch(short(b.key)) for b in d.top), default=_inch("x" * 8))
        self.heat_h = max(1.0, 0.2 * len(rows)) if rows else 1.0
        self.xlab = tick + turned + 4 * PT / DPI + 1.3 * FONT / DPI + 0.1
        self.strip_h = 0.32 if mods else 0.0
        self.strip_lab = (0.15 + tick + max(_inch(short(m, 28)) for m in mods)) if mods else 0.0
        self.top = 0.75
        stack = 0.3 + self.heat_h + self.xlab + self.strip_h + self.strip_lab
        self.bars_h = max(0.22 * len(d.top) + 0.1, 1.0)
        note = max((_inch(bar_note(b), SMALL) for b in d.top), default=0.0) + 0.3 * SMALL / DPI + 0.1
        self.bars_w = max(BARS_W, note / 0.55)  # the numbers after a bar take at most ~55% of the axis
        self.height = self.top + max(stack, 0.3 + self.bars_h + 0.5) + 0.45
        self.panel = self.ylab + self.heat_w + 0.32 + _inch(WIDEST_END, SMALL) + 0.15  # heat + colour bar
        content = 2 * self.panel + self.bar_lab + self.bars_w + 0.3
        lines = [_inch(t, TITLE) for t in (d.title, d.summary)] + [
            _inch("   ".join([LEGEND, *d.notes]), SMALL)
        ]
        self.width = max(content, max(lines) + 0.4)
        self.left = (self.width - content) / 2

    @staticmethod
    def box(x: float, y_top: float, w: float, h: float) -> Box:
        return (x * DPI, y_top * DPI, w * DPI, h * DPI)


def diff_scene(d: DiffPlot) -> Scene:
    """Layer x role heatmaps of ||A-B||/||B|| and 1-cosine, the non-layer strip under each, top-N bars."""
    lay = _Layout(d)
    s = Scene(lay.width * DPI, lay.height * DPI, title=d.title)
    for k, line in enumerate((d.title, d.summary)):
        s.add(Text(s.width / 2, 0.12 * DPI + k * 1.25 * TITLE, line, TITLE, "center", "top"))
    s.add(Text(s.width / 2, s.height - 0.12 * DPI, "   ".join([LEGEND, *d.notes]), SMALL, "center", "bottom"))
    every = max(1, len(d.layers.rows) // 60)
    y_heat = lay.top + 0.3
    y_strip = y_heat + lay.heat_h + lay.xlab
    for col, (what, name, title) in enumerate((
        ("rel", "viridis", "||B - A|| / ||A||"),
        ("1-cos", "plasma", "1 - cosine(A, B)"),
    )):  # fmt: skip
        label = "rel" if what == "rel" else "cos"
        grid, sgrid = d.layers.values(what), d.strip.values(what)
        x = lay.left + col * lay.panel + lay.ylab
        lo, hi = log_range([grid, sgrid])
        if not any(v > 0 for g in (grid, sgrid) for row in g for v in row):  # NaN > 0 is False
            title += "\n(all white: nothing changed)"
        heat = _Heat(d.layers, grid, lo, hi, name, what)
        heat.panel(s, label, lay.box(x, y_heat, lay.heat_w, lay.heat_h), title, every if col == 0 else 0)
        if d.strip.cols:
            strip = _Heat(d.strip, sgrid, lo, hi, name, what)
            strip.strip(s, f"strip_{label}", lay.box(x, y_strip, lay.heat_w, lay.strip_h))
        if d.layers.rows or d.strip.cols:
            span = (y_strip + lay.strip_h if d.strip.cols else y_heat + lay.heat_h) - y_heat
            box = lay.box(x + lay.heat_w + 0.12, y_heat, 0.13, span)
            _colorbar(s, f"colorbar_{label}", box, lo, hi, name)
    _bars(s, lay.box(lay.left + 2 * lay.panel + lay.bar_lab, y_heat, lay.bars_w, lay.bars_h), d)
    return s


def _title(s: Scene, box: Box, title: str) -> None:
    x, y, w, _ = box
    lines = title.split("\n")
    for k, line in enumerate(reversed(lines)):
        s.add(Text(x + w / 2, y - 6 * PT - k * 1.25 * TITLE, line, TITLE, "center", "bottom"))


def _xticks(s: Scene, box: Box, xs: list[float], labels: list[str], rotate: int, size: float = FONT) -> None:
    bottom = box[1] + box[3]
    ha: HAlign = "right" if rotate == 45 else "center"
    for px, lab in zip(xs, labels, strict=True):
        s.add(
            Line(px, bottom, px, bottom + TICK),
            Text(px, bottom + TICK + PAD, lab, size, ha, "top", rotate=rotate),
        )


def _yticks(s: Scene, box: Box, ys: list[float], labels: list[str], length: float = TICK) -> None:
    x = box[0]
    for py, lab in zip(ys, labels, strict=True):
        if length:
            s.add(Line(x - length, py, x, py))
        s.add(Text(x - length - PAD, py, lab, FONT, "right", "center"))


class _Heat:
    """One grid drawn as coloured cells with its marker letters."""

    def __init__(self, h: Heat, grid: list[list[float]], lo: float, hi: float, cmap: str, what: str) -> None:
        self.h, self.lo, self.hi, self.what = h, lo, hi, what
        self.values = np.array(grid, dtype=np.float64).reshape(len(h.rows), len(h.cols))
        self.rgb = colours(self.values, lo, hi, cmap)

    def _cells(self, s: Scene, label: str, box: Box, title: str) -> Panel:
        x, y, w, h = box
        s.add(Cells(x, y, w, h, self.rgb, self._tips()), Rect(x, y, w, h, None, "#000000"))
        p = Panel(label, box, title, values=self.values, vmin=self.lo, vmax=self.hi)
        cw, ch = w / len(self.h.cols), h / len(self.h.rows)
        for i, row in enumerate(self.h.cells):
            for j, c in enumerate(row):
                text = "" if c is None else c.marks
                if self.what == "rel" and c is not None and c.rel is not None and math.isinf(c.rel):
                    text = (text + " inf").strip()
                if text:
                    colour = "#000000" if light(self.rgb[i, j]) else "#ffffff"
                    s.add(Text(x + (j + 0.5) * cw, y + (i + 0.5) * ch, text, FONT, "center", "center",
                               colour, bold=True))  # fmt: skip
                    p.marks[(j, i)] = text
        s.panels[label] = p
        return p

    def _tips(self) -> tuple[tuple[str, ...], ...]:
        name = "||A-B||/||B||" if self.what == "rel" else "1-cos"
        out = []
        for i, row in enumerate(self.h.cells):
            line = []
            for j, c in enumerate(row):
                v = self.values[i, j]
                text = f"{self.h.rows[i]} / {self.h.cols[j]}: {name} " + (
                    "-" if math.isnan(v) else f"{v:.4g}"
                )
                if c is not None:
                    text += "".join(f"\n{MARKS[m]}" for m in c.marks)
                    text += "".join(f"\n{k}" for k in c.keys[:8]) + ("\n…" if len(c.keys) > 8 else "")
                line.append(text)
            out.append(tuple(line))
        return tuple(out)

    def panel(self, s: Scene, label: str, box: Box, title: str, every: int) -> None:
        """The layer x role heatmap; ``every``-th row labelled (0: none, a panel beside one that is)."""
        _title(s, box, title)
        x, y, w, h = box
        if not self.h.rows:
            s.panels[label] = Panel(label, box, title)
            for k, line in enumerate(
                ("no layer stack recognised", "(names like layers.N. / h.N. / blocks.N.)")
            ):
                s.add(Text(x + w / 2, y + h / 2 + (k - 0.5) * 1.25 * FONT, line, FONT, "center", "center"))
            return
        p = self._cells(s, label, box, title)
        cw, ch = w / len(self.h.cols), h / len(self.h.rows)
        p.xticks = tuple(short(c, 28) for c in self.h.cols)
        _xticks(s, box, [x + (j + 0.5) * cw for j in range(len(self.h.cols))], list(p.xticks), 45)
        drop = TICK + PAD + SIN45 * (max(text_width(t, FONT) for t in p.xticks) + FONT) + 4 * PT
        s.add(Text(x + w / 2, y + h + drop, "role", FONT, "center", "top"))
        if every:
            rows = list(range(0, len(self.h.rows), every))
            p.yticks = tuple(short(self.h.rows[i], 28) for i in rows)
            _yticks(s, box, [y + (i + 0.5) * ch for i in rows], list(p.yticks))
            left = x - TICK - PAD - max(text_width(t, FONT) for t in p.yticks) - 4 * PT
            s.add(Text(left, y + h / 2, "layer", FONT, "right", "center", rotate=90))

    def strip(self, s: Scene, label: str, box: Box) -> None:
        """The non-layer strip: one row, module names below (vertical)."""
        p = self._cells(s, label, box, "")
        x, y, w, h = box
        p.xticks = tuple(short(c, 28) for c in self.h.cols)
        p.yticks = ("non-layer",)
        cw = w / len(self.h.cols)
        _xticks(s, box, [x + (j + 0.5) * cw for j in range(len(self.h.cols))], list(p.xticks), 90)
        _yticks(s, box, [y + h / 2], ["non-layer"], length=0)


def _colorbar(s: Scene, label: str, box: Box, lo: float, hi: float, cmap: str) -> None:
    """A vertical log colour bar with white (below: unchanged) and black (above: inf) end triangles."""
    x, y, w, h = box
    tri = h * 0.05 / 1.1
    inner = h - 2 * tri
    s.add(Cells(x, y + tri, w, inner, lut(cmap)[::-1].reshape(256, 1, 3)))
    s.add(Poly(((x, y + tri), (x + w / 2, y), (x + w, y + tri)), "#000000"))
    s.add(Poly(((x, y + h - tri), (x + w / 2, y + h), (x + w, y + h - tri)), "#ffffff"))
    outline = ((x, y + tri), (x + w / 2, y), (x + w, y + tri), (x + w, y + h - tri), (x + w / 2, y + h),
               (x, y + h - tri))  # fmt: skip
    s.add(Poly(outline, None))
    a, span = math.log10(lo), math.log10(hi) - math.log10(lo)

    def py(v: float) -> float:
        return y + tri + inner * (1 - (math.log10(v) - a) / span)

    def extent(v: float, _: str) -> tuple[float, float]:
        return py(v) - SMALL / 2, py(v) + SMALL / 2

    ends = list(zip((lo, hi), end_labels(lo, hi), strict=True))
    inside = [(v, tlabel(v)) for v in fitting_log_ticks(lo, hi, extent, 0.6 * SMALL)]
    ticks = thin(ends + inside, extent, 0.6 * SMALL, fixed=2)
    for v, lab in ticks:
        s.add(
            Line(x + w, py(v), x + w + TICK, py(v)),
            Text(x + w + TICK + PAD, py(v), lab, SMALL, "left", "center"),
        )
    s.panels[label] = Panel(label, box, yticks=tuple(lab for _, lab in ticks), vmin=lo, vmax=hi)


def _bars(s: Scene, box: Box, d: DiffPlot) -> None:
    """The top changed tensors, most changed on top, on a log axis; each with its numbers beside it."""
    bars = list(d.top)
    title = f"top {len(bars)} changed tensors: ||B - A|| / ||A||" if bars else "top changed tensors"
    _title(s, box, title)
    x, y, w, h = box
    if not bars:
        s.panels["top"] = Panel("top", box, title)
        s.add(Text(x + w / 2, y + h / 2, "no tensor changed", 10 * PT, "center", "center"))
        return
    finite = [b.rel for b in bars if math.isfinite(b.rel)]
    cap = max(finite) * 10 if finite else 1.0
    widths = [b.rel if math.isfinite(b.rel) else cap for b in bars]
    notes = [bar_note(b) for b in bars]
    lo = min(widths) / 3
    a = math.log10(lo)
    # the axis reaches far enough right that every bar's numbers end inside the panel
    room = [w - 0.3 * SMALL - text_width(t, SMALL) - PAD for t in notes]
    span = max(
        [math.log10(max(widths) * 30) - a]
        + [(math.log10(v) - a) * w / r for v, r in zip(widths, room, strict=True)]
    )
    hi = 10 ** (a + span)
    n = len(bars)
    y0, y1 = -0.4 - 0.05 * (n - 0.2), n - 0.6 + 0.05 * (n - 0.2)  # matplotlib's 5% margins

    def px(v: float) -> float:
        return x + w * (math.log10(v) - a) / span

    def py(i: float) -> float:
        return y + h * (i - y0) / (y1 - y0)

    bh = 0.8 * h / (y1 - y0)
    for i, (wd, note) in enumerate(zip(widths, notes, strict=True)):
        s.add(Rect(x, py(i) - bh / 2, px(wd) - x, bh, BAR), Text(px(wd) + 0.3 * SMALL, py(i), note, SMALL))
    s.add(Rect(x, y, w, h, None, "#000000"))
    labels = [short(b.key) for b in bars]
    _yticks(s, box, [py(i) for i in range(n)], labels)

    def extent(v: float, lab: str) -> tuple[float, float]:
        half = text_width(lab, SMALL) / 2
        return px(v) - half, px(v) + half

    fits = [v for v in fitting_log_ticks(lo, hi, extent, 0.8 * SMALL)]
    ticks = [v for v in fits if extent(v, tlabel(v))[0] >= x and extent(v, tlabel(v))[1] <= x + w]
    _xticks(s, box, [px(v) for v in ticks], [tlabel(v) for v in ticks], 0, SMALL)
    s.panels["top"] = Panel(
        "top",
        box,
        title,
        xticks=tuple(tlabel(v) for v in ticks),
        yticks=tuple(labels),
        values=np.array(widths),
        vmin=lo,
        vmax=hi,
    )
