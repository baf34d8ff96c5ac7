"""The values half of ``zckpt diff``: one tensor pair compared in float64, streamed chunk by chunk.

``compare`` folds aligned chunk pairs (``zckpt.stream.spans.aligned_views``: a bounded chunk of each side,
read with ``pread``) into float64 accumulators and returns a ``TensorDiff``. Both sides are upcast exactly to
float64, which represents every value of every float dtype up to 32 bits (and every integer up to 2**53), so a
tensor stored in bf16 on one side and in fp32 on the other compares equal when the values are. Integer/bool
tensors on both sides are compared exactly (``a != b`` in int64; tolerances do not apply).

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

The result types, the accumulators and the dtype policy are ``zckpt.ops.diff_report``'s;
``zckpt.ops.diff_numpy`` computes the same figures without torch where both sides' bytes can be read so.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from zckpt.model import TensorEntry
from zckpt.ops.diff_report import Acc, Pair, TensorDiff, comparison_dtype, each, fold_chunks, is_exact, start
from zckpt.stream.spans import aligned_views

if TYPE_CHECKING:
    from tqdm import tqdm


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
    common, reasons, reshaped = start(ka, kb, ea, eb, strict_dtype, cast)
    if reshaped is not None:
        return reshaped
    exact = is_exact(ea.dtype) and is_exact(eb.dtype)
    # a no-op ``.to`` (the same view) for a side already in ``cast``
    pairs = chunks if cast is None else ((xa.to(cast), xb.to(cast)) for xa, xb in chunks)

    def refold(owed: int, acc: Acc) -> None:  # A's side of the owed chunks, read again
        for x, _ in itertools.islice(aligned_views(ea, eb, chunk), owed):
            _fold_same(x if cast is None else x.to(cast), acc, work, count=False)

    return fold_chunks(
        common, reasons, pairs, exact, bar, bits_equal=_bits_equal, scan_same=_scan_same,
        fold=lambda xa, xb, acc: _fold(xa, xb, exact, atol, rtol, acc, work), refold=refold,
        count=lambda x: x.numel(),
    )  # fmt: skip


def compare_all(
    pairs: list[Pair],
    atol: float,
    rtol: float,
    strict_dtype: bool,
    chunk: int,
    bar: tqdm,
    compare_dtype: str = "auto",
) -> list[TensorDiff]:
    """``compare`` over every pair, in order, ``compare_threads()`` pairs at once (``each``), each thread with
    its own working buffers; each pair's chunks are read a bounded chunk at a time
    (``aligned_views``)."""
    local = threading.local()

    def one(pair: Pair) -> TensorDiff:
        ka, kb, ea, eb = pair
        if not hasattr(local, "work"):
            local.work = Work()
        chunks = iter(aligned_views(ea, eb, chunk)) if ea.shape == eb.shape else iter(())
        to = comparison_dtype(compare_dtype, ea.dtype, eb.dtype)
        cast = None if to is None else to.torch
        return compare(ka, kb, ea, eb, atol, rtol, strict_dtype, chunks, chunk, local.work, bar, cast)

    return each(pairs, one)


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
    xa: torch.Tensor, xb: torch.Tensor, exact: bool, atol: float, rtol: float, acc: Acc, work: Work
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


def _scan_same(x: torch.Tensor, acc: Acc) -> bool:
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
    if x.element_size() == 1:  # float8: torch has no isinf (nor any) for it; float32 holds its values
        x = x.to(torch.float32)
    nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
    acc.same_nonfinite(nan, inf)
    return bool((x[torch.isfinite(x)] if nan or inf else x).any())


_DOT_DTYPES = (torch.float32, torch.float64)


def _fold_same(x: torch.Tensor, acc: Acc, work: Work, count: bool = True) -> None:
    """A chunk whose two sides are bit-identical: no difference metric moves, only the norms and the
    non-finite counts (the same on both sides) need the values."""
    a, _ = work.f64(x)
    s = float(torch.dot(a, a))
    if not math.isfinite(s):
        nan, inf = int(torch.isnan(a).sum()), int(torch.isinf(a).sum())
        if count:  # else ``_scan_same`` counted them already
            acc.same_nonfinite(nan, inf)
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
    acc: Acc,
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
