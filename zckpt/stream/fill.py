"""Positional fills: any byte range of a run of tensors' output bytes, produced on any thread.

A ``Layout`` is the byte stream a writer must produce (tensors in order, each a range of a ``TensorEntry``'s
flattened elements in an output dtype, or a run of zeros), described, not held. ``Layout.fill(dst, lo)`` puts
the stream's bytes ``[lo, lo + len(dst))`` into ``dst`` (a uint8 numpy array: no torch on this path, so a
job that needs no other tensor math never imports it): ``pread`` straight into ``dst`` where no cast is
needed (any byte range: a piece cut mid-element is fine), else the covering elements read and cast
(``zckpt.stream.cast``) in pieces of at most ``CAST_BYTES`` (into ``dst`` itself where the bytes are
element-aligned, else through a per-thread scratch). Every read is reported to the checksum session
(``zckpt.storage.checks``), so a fill checks the source's CRC-32s and digests as a sequential read does.

Because any range can be filled independently, a writer fills the blocks of an output file side by side
on several threads (``zckpt.storage.sink.HashingSink.fill``) instead of streaming chunks through one thread.
"""

from __future__ import annotations

import bisect
import functools
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from zckpt import dtypes
from zckpt.dtypes import DType
from zckpt.model import Piece, TensorEntry
from zckpt.storage import checks, fileio, objstore
from zckpt.stream.cast import cast_into
from zckpt.stream.spans import Span, spans

if TYPE_CHECKING:  # a tensor chunk for a torch writer (``Layout.chunks``); the fills need no torch
    import torch

    from zckpt.stream.items import WriteItem

CAST_BYTES = 4 << 20
"""Output bytes cast at once: the scratch a filling thread holds for a cast (source + output)."""


@dataclass(frozen=True)
class Run:
    """``n`` elements of the output stream in ``dtype`` (a torch dtype given becomes zckpt's ``DType``):
    ``entry``'s flat elements ``[lo, lo + n)``, or zeros when ``entry`` is None."""

    entry: TensorEntry | None
    lo: int
    n: int
    dtype: DType

    def __post_init__(self) -> None:
        if type(self.dtype) is not DType:
            object.__setattr__(self, "dtype", dtypes.of(self.dtype))

    @property
    def nbytes(self) -> int:
        return self.n * self.dtype.itemsize


class Layout:
    """The concatenated bytes of ``runs`` (see the module doc)."""

    def __init__(self, runs: Iterable[Run]) -> None:
        self.runs = tuple(r for r in runs if r.n > 0)
        self.starts: list[int] = []
        at = 0
        for r in self.runs:
            self.starts.append(at)
            at += r.nbytes
        self.nbytes = at

    def fill(self, dst: np.ndarray, lo: int) -> None:
        """Bytes ``[lo, lo + dst.size)`` of the stream into ``dst`` (a contiguous uint8 array)."""
        hi = lo + dst.size
        if lo < 0 or hi > self.nbytes:
            raise ValueError(f"bytes [{lo}, {hi}) outside a layout of {self.nbytes}")
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        while lo < hi:
            r, start = self.runs[i], self.starts[i]
            end = min(hi, start + r.nbytes)
            _fill_run(r, dst[: end - lo], lo - start)
            dst = dst[end - lo :]
            lo = end
            i += 1

    @functools.cached_property
    def remote(self) -> bool:
        """Some of the bytes come from an object store (reads worth announcing: ``fileio.expect``)."""
        return any(
            objstore.is_url(p.file)
            for r in self.runs
            if r.entry is not None
            for p in r.entry.pieces
            if p.value is None
        )

    def sources(self, lo: int, hi: int) -> Iterator[Span]:
        """The spans of stored pieces that stream bytes ``[lo, hi)`` are read from, in order."""
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        while lo < hi and i < len(self.runs):
            r, start = self.runs[i], self.starts[i]
            end = min(hi, start + r.nbytes)
            if r.entry is not None:
                isz = r.dtype.itemsize
                for s in spans(r.entry, r.lo + (lo - start) // isz, r.lo - (-(end - start) // isz)):
                    if s.piece.value is None:
                        yield s
            lo = end
            i += 1

    def chunks(self, max_bytes: int) -> Iterator[torch.Tensor]:
        """The stream in order, as owned uint8 tensors of at most ``max_bytes`` (for a plain sink)."""
        import torch

        for lo in range(0, self.nbytes, max_bytes):
            t = torch.empty(min(max_bytes, self.nbytes - lo), dtype=torch.uint8)
            self.fill(t.numpy(), lo)
            yield t


def layout_of_items(items: Sequence[WriteItem]) -> Layout:
    """The layout of ``WriteItem``s written in order (each its range, then its padding)."""
    runs: list[Run] = []
    for it in items:
        a, b = it.range
        dt = dtypes.of(it.dtype)
        runs.append(Run(it.entry, a, b - a, dt))
        runs.append(Run(None, 0, it.pad, dt))
    return Layout(runs)


_scratch = threading.local()


def _scratch_bytes(slot: str, nbytes: int) -> np.ndarray:
    """A per-thread uint8 buffer of at least ``nbytes`` (grown, never shrunk)."""
    t = getattr(_scratch, slot, None)
    if t is None or t.size < nbytes:
        t = np.empty(nbytes, dtype=np.uint8)
        setattr(_scratch, slot, t)
    return t[:nbytes]


def _inline_bytes(p: Piece, offset: int, n: int) -> np.ndarray:
    """The bytes of elements ``[offset, offset + n)`` of an in-memory piece: a Python number where numpy has
    its dtype without torch (readers keep scalars so), else through the tensor (``Piece.inline``)."""
    v, isz = p.value, p.dtype.itemsize
    if isinstance(v, (bool, int, float)) and p.dtype.numpy is not None:
        return np.array([v], dtype=p.dtype.numpy).view(np.uint8)[offset * isz : (offset + n) * isz]
    import torch

    t = p.inline().reshape(-1)[offset : offset + n].contiguous().cpu()
    return t.view(torch.uint8).numpy()


def _fill_run(r: Run, dst: np.ndarray, a: int) -> None:
    """Bytes ``[a, a + len(dst))`` of run ``r``'s output into ``dst``."""
    if r.entry is None:
        dst[:] = 0
        return
    isz = r.dtype.itemsize
    b = a + dst.size
    e0, e1 = a // isz, -(-b // isz)
    cast = any(p.dtype != r.dtype for p in r.entry.pieces)
    step = max(1, CAST_BYTES // max(isz, max(p.dtype.itemsize for p in r.entry.pieces))) if cast else None
    for s in spans(r.entry, r.lo + e0, r.lo + e1, step):
        x = max(a, (s.lo - r.lo) * isz)  # the span's output bytes, clipped to [a, b)
        y = min(b, (s.lo - r.lo + s.n) * isz)
        _fill_span(s, r.lo, r.dtype, dst[x - a : y - a], x)


def _fill_span(s: Span, run_lo: int, dtype: DType, dst: np.ndarray, x: int) -> None:
    """Output bytes ``[x, x + len(dst))`` (counted from the run's start) of span ``s`` into ``dst``."""
    p, isz = s.piece, dtype.itemsize
    skip = x - (s.lo - run_lo) * isz  # bytes of the span's output before ``x``
    if p.dtype == dtype:  # no cast: the bytes themselves, whatever the cut
        if p.value is not None:
            dst[:] = _inline_bytes(p, s.offset, s.n)[skip : skip + dst.size]
            return
        at = s.byte_offset + skip
        fileio.read_into(p.file, at, dst, checks.record_end(p))
        checks.consumed(p.check, at, dst)
        return
    k0, k1 = skip // isz, -(-(skip + dst.size) // isz)  # the span's elements the bytes lie in
    n = k1 - k0
    if p.value is not None:
        src = _inline_bytes(p, s.offset + k0, n)
    else:
        src = _scratch_bytes("raw", n * p.dtype.itemsize)
        at = s.byte_offset + k0 * p.dtype.itemsize
        fileio.read_into(p.file, at, src, checks.record_end(p))
        checks.consumed(p.check, at, src)
    head = skip - k0 * isz
    if head == 0 and dst.size == n * isz and dst.ctypes.data % isz == 0:
        cast_into(dst, dtype, src, p.dtype)  # element-aligned: cast straight into the output
        return
    out = _scratch_bytes("cast", n * isz)
    cast_into(out, dtype, src, p.dtype)
    dst[:] = out[head : head + dst.size]


__all__ = ["CAST_BYTES", "Layout", "Run", "layout_of_items"]
