"""Flat tensors described, not held: ranges of logical tensors read lazily, for writers that reshard.

A ``FlatSource`` is a 1-D tensor to be written, defined as a concatenation of ``Segment``s — a range
``[lo, hi)`` of one ``TensorEntry``'s flattened elements, or a run of zeros (padding). Its bytes come
out in bounded chunks (``chunks``), each read only from the pieces that overlap it (``zckpt.stream.spans``),
so a writer never holds more than one chunk of one tensor. ``read_partition`` is rank ``r``'s ZeRO-3 chunk of
any tensor at any world size (load-time reshard reads only that rank's bytes).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from zckpt import dtypes, partition
from zckpt.model import TensorEntry
from zckpt.stream.fill import Layout, Run
from zckpt.stream.spans import CHUNK_BYTES, read_range, windows


def read_partition(
    entry: TensorEntry, world: int, rank: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``rank``'s ZeRO-3 partition of ``entry`` at world size ``world``: ``ceil(n/world)`` elements,
    trailing padding zeroed. Works whatever the world size (or layout) the entry was saved with."""
    start, valid = partition.chunk_range(entry.numel, world, rank)
    c = partition.chunk_size(entry.numel, world)
    out = torch.zeros(c, dtype=entry.dtype.torch if dtype is None else dtype)
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

    def layout(self) -> Layout:
        """The bytes of the tensor, for positional fills (``zckpt.stream.pipeline.fill``)."""
        return Layout(Run(s.entry, s.lo, s.numel, dtypes.of(self.dtype)) for s in self.segments)

    def chunks(self, max_bytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
        step = max(1, max_bytes // max(self.dtype.itemsize, 1))
        for s in self.segments:
            for lo, hi in windows(s.lo, s.hi, step):
                if s.entry is None:
                    yield torch.zeros(hi - lo, dtype=self.dtype)
                else:
                    yield read_range(s.entry, lo, hi, self.dtype)


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
    return source(entry.dtype.torch if dtype is None else dtype, [Segment(entry, 0, entry.numel)])


def chunk_of(entry: TensorEntry, world: int, rank: int, dtype: torch.dtype | None = None) -> FlatSource:
    """Lazy ``read_partition``: ``rank``'s padded ZeRO-3 chunk at ``world``."""
    start, valid = partition.chunk_range(entry.numel, world, rank)
    c = partition.chunk_size(entry.numel, world)
    return source(
        entry.dtype.torch if dtype is None else dtype,
        [Segment(entry, start, start + valid), Segment(None, 0, c - valid)],
    )
