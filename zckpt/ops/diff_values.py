"""The values half of ``zckpt diff``: one tensor pair compared in float64, streamed chunk by chunk.

``compare`` folds aligned chunk pairs (``zckpt.stream.spans.aligned_views``: zero-copy views of both files'
page cache) into float64 accumulators and returns a ``TensorDiff``. Both sides are upcast exactly to float64,
which represents every value of every float dtype up to 32 bits (and every integer up to 2**53), so a tensor
stored in bf16 on one side and in fp32 on the other compares equal when the values are. Integer/bool tensors
on both sides are compared exactly (``a != b`` in int64; tolerances do not apply).

Fast path (same results): a chunk pair with the same float dtype and the same bits (compared as integers)
moves no difference metric, so no float64 pass is made over it; one dot product in its own dtype (or
isnan/isinf when that is not finite or is zero) gives its NaN/Inf counts and whether it is nonzero. A tensor
bit-identical in every chunk gets ``cosine = 1`` (``None`` when no finite element is nonzero) without summing
norms; when a later chunk differs, the earlier identical chunks are re-read and their float64 sums of
squares added. A finite float64 sum of squares of each side stands in for the per-element finiteness test.

Comparison dtype (``compare_dtype``, ``zckpt.ops.diff``'s ``dtype=``): ``auto`` compares a pair stored in two
float dtypes, one of which holds every value of the other (fp32 and bf16, fp32 and fp16, fp64 and any), at
the narrower one: the wider side is cast to it with torch's cast (round to nearest even, the cast
``consolidate`` writes a 16-bit export with), so a checkpoint's fp32 masters and their bf16 export compare
equal, whichever side is the export. Two float dtypes neither of which holds the other (bf16 and fp16)
are compared at B's, the reference (A cast to it: ``consolidate --dtype fp16`` of a bf16 tensor). Pairs of
one dtype and integers are compared as stored. ``full`` never casts.
``fp32``/``bf16``/``fp16`` cast every floating side not already in that dtype. ``TensorDiff.compared_as``
names the dtype a cast pair was compared in; the cast values are then upcast exactly to float64 as above.

Norms: ``norm_a``, ``norm_b``, ``norm_diff`` (``||a||``, ``||b||``, ``||a-b||`` over the finite elements)
come from the same accumulators (the plots pool them per cell); ``rel_l2 = ||a-b|| / ||b||`` is the one
relative change every report shows, B the reference as for ``rtol``.
For a tensor bit-identical in every chunk, ``norm_diff`` is 0 and
``norm_a = norm_b`` is the fast path's own-dtype dot product (float32/float64 tensors; float32 ones are
accumulated in float32), or ``None`` for other dtypes or when a chunk holds non-finite values (the fast
path sums nothing there).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from zckpt.dtypes import DType
from zckpt.errors import InvalidArgument
from zckpt.model import PRECISIONS, TensorEntry, dtype_name, parse_precision
from zckpt.ops.stats import is_exact, iter_chunks
from zckpt.storage import scan
from zckpt.storage.threads import Pool
from zckpt.stream.spans import aligned_views


@dataclass(frozen=True)
class TensorDiff:
    """The comparison of one tensor pair. Value metrics are ``None`` when the shapes differ."""

    key: str
    key_b: str | None
    role: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    numel: int
    max_abs_diff: float | None
    max_rel_diff: float | None
    rel_l2: float | None
    cosine: float | None
    changed: int | None
    nan_a: int | None
    nan_b: int | None
    inf_a: int | None
    inf_b: int | None
    differs: bool
    reasons: tuple[str, ...]
    """Subset of ``("shape", "dtype", "values")``."""
    norm_a: float | None = None
    """``||a||`` over the finite elements; ``None`` when the shapes differ or the fast path summed nothing
    (see the module doc)."""
    norm_b: float | None = None
    norm_diff: float | None = None
    """``||a-b||`` over the elements finite on both sides; ``None`` only when the shapes differ."""
    compared_as: str | None = None
    """The dtype both sides were cast to before comparing (see the module doc); ``None``: as stored."""

    @property
    def cast(self) -> str | None:
        """Which side(s) the comparison cast, in words (``"A cast to bfloat16 as stored in B"``), or None."""
        if self.compared_as is None:
            return None
        ca, cb = self.dtype_a != self.compared_as, self.dtype_b != self.compared_as
        if ca and cb:
            return f"both cast to {self.compared_as}"
        if ca:
            return f"A cast to {self.compared_as} as stored in B"
        return f"B cast to {self.compared_as} as stored in A" if cb else None

    @property
    def identical(self) -> bool:
        """Same shape and exactly the same values as compared (NaN where NaN, no element differs at all)."""
        return self.max_abs_diff == 0 and self.changed == 0

    @property
    def fraction_changed(self) -> float | None:
        if self.changed is None:
            return None
        return self.changed / self.numel if self.numel else 0.0

    def sort_key(self) -> tuple[int, float, float, str]:
        """Most changed first: differing before equal, then rel L2, then fraction changed."""
        if "shape" in self.reasons:
            score = math.inf
        else:
            score = self.rel_l2 if self.rel_l2 is not None and not math.isnan(self.rel_l2) else math.inf
        return (0 if self.differs else 1, -score, -(self.fraction_changed or 0.0), self.key)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "key_b": self.key_b,
            "role": self.role,
            "shape_a": list(self.shape_a),
            "shape_b": list(self.shape_b),
            "dtype_a": self.dtype_a,
            "dtype_b": self.dtype_b,
            "numel": self.numel,
            "max_abs_diff": real(self.max_abs_diff),
            "max_rel_diff": real(self.max_rel_diff),
            "rel_l2": real(self.rel_l2),
            "cosine": real(self.cosine),
            "changed": self.changed,
            "fraction_changed": real(self.fraction_changed),
            "nan_a": self.nan_a,
            "nan_b": self.nan_b,
            "inf_a": self.inf_a,
            "inf_b": self.inf_b,
            "differs": self.differs,
            "reasons": list(self.reasons),
            "compared_as": self.compared_as,
        }


class _Acc:
    """float64 accumulators of one tensor pair."""

    __slots__ = ("max_abs", "max_rel", "d2", "a2", "b2", "ab", "changed", "nan_a", "nan_b", "inf_a", "inf_b",
                 "same2", "same_known")  # fmt: skip

    def __init__(self) -> None:
        self.max_abs = self.max_rel = 0.0
        self.d2 = self.a2 = self.b2 = self.ab = 0.0
        self.changed = self.nan_a = self.nan_b = self.inf_a = self.inf_b = 0
        self.same2 = 0.0  # own-dtype sum of squares of the bit-identical chunks (fast path)
        self.same_known = True  # every such chunk gave a finite one


def compare(
    ka: str,
    kb: str,
    ea: TensorEntry,
    eb: TensorEntry,
    atol: float,
    rtol: float,
    strict_dtype: bool,
    chunks: Iterator[tuple[torch.Tensor, torch.Tensor]],
    chunk: int,
    work: Work,
    bar: tqdm,
    cast: torch.dtype | None = None,
) -> TensorDiff:
    """Compare one pair; ``chunks`` yields its aligned chunk pairs (nothing when the shapes differ); ``cast``:
    the dtype both sides are cast to first (``comparison_dtype``), None to compare them as stored."""
    reasons: list[str] = []
    if ea.dtype != eb.dtype and strict_dtype:  # else a dtype-only difference is none: values decide
        reasons.append("dtype")
    common: dict[str, Any] = dict(
        key=ka,
        key_b=kb if kb != ka else None,
        role=ea.role.value,
        shape_a=ea.shape,
        shape_b=eb.shape,
        dtype_a=dtype_name(ea.dtype),
        dtype_b=dtype_name(eb.dtype),
        numel=ea.numel,
        compared_as=None if cast is None else dtype_name(cast),
    )
    if ea.shape != eb.shape:
        reasons.insert(0, "shape")
        return TensorDiff(
            **common, max_abs_diff=None, max_rel_diff=None, rel_l2=None, cosine=None, changed=None,
            nan_a=None, nan_b=None, inf_a=None, inf_b=None, differs=True, reasons=tuple(reasons),
        )  # fmt: skip
    exact = is_exact(ea.dtype) and is_exact(eb.dtype)
    acc = _Acc()
    owed = 0  # leading bit-identical chunks whose float64 norms are not summed yet
    nonzero = False  # some finite element of those chunks is nonzero
    for xa, xb in chunks:
        if cast is not None:
            xa, xb = xa.to(cast), xb.to(cast)  # a no-op (the same view) for a side already in ``cast``
        if not exact and owed >= 0 and _bits_equal(xa, xb):
            nonzero |= _scan_same(xa, acc)
            owed += 1
        else:
            if owed > 0:  # a chunk differs after all: sum the owed norms (re-reads A's chunks)
                for _, x in itertools.islice(iter_chunks(ea, chunk), owed):
                    _fold_same(x if cast is None else x.to(cast), acc, work, count=False)
            owed = -1
            _fold(xa, xb, exact, atol, rtol, acc, work)
        bar.update(xa.numel())
    if acc.changed:
        reasons.append("values")
    return _result(common, acc, owed, nonzero, reasons)


def _result(common: dict[str, Any], acc: _Acc, owed: int, nonzero: bool, reasons: list[str]) -> TensorDiff:
    """The ``TensorDiff`` of a same-shape pair from its accumulators; ``owed > 0``: every chunk was
    bit-identical (norms not summed in float64)."""
    na, nb = math.sqrt(acc.a2), math.sqrt(acc.b2)
    nd = math.sqrt(acc.d2)
    rel_l2 = (nd / nb) if nb > 0 else (0.0 if nd == 0 else math.inf)
    cosine = acc.ab / (na * nb) if na > 0 and nb > 0 else None
    norm_a: float | None = na
    norm_b: float | None = nb
    if owed > 0:  # every chunk bit-identical: <a,b> = ||a|| ||b|| without summing anything
        cosine = 1.0 if nonzero else None
        norm_a = norm_b = math.sqrt(acc.same2) if acc.same_known else None
    if cosine is not None:
        cosine = max(-1.0, min(1.0, cosine))
    return TensorDiff(
        **common,
        max_abs_diff=acc.max_abs,
        max_rel_diff=acc.max_rel,
        rel_l2=rel_l2,
        cosine=cosine,
        changed=acc.changed,
        nan_a=acc.nan_a,
        nan_b=acc.nan_b,
        inf_a=acc.inf_a,
        inf_b=acc.inf_b,
        differs=bool(reasons),
        reasons=tuple(reasons),
        norm_a=norm_a,
        norm_b=norm_b,
        norm_diff=nd,
    )


Pair = tuple[str, str, TensorEntry, TensorEntry]


def compare_threads() -> int:
    """Tensor pairs compared at once: one per 2 usable cores, at most 8 (``ZCKPT_WORKERS`` overrides); each
    thread folds its own pair's chunks (torch releases the GIL), so a diff is not bound by one core."""
    return scan.threads(cap=8, per=2)


COMPARE_DTYPES = ("auto", "full", "fp32", "bf16", "fp16")
"""``compare_dtype`` values (the module doc); ``fp32``/``bf16``/``fp16`` in any spelling ``parse_precision``
reads."""


def parse_compare_dtype(name: str | DType | torch.dtype) -> str:
    """``auto``, ``full``, ``fp32``, ``bf16`` or ``fp16`` for a ``compare_dtype`` in any spelling."""
    if isinstance(name, str) and name.strip().lower() in ("auto", "full"):
        return name.strip().lower()
    got = parse_precision(name.strip()) if isinstance(name, str) else None
    if isinstance(name, (DType, torch.dtype)):
        got = next((k for k, v in PRECISIONS.items() if v == name), None)
    if got is None:
        raise InvalidArgument(
            f"unknown comparison dtype {name!r}; choose auto, full, fp32, bf16 or fp16",
            hint="auto: a pair stored in two dtypes is compared at the narrower; full: as stored, in float64",
        )
    return got


def comparison_dtype(mode: str, da: DType, db: DType) -> DType | None:
    """The dtype a pair stored as ``da``/``db`` is cast to before comparing under ``mode`` (a
    ``parse_compare_dtype`` result), or None to compare it as stored (the module doc)."""
    if mode == "full" or not (da.is_floating_point and db.is_floating_point):
        return None
    if mode != "auto":
        target = PRECISIONS[mode]
        return None if da == db == target else target
    if da == db:
        return None
    return da if _holds(db, da) and not _holds(da, db) else db  # the narrower; else B's, the reference


def _holds(wide: DType, narrow: DType) -> bool:
    """Every value of ``narrow`` is a value of ``wide`` (finer or equal spacing, wider or equal range)."""
    w, n = torch.finfo(wide.torch), torch.finfo(narrow.torch)
    return w.eps <= n.eps and w.max >= n.max and w.smallest_normal <= n.smallest_normal


def compare_all(
    pairs: list[Pair],
    atol: float,
    rtol: float,
    strict_dtype: bool,
    chunk: int,
    bar: tqdm,
    compare_dtype: str = "auto",
) -> list[TensorDiff]:
    """``compare`` over every pair, in order, ``compare_threads()`` pairs at once, each thread with its own
    working buffers; each pair's chunks are zero-copy views of both files' page cache (``aligned_views``)."""
    local = threading.local()

    def one(pair: Pair) -> TensorDiff:
        ka, kb, ea, eb = pair
        if not hasattr(local, "work"):
            local.work = Work()
        chunks = iter(aligned_views(ea, eb, chunk)) if ea.shape == eb.shape else iter(())
        to = comparison_dtype(compare_dtype, ea.dtype, eb.dtype)
        cast = None if to is None else to.torch
        return compare(ka, kb, ea, eb, atol, rtol, strict_dtype, chunks, chunk, local.work, bar, cast)

    n = min(compare_threads(), len(pairs))
    if n <= 1:
        return [one(p) for p in pairs]
    with Pool(n, thread_name_prefix="zckpt-diff") as pool:
        return list(pool.map(one, pairs))


class Work:
    """Reusable float64 working buffers (fresh multi-MiB allocations cost a page fault per page)."""

    def __init__(self) -> None:
        self._a = torch.empty(0, dtype=torch.float64)
        self._b = torch.empty(0, dtype=torch.float64)

    def f64(self, xa: torch.Tensor, xb: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = xa.numel()
        if self._a.numel() < n:
            self._a = torch.empty(n, dtype=torch.float64)
            self._b = torch.empty(n, dtype=torch.float64)
        a = self._a[:n].copy_(xa)
        b = self._b[:n] if xb is None else self._b[:n].copy_(xb)
        return a, b


def _bits_equal(xa: torch.Tensor, xb: torch.Tensor) -> bool:
    """Both chunks hold the same bit patterns (same dtype): NaN payloads and signed zeros included."""
    if xa.dtype != xb.dtype:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(xa.element_size())
    if as_int is None or xa.is_complex():
        return torch.equal(xa, xb)  # NaN-free equality is enough for the fast path
    return torch.equal(xa.view(as_int), xb.view(as_int))


def _fold(
    xa: torch.Tensor, xb: torch.Tensor, exact: bool, atol: float, rtol: float, acc: _Acc, work: Work
) -> None:
    """Fold one chunk pair (same length, logical dtypes) into ``acc``."""
    if exact:
        ia, ib = xa.to(torch.int64), xb.to(torch.int64)
        acc.changed += int((ia != ib).sum())
        a, b = xa.to(torch.float64), xb.to(torch.float64)
        if a.numel():
            _fold_finite(a, b, True, atol, rtol, acc)
        return
    if _bits_equal(xa, xb):
        _fold_same(xa, acc, work)
        return
    a, b = work.f64(xa, xb)
    a2, b2 = float(torch.dot(a, a)), float(torch.dot(b, b))
    if math.isfinite(a2) and math.isfinite(b2):  # then every element is finite (no float64 overflow)
        _fold_finite(a, b, False, atol, rtol, acc, a2, b2)
        return
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    both = fa & fb
    if not bool(both.all()):
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        acc.nan_a += int(nan_a.sum())
        acc.nan_b += int(nan_b.sum())
        acc.inf_a += int(torch.isinf(a).sum())
        acc.inf_b += int(torch.isinf(b).sum())
        odd = ~both
        same = (a[odd] == b[odd]) | (nan_a[odd] & nan_b[odd])
        acc.changed += int((~same).sum())
        a, b = a[both], b[both]
    if a.numel():
        _fold_finite(a, b, False, atol, rtol, acc)


def _scan_same(x: torch.Tensor, acc: _Acc) -> bool:
    """Count the non-finite values of a chunk that is bit-identical on both sides, without float64
    work; return whether some finite element is nonzero. One float-dtype dot of ``x`` with itself
    answers both when it is finite and nonzero (a finite sum of squares has no NaN/Inf term)."""
    s = float(torch.dot(x, x)) if x.dtype in _DOT_DTYPES else math.nan
    if math.isfinite(s):
        acc.same2 += s
        if s > 0:
            return True
    else:
        acc.same_known = False
    nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
    acc.nan_a += nan
    acc.nan_b += nan
    acc.inf_a += inf
    acc.inf_b += inf
    return bool((x[torch.isfinite(x)] if nan or inf else x).any())


_DOT_DTYPES = (torch.float32, torch.float64)


def _fold_same(x: torch.Tensor, acc: _Acc, work: Work, count: bool = True) -> None:
    """A chunk whose two sides are bit-identical: no difference metric moves, only the norms and the
    non-finite counts (the same on both sides) need the values."""
    a, _ = work.f64(x)
    s = float(torch.dot(a, a))
    if not math.isfinite(s):
        nan, inf = int(torch.isnan(a).sum()), int(torch.isinf(a).sum())
        if count:  # else ``_scan_same`` counted them already
            acc.nan_a += nan
            acc.nan_b += nan
            acc.inf_a += inf
            acc.inf_b += inf
        if nan or inf:
            a = a[torch.isfinite(a)]
            s = float(torch.dot(a, a))
    acc.a2 += s
    acc.b2 += s
    acc.ab += s


def _fold_finite(
    a: torch.Tensor,
    b: torch.Tensor,
    exact: bool,
    atol: float,
    rtol: float,
    acc: _Acc,
    a2: float | None = None,
    b2: float | None = None,
) -> None:
    """Fold float64 chunks of finite values in; ``a`` and ``b`` are scratch (overwritten)."""
    acc.a2 += float(torch.dot(a, a)) if a2 is None else a2
    acc.b2 += float(torch.dot(b, b)) if b2 is None else b2
    acc.ab += float(torch.dot(a, b))
    d = a.sub_(b)
    acc.d2 += float(torch.dot(d, d))
    d.abs_()
    acc.max_abs = max(acc.max_abs, float(d.max()))
    bab = b.abs_()
    if not exact:
        if atol == 0 and rtol == 0:
            acc.changed += int(torch.count_nonzero(d))
        else:
            tol = bab.mul(rtol).add_(atol) if rtol else atol
            acc.changed += int((d > tol).sum())
    rel = d.div_(bab).nan_to_num_(nan=0.0, posinf=math.inf)  # 0/0 -> 0, x/0 -> inf
    acc.max_rel = max(acc.max_rel, float(rel.max()))


def real(x: float | None) -> float | str | None:
    """JSON has no NaN/Infinity: non-finite numbers become the strings "inf", "-inf", "nan"."""
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
