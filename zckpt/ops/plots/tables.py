"""The tables an ``.html`` plot carries beside its picture: the numbers behind every bar and cell, straight
from the operation's result (pure; no matplotlib)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zckpt.ops.plots.names import place

if TYPE_CHECKING:
    from zckpt.ops.diff import DiffResult
    from zckpt.ops.inspect import InspectReport
    from zckpt.ops.plots.grids import InspectPlot
    from zckpt.ops.series import SeriesResult

MAX_ROWS = 5000
"""Rows kept per table (a note says how many were left out)."""


@dataclass(frozen=True)
class Table:
    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    note: str = ""


def _g(x: float | None, pct: bool = False) -> str:
    if x is None:
        return "-"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{100 * x:.3g}%" if pct else f"{x:.4g}"


def _cut(title: str, headers: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> Table:
    note = f"{len(rows) - MAX_ROWS} more rows not shown" if len(rows) > MAX_ROWS else ""
    return Table(title, headers, tuple(rows[:MAX_ROWS]), note)


def diff_tables(r: DiffResult) -> list[Table]:
    """Every compared tensor (most changed first, as ``diff`` sorts them), then the one-sided keys."""
    rows = []
    for t in r.tensors:
        p = place(t.key)
        where = "-" if p.layer is None else str(p.layer)
        shape = (
            "x".join(map(str, t.shape_a))
            if t.shape_a == t.shape_b
            else f"{list(t.shape_a)}!={list(t.shape_b)}"
        )
        dtype = t.dtype_a if t.dtype_a == t.dtype_b else f"{t.dtype_a}!={t.dtype_b}"
        stats = (_g(t.rel_l2), _g(t.cosine), _g(t.max_abs_diff), _g(t.fraction_changed, pct=True))
        rows.append((t.key, where, p.column, shape or "scalar", dtype, *stats, ",".join(t.reasons) or "-"))
    out = [_cut("tensors", ("key", "layer", "column", "shape", "dtype", "||A-B||/||B||", "cosine",
                            "max |a-b|", "changed", "why"), rows)]  # fmt: skip
    for label, keys in (("only in A", r.only_in_a), ("only in B", r.only_in_b)):
        if keys:
            out.append(_cut(label, ("key", "layer", "column"), [_where(k) for k in keys]))
    return out


def _where(k: str) -> tuple[str, str, str]:
    p = place(k)
    return (k, "-" if p.layer is None else str(p.layer), p.column)


def inspect_tables(r: InspectReport, data: InspectPlot) -> list[Table]:
    """Bytes by rank x kind (the bars' numbers), parameters per layer, and bytes per dtype."""
    byrank = [
        (k, *(f"{n:,}" for n in row), f"{sum(row):,}") for k, row in zip(data.kinds, data.nbytes, strict=True)
    ]
    totals = [sum(col) for col in zip(*data.nbytes, strict=True)] if data.nbytes else []
    byrank.append(("total", *(f"{n:,}" for n in totals), f"{sum(totals):,}"))
    params = [(g, f"{n:,}") for g, n in zip(data.groups, data.params, strict=True)]
    dtypes = [(d, f"{n:,}") for d, n in data.dtypes]
    return [
        Table(
            "stored bytes by kind x rank", ("kind", *(f"rank {x}" for x in data.ranks), "all"), tuple(byrank)
        ),
        Table("parameters per layer", ("layer / module", "parameters"), tuple(params)),
        Table("stored bytes per dtype", ("dtype", "bytes"), tuple(dtypes)),
    ]


def series_tables(s: SeriesResult) -> list[Table]:
    """One row per pair (whole model), then the per-row update sizes."""
    pairs = [(p.a.name, p.b.name, _g(p.total), f"{p.differing}/{p.compared}", str(p.only_in_a),
              str(p.only_in_b), str(p.shape_mismatches)) for p in s.pairs]  # fmt: skip
    rows: list[tuple[str, ...]] = []
    for p in s.pairs:
        for r in sorted(p.rows, key=lambda r: (r.stack is None, r.stack or "", r.layer or 0, r.module or "")):
            name = f"{r.stack}.{r.layer}" if r.stack is not None else str(r.module)
            rows.append((p.b.name, name, _g(r.rel), str(r.tensors), r.marks or "-"))
    return [
        Table(
            "pairs", ("A", "B", "||A-B||/||B||", "differ", "only in A", "only in B", "reshaped"), tuple(pairs)
        ),
        _cut("per layer", ("B", "layer / module", "||A-B||/||B||", "tensors", "marks"), rows),
    ]
