"""The values half of ``zckpt diff`` in numpy, for pairs whose bytes need no torch to read (issue 42:
``zckpt diff a.safetensors b.safetensors`` never imports torch).

The same comparison as ``zckpt.ops.diff_values`` (its module doc defines every figure and the fast path for
bit-identical chunks), on numpy arrays of the files' bytes (read with ``pread`` into each thread's reusable
buffers, cut by ``zckpt.stream.spans.aligned_spans``). ``usable`` says whether a diff's pairs can all be
compared here: every piece a byte range of a file stored in its entry's dtype (no value held in memory, no
cast on read), dtypes numpy reads (every one safetensors has but complex), and casts (``--dtype``) only to
float32, float16 or bfloat16. ``zckpt.ops.diff`` compares here when they can, else with torch. Pairs are
compared one per core at once (a numpy loop uses one core; torch's use several). The checksums of the bytes
read (``zckpt.storage.checks``) are fed once a chunk pair is compared, on the comparison's thread while the
bytes are in its cache: a bit-identical pair's once for both sides.

Element types: float64/32/16, integers and bool are numpy's own; bfloat16 is held as its bits (``uint16``:
the top half of a float32, widened exactly by a shift) and float8 (e4m3fn, e5m2) as bytes, widened exactly
through a 256-value table (e5m2: the top byte of a float16). Casts are ``zckpt.stream.cast``'s numpy
kernels (torch's rounding, and the NaN bits of its vectorised loop); torch's scalar tail writes some NaNs
otherwise, so the bit-identical fast path may take a chunk with a cast NaN in its last few elements that
torch's does not: the counts and differences agree, cosine may then be 1 where torch's is 1 - 1 ulp.
Counts, max abs and max rel differences are the same as torch's to the bit; norms, ``rel_l2`` and cosine are
float64 dot products like torch's (MKL's there), summed in another order: they agree to a few ulps
(``tests/test_diff_numpy.py`` compares both comparisons on hand-made tensors of every dtype).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from zckpt.dtypes import BY_NAME, DType
from zckpt.model import Checked, TensorEntry
from zckpt.ops.diff_report import Acc, Pair, TensorDiff, comparison_dtype, each, fold_chunks, is_exact, start
from zckpt.storage import checks, fileio, scan
from zckpt.stream import cast
from zckpt.stream.spans import Span, aligned_spans

_BITS = {"bfloat16": "<u2", "float8_e4m3fn": "|u1", "float8_e5m2": "|u1"}
"""The dtypes numpy has no type for, held as their bits."""
_CASTS = ("float32", "float16", "bfloat16")
"""The dtypes a pair may be cast to here."""
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_FLOAT32 = BY_NAME["float32"]


def _dot(a: np.ndarray, b: np.ndarray) -> Any:
    """``a . b`` on the calling thread, in the arrays' dtype (``einsum``'s own loop). Not ``np.dot`` or
    ``np.vecdot``: those hand 1-D products to OpenBLAS's threads, which spin after each call and take the
    cores the comparison's own threads need (a 1 GiB pair on 2 idle cores: 2.5 s on one thread either way,
    1.5-1.8 s on two threads with this, 2.7 s on two with ``np.vecdot``)."""
    return np.einsum("i,i->", a, b)


def _e4m3fn() -> np.ndarray:
    b = np.arange(256)
    e, m = (b >> 3) & 0xF, b & 7
    v = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * np.exp2(e - 7.0))
    v = np.where(b & 0x80, -v, v)
    v[(b & 0x7F) == 0x7F] = np.nan  # no infinities; S.1111.111 is NaN
    return v.astype(np.float32)


_E4M3FN = _e4m3fn()


def layout(d: DType) -> str | None:
    """The numpy dtype a chunk of ``d`` is held in, or None where numpy has none here (complex)."""
    return None if d.kind == "c" else _BITS.get(d.name, d.numpy)


def readable(e: TensorEntry) -> bool:
    """``e``'s values can be read here without torch: every piece a byte range of a file (or object) stored in
    the entry's dtype, of a dtype numpy holds (``layout``)."""
    return layout(e.dtype) is not None and all(
        p.value is None and p.dtype == e.dtype for p in e.pieces if p.numel
    )


def usable(pairs: list[Pair], mode: str) -> bool:
    """Every pair of a diff can be compared here (the module doc), ``mode`` its ``--dtype``."""
    for _, _, ea, eb in pairs:
        if ea.shape != eb.shape:
            continue  # nothing is read
        if not (readable(ea) and readable(eb)):
            return False
        to = comparison_dtype(mode, ea.dtype, eb.dtype)
        if to is not None and to.name not in _CASTS:
            return False
    return True


def compare_all(
    pairs: list[Pair], atol: float, rtol: float, strict_dtype: bool, chunk: int, bar: Any, compare_dtype: str
) -> list[TensorDiff]:
    """``diff_values.compare_all`` for pairs ``usable`` says are (the same arguments)."""
    local = threading.local()

    def one(pair: Pair) -> TensorDiff:
        ka, kb, ea, eb = pair
        if not hasattr(local, "work"):
            local.work = _Work()
        with np.errstate(all="ignore"):  # inf - inf, 0/0...: the figures say what they mean, no warnings
            return compare(ka, kb, ea, eb, atol, rtol, strict_dtype, chunk, local.work, bar,
                           comparison_dtype(compare_dtype, ea.dtype, eb.dtype))  # fmt: skip

    return each(pairs, one, scan.threads(cap=8, per=1))  # numpy's loops use one core each (torch's, several)


Chunk = tuple[np.ndarray, DType]
"""A chunk's elements as stored (``layout``) and their dtype."""


def compare(
    ka: str, kb: str, ea: TensorEntry, eb: TensorEntry, atol: float, rtol: float, strict_dtype: bool,
    chunk: int, work: _Work, bar: Any, cast: DType | None,
) -> TensorDiff:  # fmt: skip
    """``diff_values.compare`` of one pair (its chunks read here)."""
    common, reasons, reshaped = start(ka, kb, ea, eb, strict_dtype, cast)
    if reshaped is not None:
        return reshaped
    exact = is_exact(ea.dtype) and is_exact(eb.dtype)
    seen = _Seen()
    pairs = ((_cast(xa, cast), _cast(xb, cast)) for xa, xb in _chunks(ea, eb, chunk, seen, work))

    def refold(owed: int, acc: Acc) -> None:  # A's side of the owed chunks, read again (checked already)
        for x, _, lo, hi in itertools.islice(aligned_spans(ea, eb, chunk), owed):
            _fold_same(_cast((_read(x, lo, hi, work, 2)[0], ea.dtype), cast), acc, work, count=False)

    return fold_chunks(
        common, reasons, pairs, exact, bar, bits_equal=seen.bits_equal, scan_same=_scan_same,
        fold=lambda xa, xb, acc: _fold(xa, xb, exact, atol, rtol, acc, work, seen.bits_equal), refold=refold,
        count=lambda x: len(x[0]),
    )  # fmt: skip


class _Seen:
    """The chunk pair being compared, as read (views of the files' mappings), and whether the comparison
    found the two bit-identical: their checksums are then computed once for both (``_chunks``)."""

    def __init__(self) -> None:
        self.a: np.ndarray | None = None
        self.b: np.ndarray | None = None
        self.same = False

    def bits_equal(self, x: Chunk, y: Chunk) -> bool:
        """``_bits_equal``, noting when the chunks are the bytes read themselves (no cast) and equal."""
        eq = _bits_equal(x, y)
        if eq and x[0] is self.a and y[0] is self.b:
            self.same = True
        return eq


def _chunks(
    ea: TensorEntry, eb: TensorEntry, chunk: int, seen: _Seen, work: _Work
) -> Iterator[tuple[Chunk, Chunk]]:
    """``aligned_views`` as numpy chunks, each side read into ``work``'s reusable buffers. The checksums of a
    chunk's bytes are fed once the comparison is done with it: once for both sides when it found them
    bit-identical (``checks.consumed_same``), else each side's own. A chunk the comparison never finished is
    not fed: ``checks.Session.finish`` reads what no read covered, so it is checked all the same."""
    for x, y, lo, hi in aligned_spans(ea, eb, chunk):
        (va, ca, at_a), (vb, cb, at_b) = _read(x, lo, hi, work, 0), _read(y, lo, hi, work, 1)
        seen.a, seen.b, seen.same = va, vb, False
        yield (va, ea.dtype), (vb, eb.dtype)
        if seen.same:
            checks.consumed_same(((ca, at_a), (cb, at_b)), va.data)
        else:
            checks.consumed_same(((ca, at_a),), va.data)
            checks.consumed_same(((cb, at_b),), vb.data)
    seen.a = seen.b = None


def _read(s: Span, lo: int, hi: int, work: _Work, i: int) -> tuple[np.ndarray, Checked | None, int]:
    """Elements ``[lo, hi)`` of the span read into ``work``'s buffer ``i`` (``pread``: a file shortened
    meanwhile is an error, not a ``SIGBUS``), the checksum over them and their byte offset in the file."""
    p = s.piece
    n = (hi - lo) * p.dtype.itemsize
    at = p.byte_offset + (s.offset + lo - s.lo) * p.dtype.itemsize
    out = work.buf(i, n)[:n]
    fileio.read_into(p.file, at, out)
    return out.view(str(layout(p.dtype))), p.check, at  # ``usable``: a numpy dtype


def _f32(x: Chunk) -> np.ndarray:
    """A chunk of a float dtype of at most 32 bits as float32 values (exact; a new array)."""
    v, d = x
    if d.name == "bfloat16":
        return (v.astype(np.uint32) << 16).view(np.float32)
    if d.name == "float8_e4m3fn":
        return _E4M3FN[v]
    if d.name == "float8_e5m2":
        return (v.astype(np.uint16) << 8).view(np.float16).astype(np.float32)
    return v.astype(np.float32)


def floats(x: Chunk) -> np.ndarray:
    """A float chunk's values in a numpy float type (float64/32/16 as they are, the others as float32)."""
    return x[0] if x[1].name not in _BITS else _f32(x)


def _cast(x: Chunk, to: DType | None) -> Chunk:
    """``x`` cast to ``to`` as torch casts, NaN bits included (``zckpt.stream.cast``'s kernels; a float8 chunk
    through float32, which holds its values exactly); ``x`` itself when it is in ``to`` already."""
    v, d = x
    if to is None or d is to:
        return x
    src, sd = (v, d) if cast.can_cast(d, to) else (_f32(x), _FLOAT32)
    if sd is to:
        return src, to
    out = np.empty(len(v) * to.itemsize, dtype=np.uint8)
    cast.numpy_cast(out, to, src.view(np.uint8), sd)
    return out.view(_BITS.get(to.name, to.numpy or "")), to  # float32, float16: numpy's; bfloat16: bits


def _bits_equal(x: Chunk, y: Chunk) -> bool:
    """Both chunks hold the same bit patterns (same dtype): NaN payloads and signed zeros included."""
    (a, da), (b, db) = x, y
    if da is not db:
        return False
    u = _UINT[a.itemsize]
    return bool(np.array_equal(a.view(u), b.view(u)))


class _Work:
    """Reusable float64 working buffers (fresh multi-MiB allocations cost a page fault per page)."""

    def __init__(self) -> None:
        self._a = np.empty(0, dtype=np.float64)
        self._b = np.empty(0, dtype=np.float64)
        self._bytes: list[np.ndarray] = []

    def buf(self, i: int, nbytes: int) -> np.ndarray:
        """Byte buffer ``i`` (0: A's chunk, 1: B's, 2: A's chunks read again by ``refold``), at least
        ``nbytes`` long, kept for the next chunk."""
        while len(self._bytes) <= i:
            self._bytes.append(np.empty(0, dtype=np.uint8))
        if len(self._bytes[i]) < nbytes:
            self._bytes[i] = np.empty(nbytes, dtype=np.uint8)
        return self._bytes[i]

    def f64(self, x: Chunk, y: Chunk | None = None) -> tuple[np.ndarray, np.ndarray]:
        n = len(x[0])
        if len(self._a) < n:
            self._a = np.empty(n, dtype=np.float64)
            self._b = np.empty(n, dtype=np.float64)
        a, b = self._a[:n], self._b[:n]
        np.copyto(a, floats(x))
        if y is not None:
            np.copyto(b, floats(y))
        return a, b


def _fold(
    x: Chunk, y: Chunk, exact: bool, atol: float, rtol: float, acc: Acc, work: _Work,
    bits_equal: Callable[[Chunk, Chunk], bool] = _bits_equal,
) -> None:  # fmt: skip
    """Fold one chunk pair (same length) into ``acc``."""
    if exact:
        acc.changed += int(np.count_nonzero(x[0].astype(np.int64) != y[0].astype(np.int64)))
        a, b = x[0].astype(np.float64), y[0].astype(np.float64)
        if len(a):
            _fold_finite(a, b, True, atol, rtol, acc)
        return
    if bits_equal(x, y):
        _fold_same(x, acc, work)
        return
    a, b = work.f64(x, y)
    a2, b2 = float(_dot(a, a)), float(_dot(b, b))
    if math.isfinite(a2) and math.isfinite(b2):  # then every element is finite (no float64 overflow)
        _fold_finite(a, b, False, atol, rtol, acc, a2, b2)
        return
    both = np.isfinite(a) & np.isfinite(b)
    if not both.all():
        nan_a, nan_b = np.isnan(a), np.isnan(b)
        acc.nan_a += int(np.count_nonzero(nan_a))
        acc.nan_b += int(np.count_nonzero(nan_b))
        acc.inf_a += int(np.count_nonzero(np.isinf(a)))
        acc.inf_b += int(np.count_nonzero(np.isinf(b)))
        odd = ~both
        same = (a[odd] == b[odd]) | (nan_a[odd] & nan_b[odd])
        acc.changed += int(np.count_nonzero(~same))
        a, b = a[both], b[both]
    if len(a):
        _fold_finite(a, b, False, atol, rtol, acc)


def _scan_same(x: Chunk, acc: Acc) -> bool:
    """``diff_values._scan_same``: the non-finite counts of a chunk bit-identical on both sides, and whether
    some finite element is nonzero, from one own-dtype dot product where that is finite and nonzero."""
    v, d = x
    s = float(_dot(v, v)) if d.name in ("float32", "float64") else math.nan
    if math.isfinite(s):
        acc.same2 += s
        if s > 0:
            return True
    else:
        acc.same_known = False
    f = floats(x)
    nan, inf = int(np.count_nonzero(np.isnan(f))), int(np.count_nonzero(np.isinf(f)))
    acc.same_nonfinite(nan, inf)
    return bool((f[np.isfinite(f)] if nan or inf else f).any())


def _fold_same(x: Chunk, acc: Acc, work: _Work, count: bool = True) -> None:
    """A chunk whose two sides are bit-identical: only the norms and the non-finite counts move."""
    a, _ = work.f64(x)
    s = float(_dot(a, a))
    if not math.isfinite(s):
        nan, inf = int(np.count_nonzero(np.isnan(a))), int(np.count_nonzero(np.isinf(a)))
        if count:  # else ``_scan_same`` counted them already
            acc.same_nonfinite(nan, inf)
        if nan or inf:
            a = a[np.isfinite(a)]
            s = float(_dot(a, a))
    acc.a2 += s
    acc.b2 += s
    acc.ab += s


def _fold_finite(
    a: np.ndarray, b: np.ndarray, exact: bool, atol: float, rtol: float, acc: Acc,
    a2: float | None = None, b2: float | None = None,
) -> None:  # fmt: skip
    """Fold float64 chunks of finite values in; ``a`` and ``b`` are scratch (overwritten)."""
    acc.a2 += float(_dot(a, a)) if a2 is None else a2
    acc.b2 += float(_dot(b, b)) if b2 is None else b2
    acc.ab += float(_dot(a, b))
    d = np.subtract(a, b, out=a)
    acc.d2 += float(_dot(d, d))
    np.abs(d, out=d)
    acc.max_abs = max(acc.max_abs, float(d.max()))
    bab = np.abs(b, out=b)
    if not exact:
        if atol == 0 and rtol == 0:
            acc.changed += int(np.count_nonzero(d > 0))  # d >= 0; a bool count is SIMD, a float one is not
        else:
            tol = bab * rtol + atol if rtol else atol
            acc.changed += int(np.count_nonzero(d > tol))
    top = float(np.fmax.reduce(np.divide(d, bab, out=d)))  # x/0 -> inf; 0/0 -> NaN, which fmax skips
    acc.max_rel = max(acc.max_rel, 0.0 if math.isnan(top) else top)  # only 0/0s: 0
