"""The data of the series figure (pure): a layer x step grid of update sizes from a ``SeriesResult``.

Rows are the layers (in stack and index order), then the non-layer modules (name order; past
``MAX_MODULES`` the least moved share one ``other`` row, their sums pooled); columns are the consecutive
pairs, labelled by the newer tag's step. A cell is that row's ``sqrt(sum ||b-a||^2 / sum ||a||^2)`` for that
pair, ``None`` where the row has no tensor in the pair; ``totals`` is the whole model's per pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zckpt.ops.plots.names import row_label, shown

if TYPE_CHECKING:
    from zckpt.ops.series import RowUpdate, SeriesResult

MAX_MODULES = 16


@dataclass(frozen=True)
class SeriesPlot:
    """Everything the series figure shows."""

    title: str
    steps: tuple[int, ...]
    """The newer tag's step of each pair (the columns)."""
    pairs: tuple[str, ...]
    """``A -> B`` tag names of each pair."""
    rows: tuple[str, ...]
    layer_rows: int
    """The first ``layer_rows`` rows are layers, the others non-layer modules."""
    values: tuple[tuple[float | None, ...], ...]
    """``values[row][pair]``: the row's relative update; ``None``: the row has no tensor in that pair."""
    marks: tuple[tuple[str, ...], ...]
    totals: tuple[float, ...]
    notes: tuple[str, ...] = ()


Key = tuple[int, str, int, str]


def _key(r: RowUpdate) -> Key:
    if r.stack is not None and r.layer is not None:
        return (0, r.stack, r.layer, "")
    return (1, "", 0, f"{r.module} (buffer)" if r.buffer else str(r.module))


def series_plot(s: SeriesResult) -> SeriesPlot:
    """Grid the pairs' per-row sums (see the module doc)."""
    sums: dict[Key, list[list[float | str] | None]] = {}
    n = len(s.pairs)
    for j, p in enumerate(s.pairs):
        for r in p.rows:
            col = sums.setdefault(_key(r), [None] * n)
            col[j] = [r.d2, r.b2, r.marks]
    layers = sorted(k for k in sums if k[0] == 0)
    mods = sorted(k for k in sums if k[0] == 1)
    notes: list[str] = []
    if len(mods) > MAX_MODULES:
        keep = sorted(mods, key=lambda k: (-_peak(sums[k]), k))[: MAX_MODULES - 1]
        rest = [k for k in mods if k not in keep]
        other: Key = (1, "", 0, f"other ({len(rest)})")
        sums[other] = _pool([sums[k] for k in rest])
        mods = sorted(keep) + [other]
        notes.append(f"{len(rest)} non-layer modules pooled in one row")
    stacks = len({k[1] for k in layers})
    rows = [row_label(k[1], k[2], stacks) for k in layers] + [k[3] for k in mods]
    order = layers + mods
    return SeriesPlot(
        title=f"zckpt diff --series {shown(s.run)}   ({len(s.tags)} checkpoints; ||A-B||/||B|| per layer)",
        steps=tuple(p.b.step for p in s.pairs),
        pairs=tuple(f"{p.a.name} -> {p.b.name}" for p in s.pairs),
        rows=tuple(rows),
        layer_rows=len(layers),
        values=tuple(tuple(_rel(c) for c in sums[k]) for k in order),
        marks=tuple(tuple("" if c is None else str(c[2]) for c in sums[k]) for k in order),
        totals=tuple(p.total for p in s.pairs),
        notes=tuple(notes),
    )


def _rel(c: list[float | str] | None) -> float | None:
    if c is None:
        return None
    d2, b2 = float(c[0]), float(c[1])
    return 0.0 if d2 == 0 else (math.sqrt(d2 / b2) if b2 > 0 else math.inf)


def _peak(cells: list[list[float | str] | None]) -> float:
    return max((_rel(c) or 0.0 for c in cells), default=0.0)


def _pool(rows: list[list[list[float | str] | None]]) -> list[list[float | str] | None]:
    out: list[list[float | str] | None] = []
    for cells in zip(*rows, strict=True):
        have = [c for c in cells if c is not None]
        if not have:
            out.append(None)
            continue
        marks = "".join(sorted({m for c in have for m in str(c[2])}))
        out.append([sum(float(c[0]) for c in have), sum(float(c[1]) for c in have), marks])
    return out
