"""Reading logical tensors: the one place that turns a range of a tensor's flattened elements into byte reads.

``spans(entry, lo, hi, max_elems)`` lists the pieces' runs overlapping ``[lo, hi)`` in logical order (box
pieces interleave: their runs are merged), each cut to at most ``max_elems``; every reader below is built on
it, so one chunk size (``CHUNK_BYTES``) and one code path serve consolidate, reshard, diff, stats, verify
and the engine's load:

- ``read_range`` / ``read_entry``: an owned copy of ``[lo, hi)`` / the whole tensor, bytes fetched with
  ``pread`` straight into the output when the dtypes match (nothing stays in the process's memory);
- ``iter_chunks``: the tensor in order, one bounded chunk at a time (a writer's input);
- ``aligned_views``: two same-size tensors side by side, one bounded chunk of each at a time, cut on both
  sides' run boundaries (``diff``); ``aligned_spans``: the same steps, for a reader that reads the bytes
  itself (``diff``'s numpy comparison).

Every byte is read with ``pread`` (``fileio.read_into``), none through a mapping of the file: a file shortened
by another process while it is read is an error naming it, never a ``SIGBUS`` that ends the process.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zckpt.dtypes import DType, torch_of
from zckpt.model import Piece, TensorEntry
from zckpt.storage import checks, fileio

if TYPE_CHECKING:  # imported by the readers that build tensors; ``spans`` (fills, diff_numpy) needs none
    import torch

CHUNK_BYTES = 16 << 20
"""Bytes held per chunk when streaming a tensor: large enough for sequential I/O, small enough to keep a
few in flight."""


@dataclass(frozen=True)
class Span:
    """``n`` elements of one piece: logical ``[lo, lo + n)``, at element ``offset`` of the piece's storage."""

    piece: Piece
    lo: int
    n: int
    offset: int

    @property
    def byte_offset(self) -> int:
        return self.piece.byte_offset + self.offset * self.piece.dtype.itemsize


def spans(
    entry: TensorEntry, lo: int = 0, hi: int | None = None, max_elems: int | None = None
) -> Iterator[Span]:
    """The runs of ``entry``'s pieces overlapping logical ``[lo, hi)``, in logical order, clipped to the range
    and cut into spans of at most ``max_elems`` elements."""
    hi = entry.numel if hi is None else hi
    if not 0 <= lo <= hi <= entry.numel:
        raise ValueError(f"{entry.key}: range [{lo}, {hi}) outside {entry.numel} elements")
    pieces = [p for p in entry.pieces if p.numel]
    if any(p.grid for p in pieces):
        streams = [_tagged(p.runs(lo, hi), i) for i, p in enumerate(pieces)]
        runs: Iterator[tuple[int, int, int, int]] = heapq.merge(*streams)
    else:
        runs = ((a, off, n, i) for i, p in sorted(enumerate(pieces), key=lambda ip: ip[1].start)
                for a, off, n in p.runs(lo, hi))  # fmt: skip
    step = max_elems or hi - lo or 1
    for a, off, n, i in runs:
        for k in range(0, n, step):
            yield Span(pieces[i], a + k, min(step, n - k), off + k)


def _tagged(runs: Iterator[tuple[int, int, int]], i: int) -> Iterator[tuple[int, int, int, int]]:
    """The runs of piece ``i``, each tagged with ``i`` (a function: a generator expression would bind the
    index late, after the loop, and tag every run with the last piece)."""
    for a, off, n in runs:
        yield a, off, n, i


def copy_span(s: Span, out: torch.Tensor) -> None:
    """The span's elements into ``out`` (1-D, ``s.n`` elements, any dtype: cast on the way)."""
    import torch

    p = s.piece
    if p.value is not None:
        out.copy_(p.inline().reshape(-1)[s.offset : s.offset + s.n])
    elif out.dtype == p.dtype and out.is_contiguous():
        fileio.read_into(p.file, s.byte_offset, out, checks.record_end(p))
        checks.consumed(p.check, s.byte_offset, out)
    else:
        tmp = torch.empty(s.n, dtype=p.dtype.torch)
        fileio.read_into(p.file, s.byte_offset, tmp, checks.record_end(p))
        checks.consumed(p.check, s.byte_offset, tmp)
        out.copy_(tmp)


def _read(
    entry: TensorEntry, lo: int, hi: int, dtype: DType | torch.dtype | None, out: torch.Tensor | None
) -> torch.Tensor:
    import torch

    if out is None:
        out = torch.empty(hi - lo, dtype=torch_of(entry.dtype if dtype is None else dtype))
    for s in spans(entry, lo, hi):
        copy_span(s, out[s.lo - lo : s.lo - lo + s.n])
    return out


def read_range(
    entry: TensorEntry,
    lo: int,
    hi: int,
    dtype: DType | torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flattened elements ``[lo, hi)`` of ``entry`` (an owned copy, cast to ``dtype``), reading only the
    overlapping bytes of the overlapping pieces."""
    return _read(entry, lo, hi, dtype, out)


def read_entry(entry: TensorEntry, dtype: DType | torch.dtype | None = None) -> torch.Tensor:
    """The whole logical tensor, in its shape, cast to ``dtype`` (default: the entry's)."""
    return _read(entry, 0, entry.numel, dtype, None).view(entry.shape)


def windows(lo: int, hi: int, max_elems: int) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` cut into consecutive ranges of at most ``max_elems``."""
    for a in range(lo, hi, max(1, max_elems)):
        yield a, min(hi, a + max(1, max_elems))


def iter_chunks(
    entry: TensorEntry, dtype: DType | torch.dtype | None = None, max_bytes: int = CHUNK_BYTES, lo: int = 0,
    hi: int | None = None,
) -> Iterator[torch.Tensor]:  # fmt: skip
    """Elements ``[lo, hi)`` of ``entry`` in order as owned 1-D tensors of at most ``max_bytes``, cast to
    ``dtype``: memory stays bounded by one chunk whatever the tensor size."""
    want = entry.dtype if dtype is None else dtype
    step = max(1, max_bytes // max(entry.dtype.itemsize, want.itemsize))
    for a, b in windows(lo, entry.numel if hi is None else hi, step):
        yield _read(entry, a, b, want, None)


def aligned_views(
    a: TensorEntry, b: TensorEntry, max_elems: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Aligned chunks of two same-size entries, ``(A's elements [lo, hi), B's elements [lo, hi))``, in each
    entry's dtype, at most ``max_elems`` per chunk, each an owned copy read with ``pread``.

    Chunk boundaries include every span boundary of both sides (``aligned_spans``), so each chunk lies inside
    one span per side and is one read (then a cast only when a stored dtype differs from its entry's)."""
    for x, y, lo, hi in aligned_spans(a, b, max_elems):
        yield _chunk(x, lo, hi, a.dtype), _chunk(y, lo, hi, b.dtype)


def aligned_spans(a: TensorEntry, b: TensorEntry, max_elems: int) -> Iterator[tuple[Span, Span, int, int]]:
    """``aligned_views``'s steps without reading: ``(A's span, B's span, lo, hi)``, each ``[lo, hi)`` inside
    both spans, at most ``max_elems`` long."""
    if a.numel != b.numel:
        raise ValueError(f"{a.key} has {a.numel} elements, {b.key} has {b.numel}")
    sa, sb = spans(a, max_elems=max_elems), spans(b, max_elems=max_elems)
    x, y = next(sa, None), next(sb, None)
    while x is not None and y is not None:
        lo = max(x.lo, y.lo)
        hi = min(x.lo + x.n, y.lo + y.n)
        yield x, y, lo, hi
        if x.lo + x.n == hi:
            x = next(sa, None)
        if y.lo + y.n == hi:
            y = next(sb, None)


def _chunk(s: Span, lo: int, hi: int, dtype: DType | torch.dtype) -> torch.Tensor:
    p, skip = s.piece, s.offset + lo - s.lo
    if p.value is not None:
        v = p.inline().reshape(-1)[skip : skip + hi - lo]
    else:
        import torch

        at = p.byte_offset + skip * p.dtype.itemsize
        v = torch.empty(hi - lo, dtype=p.dtype.torch)
        fileio.read_into(p.file, at, v)
        checks.consumed(p.check, at, v)
    return v if v.dtype == dtype else v.to(torch_of(dtype))
