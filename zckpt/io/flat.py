"""Flat tensors described, not held: ranges of logical tensors read lazily, for writers that reshard.

A ``FlatSource`` is a 1-D tensor to be written, defined as a concatenation of ``Segment``s — a range
``[lo, hi)`` of one ``TensorEntry``'s flattened elements, or a run of zeros (padding). Its bytes come
out in bounded chunks (``chunks``), each read only from the pieces that overlap it, so a writer never
holds more than one chunk of one tensor. ``read_range`` / ``read_partition`` are the primitives
(also used by the engine for load-time reshard: each rank reads only the bytes of its own partition).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from zckpt import partition
from zckpt.io import storage
from zckpt.model import TensorEntry

CHUNK_BYTES = 64 << 20


def read_range(
    entry: TensorEntry, lo: int, hi: int, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Flattened elements ``[lo, hi)`` of ``entry`` (an owned copy, cast to ``dtype``), reading only
    the overlapping bytes of the overlapping pieces."""
    if not 0 <= lo <= hi <= entry.numel:
        raise ValueError(f"{entry.key}: range [{lo}, {hi}) outside {entry.numel} elements")
    want = entry.dtype if dtype is None else dtype
    if out is None:
        out = torch.empty(hi - lo, dtype=want)
    for p in entry.pieces:
        a, b = max(lo, p.start), min(hi, p.start + p.numel)
        if b > a:
            storage.copy_piece(p, a - p.start, b - p.start, out[a - lo : b - lo])
    return out


def read_partition(
    entry: TensorEntry, world: int, rank: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``rank``'s ZeRO-3 partition of ``entry`` at world size ``world``: ``ceil(n/world)`` elements,
    trailing padding zeroed. Works whatever the world size (or layout) the entry was saved with."""
    start, valid = partition.chunk_range(entry.numel, world, rank)
    c = partition.chunk_size(entry.numel, world)
    out = torch.zeros(c, dtype=entry.dtype if dtype is None else dtype)
    if valid:
        read_range(entry, start, start + valid, out=out[:valid])
    return out


@dataclass(frozen=True)
class Segment:
    """``entry``'s flat elements ``[lo, hi)``; ``entry=None`` means ``hi - lo`` zeros."""

    entry: TensorEntry | None
    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class FlatSource:
    """A 1-D tensor of ``dtype`` made of segments, produced chunk by chunk."""

    dtype: torch.dtype
    segments: tuple[Segment, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.segments)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def chunks(self, max_bytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
        step = max(1, max_bytes // max(self.dtype.itemsize, 1))
        for s in self.segments:
            for lo in range(s.lo, s.hi, step):
                hi = min(s.hi, lo + step)
                if s.entry is None:
                    yield torch.zeros(hi - lo, dtype=self.dtype)
                else:
                    yield read_range(s.entry, lo, hi, self.dtype)

    def materialize(self) -> torch.Tensor:
        out = torch.empty(self.numel, dtype=self.dtype)
        pos = 0
        for c in self.chunks():
            out[pos : pos + c.numel()] = c
            pos += c.numel()
        return out


def source(dtype: torch.dtype, segments: Sequence[Segment]) -> FlatSource:
    """A ``FlatSource`` with empty segments dropped and adjacent zero runs merged."""
    out: list[Segment] = []
    for s in segments:
        if s.numel <= 0:
            continue
        if out and s.entry is None and out[-1].entry is None:
            out[-1] = Segment(None, 0, out[-1].numel + s.numel)
        else:
            out.append(s)
    return FlatSource(dtype, tuple(out))


def whole(entry: TensorEntry, dtype: torch.dtype | None = None) -> FlatSource:
    return source(entry.dtype if dtype is None else dtype, [Segment(entry, 0, entry.numel)])


def chunk_of(entry: TensorEntry, world: int, rank: int, dtype: torch.dtype | None = None) -> FlatSource:
    """Lazy ``read_partition``: ``rank``'s padded ZeRO-3 chunk at ``world``."""
    start, valid = partition.chunk_range(entry.numel, world, rank)
    c = partition.chunk_size(entry.numel, world)
    return source(
        entry.dtype if dtype is None else dtype,
        [Segment(entry, start, start + valid), Segment(None, 0, c - valid)],
    )


def slice_entry(entry: TensorEntry, lo: int, hi: int, pad: int = 0, name: str | None = None) -> TensorEntry:
    """A 1-D ``TensorEntry`` over ``entry``'s flat elements ``[lo, hi)`` followed by ``pad`` zeros: pieces
    point into the same files (nothing is read here), so any writer that streams entries can write it."""
    from zckpt.model import Piece

    pieces: list[Piece] = []
    for p in sorted(entry.pieces, key=lambda p: p.start):
        a, b = max(lo, p.start), min(hi, p.start + p.numel)
        if b <= a:
            continue
        skip = a - p.start
        if p.value is not None:
            pieces.append(
                Piece("", 0, p.dtype, a - lo, b - a, p.rank, value=p.value.reshape(-1)[skip : skip + b - a])
            )
        else:
            pieces.append(
                Piece(p.file, p.byte_offset + skip * p.dtype.itemsize, p.dtype, a - lo, b - a, p.rank)
            )
    if pad:
        pieces.append(Piece("", 0, entry.dtype, hi - lo, pad, value=torch.zeros(pad, dtype=entry.dtype)))
    return TensorEntry(
        name or entry.name, (hi - lo + pad,), entry.dtype, entry.role, tuple(pieces), entry.state
    )
