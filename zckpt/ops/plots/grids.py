"""The data of the ``diff`` and ``inspect`` figures, built from the operations' results alone (pure: no
matplotlib, no tensor read). The tests check these, and the drawing code only lays them out.

``diff_plot``: a layer x role ``Heat`` of ``||A-B|| / ||B||`` and cosine per cell (the cell's tensors pooled:
``sqrt(sum ||b-a||^2 / sum ||a||^2)``, so a weight and its bias make one cell), the non-layer tensors in a
one-row strip of their own (one column per module), markers for tensors only in A or B, reshaped, retyped or
holding NaN/Inf, and the top-N changed tensors. ``inspect_plot``: bytes by rank x kind and parameters per
layer. Every value comes from ``DiffResult`` / ``InspectReport`` as the operation computed it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from zckpt.model import STATE_SEP
from zckpt.ops.plots.names import ROLE_ORDER, module_of, place, row_label, shown

if TYPE_CHECKING:
    from zckpt.ops.diff import DiffResult, TensorDiff
    from zckpt.ops.inspect import InspectReport

MARKS: dict[str, str] = {
    "A": "only in A",
    "B": "only in B",
    "S": "shape differs",
    "D": "dtype differs",
    "N": "NaN/Inf",
}
"""Cell markers (drawn as these letters) and what they mean."""

STRIP_ROW = "non-layer"
MAX_STRIP = 40
"""Non-layer modules drawn one column each; beyond that the smallest changes share an ``other`` column."""


@dataclass(frozen=True)
class Cell:
    """One cell: the tensors in it, their pooled change relative to B, cosine, and markers."""

    keys: tuple[str, ...]
    rel: float | None
    """``||A-B|| / ||B||`` pooled over the cell's compared tensors; ``None`` when none was compared."""
    cosine: float | None
    marks: str = ""
    """Letters of ``MARKS``, in that order."""


@dataclass(frozen=True)
class Heat:
    """A grid of cells: ``cells[i][j]`` is row ``rows[i]``, column ``cols[j]`` (``None``: no tensor)."""

    rows: tuple[str, ...]
    cols: tuple[str, ...]
    cells: tuple[tuple[Cell | None, ...], ...]

    def values(self, what: str = "rel") -> list[list[float]]:
        """``rel`` or ``1-cos`` per cell, NaN where there is no value."""
        out = []
        for row in self.cells:
            vals = []
            for c in row:
                v = None if c is None else (c.rel if what == "rel" else _one_minus(c.cosine))
                vals.append(math.nan if v is None else v)
            out.append(vals)
        return out

    def cell(self, row: str, col: str) -> Cell | None:
        return self.cells[self.rows.index(row)][self.cols.index(col)]


@dataclass(frozen=True)
class Bar:
    key: str
    rel: float
    cosine: float | None
    marks: str = ""


@dataclass(frozen=True)
class DiffPlot:
    """Everything the diff figure shows."""

    title: str
    summary: str
    layers: Heat
    strip: Heat
    top: tuple[Bar, ...]
    notes: tuple[str, ...] = ()


def _one_minus(cos: float | None) -> float | None:
    return None if cos is None else max(0.0, 1.0 - cos)


@dataclass
class _Pool:
    """Sums of one cell (mutable while building)."""

    keys: list[str] = field(default_factory=list)
    d2: float = 0.0
    a2: float = 0.0
    b2: float = 0.0
    compared: int = 0
    cosine: float | None = None
    marks: set[str] = field(default_factory=set)
    size: float = 0.0

    def add(self, t: TensorDiff) -> None:
        self.keys.append(t.key)
        if t.dtype_a != t.dtype_b:
            self.marks.add("D")
        if t.norm_diff is None:  # shapes differ
            self.marks.add("S")
            return
        if (t.nan_a or 0) + (t.nan_b or 0) + (t.inf_a or 0) + (t.inf_b or 0):
            self.marks.add("N")
        self.compared += 1
        self.cosine = t.cosine
        self.d2 += t.norm_diff**2
        if t.norm_a is not None and t.norm_b is not None:  # else bit-identical with no norm summed
            self.a2 += t.norm_a**2
            self.b2 += t.norm_b**2
        self.size = max(self.size, t.rel_l2 or 0.0)

    def cell(self) -> Cell:
        marks = "".join(m for m in MARKS if m in self.marks)
        if not self.compared:
            return Cell(tuple(self.keys), None, None, marks)
        rel = 0.0 if self.d2 == 0 else (math.sqrt(self.d2 / self.b2) if self.b2 > 0 else math.inf)
        cos = self.cosine
        if self.compared > 1:
            cos = _pooled_cosine(self.a2, self.b2, self.d2) if self.d2 else 1.0
        return Cell(tuple(self.keys), rel, cos, marks)


def _pooled_cosine(a2: float, b2: float, d2: float) -> float | None:
    """Cosine of the concatenated tensors from their norms: ``<a,b> = (|a|^2 + |b|^2 - |a-b|^2) / 2``."""
    if a2 <= 0 or b2 <= 0:
        return None
    return max(-1.0, min(1.0, (a2 + b2 - d2) / 2 / math.sqrt(a2 * b2)))


def diff_plot(r: DiffResult, top: int = 20) -> DiffPlot:
    """The diff figure's data: layer x role heat, non-layer strip, top-``top`` bars (model tensors only)."""
    pools: dict[tuple[str, int] | None, dict[str, _Pool]] = {}
    optim = 0
    for t in r.tensors:
        if STATE_SEP in t.key:
            optim += 1
            continue
        _pool(pools, t.key).add(t)
    for keys, mark in ((r.only_in_a, "A"), (r.only_in_b, "B")):
        for k in keys:
            if STATE_SEP not in k:
                p = _pool(pools, k)
                p.keys.append(k)
                p.marks.add(mark)
    notes = []
    if optim:
        notes.append(f"{optim} optimizer-state tensors not drawn")
    if r.top is not None and len(r.tensors) < r.compared:
        notes.append(f"only the {len(r.tensors)} most-changed of {r.compared} compared tensors (top={r.top})")
    return DiffPlot(
        title=f"zckpt diff   A: {_side(r.a)}   B: {_side(r.b)}",
        summary=r.summary(),
        layers=_layer_heat(pools),
        strip=_strip(pools.get(None, {})),
        top=_top_bars(r.tensors, top),
        notes=tuple(notes),
    )


def _side(s: object) -> str:
    path, tag = getattr(s, "path", "?"), getattr(s, "tag", None)
    return f"{shown(path)} [{tag}]" if tag else shown(path)


def _pool(pools: dict[tuple[str, int] | None, dict[str, _Pool]], key: str) -> _Pool:
    p = place(key)
    row = None if p.stack is None or p.layer is None else (p.stack, p.layer)
    return pools.setdefault(row, {}).setdefault(p.column, _Pool())


def _layer_heat(pools: dict[tuple[str, int] | None, dict[str, _Pool]]) -> Heat:
    rows = sorted(r for r in pools if r is not None)
    present = {c for r in rows for c in pools[r]}
    cols = tuple(c for c in ROLE_ORDER if c in present)
    stacks = len({s for s, _ in rows})
    cells = tuple(tuple(_cell(pools[r].get(c)) for c in cols) for r in rows)
    return Heat(tuple(row_label(s, i, stacks) for s, i in rows), cols, cells)


def _cell(p: _Pool | None) -> Cell | None:
    return None if p is None else p.cell()


def _strip(mods: dict[str, _Pool]) -> Heat:
    """Non-layer modules, one column each in name order; past ``MAX_STRIP`` the least changed are pooled."""
    names = sorted(mods)
    if len(names) > MAX_STRIP:
        keep = set(sorted(names, key=lambda n: (-mods[n].size, n))[: MAX_STRIP - 1])
        rest = _Pool()
        for n in names:
            if n not in keep:
                m = mods[n]
                rest.keys += m.keys
                rest.d2, rest.a2, rest.b2 = rest.d2 + m.d2, rest.a2 + m.a2, rest.b2 + m.b2
                rest.compared += m.compared
                rest.marks |= m.marks
        names = [n for n in names if n in keep]
        mods = {**{n: mods[n] for n in names}, f"other ({len(rest.keys)})": rest}
        names.append(f"other ({len(rest.keys)})")
    if not names:
        return Heat((), (), ())
    return Heat((STRIP_ROW,), tuple(names), (tuple(mods[n].cell() for n in names),))


def _top_bars(tensors: Iterable[TensorDiff], n: int) -> tuple[Bar, ...]:
    moved = [t for t in tensors if STATE_SEP not in t.key and (t.rel_l2 or 0.0) > 0]
    moved.sort(key=lambda t: (-(t.rel_l2 or 0.0), t.key))
    return tuple(Bar(t.key, t.rel_l2 or 0.0, t.cosine, _marks(t)) for t in moved[:n])


def _marks(t: TensorDiff) -> str:
    p = _Pool()
    p.add(t)
    return "".join(m for m in MARKS if m in p.marks)


# ---- inspect ---------------------------------------------------------------------------------------------
KIND_ORDER = ("param", "frozen", "buffer")
"""Stack order of the byte bars; optimizer states follow, in the order the checkpoint names them."""
MAX_MODULES = 12
"""Non-layer modules drawn one bar each in the parameters-per-layer panel; the rest share one bar."""


@dataclass(frozen=True)
class InspectPlot:
    """Everything the inspect figure shows."""

    title: str
    ranks: tuple[str, ...]
    """Column labels: rank numbers, ``file`` for bytes no rank owns (a consolidated file's)."""
    kinds: tuple[str, ...]
    nbytes: tuple[tuple[int, ...], ...]
    """``nbytes[k][r]``: stored bytes (padding included) of kind ``kinds[k]`` on rank ``ranks[r]``."""
    groups: tuple[str, ...]
    """Parameter-count bars: layers (``layer_groups`` of them, first), then non-layer modules."""
    params: tuple[int, ...]
    layer_groups: int
    dtypes: tuple[tuple[str, int], ...]
    """Stored bytes per dtype, largest first."""


def inspect_plot(r: InspectReport) -> InspectPlot:
    """The inspect figure's data from the report's per-rank byte counts and tensor rows."""
    kinds_seen: list[str] = []
    ranks: set[int | None] = set()
    cells: dict[tuple[str, int | None], int] = {}
    dtypes: dict[str, int] = {}
    for rb in r.rank_bytes:
        if rb.kind not in kinds_seen:
            kinds_seen.append(rb.kind)
        ranks.add(rb.rank)
        cells[(rb.kind, rb.rank)] = cells.get((rb.kind, rb.rank), 0) + rb.nbytes
        dtypes[rb.dtype] = dtypes.get(rb.dtype, 0) + rb.nbytes
    kinds = [k for k in KIND_ORDER if k in kinds_seen] + [k for k in kinds_seen if k not in KIND_ORDER]
    order = sorted(x for x in ranks if x is not None) + ([None] if None in ranks else [])
    groups, params, nlayers = _params_by_group(r)
    where = f"{shown(r.path)} [{r.tag}]" if r.tag else shown(r.path)
    return InspectPlot(
        title=f"zckpt inspect   {where}   {r.format}, world {r.world_size}, {r.params:,} params",
        ranks=tuple("file" if x is None else str(x) for x in order),
        kinds=tuple(kinds),
        nbytes=tuple(tuple(cells.get((k, x), 0) for x in order) for k in kinds),
        groups=groups,
        params=params,
        layer_groups=nlayers,
        dtypes=tuple(sorted(dtypes.items(), key=lambda kv: (-kv[1], kv[0]))),
    )


def _params_by_group(r: InspectReport) -> tuple[tuple[str, ...], tuple[int, ...], int]:
    layers: dict[tuple[str, int], int] = {}
    mods: dict[str, int] = {}
    for t in r.tensors:
        if t.role not in ("param", "frozen"):
            continue
        p = place(t.name)
        if p.stack is not None and p.layer is not None:
            layers[(p.stack, p.layer)] = layers.get((p.stack, p.layer), 0) + t.numel
        else:
            m = module_of(t.name)
            mods[m] = mods.get(m, 0) + t.numel
    rows = sorted(layers)
    stacks = len({s for s, _ in rows})
    names = [row_label(s, i, stacks) for s, i in rows]
    counts = [layers[x] for x in rows]
    big = sorted(mods, key=lambda m: (-mods[m], m))
    for m in big[:MAX_MODULES]:
        names.append(m)
        counts.append(mods[m])
    if len(big) > MAX_MODULES:
        names.append(f"other ({len(big) - MAX_MODULES})")
        counts.append(sum(mods[m] for m in big[MAX_MODULES:]))
    return tuple(names), tuple(counts), len(rows)
