"""Pieces of a part of a tensor: new logical tensors made of element ranges of stored ones, no bytes read.

Everything Megatron-specific that renames or splits a tensor (one layer of a stacked ``[L, ...]`` tensor, a
parameter's shard inside a distributed-optimizer flat bucket, Hugging Face's q/k/v out of Megatron's fused
QKV, the true vocab rows of a padded embedding) is a map from ranges of the source's flattened elements to
ranges of the target's. ``select`` turns a source's pieces and such a map into the target's pieces, each
pointing at the same bytes in the same files (a box piece's runs are cut where the ranges cut them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from zckpt.model import Piece


@dataclass(frozen=True)
class Span:
    """``length`` source elements from ``src`` become target elements from ``dst``."""

    src: int
    length: int
    dst: int


def select(pieces: Iterable[Piece], spans: Sequence[Span]) -> tuple[Piece, ...]:
    """The target's pieces: every stored run of ``pieces`` that a span covers, moved to the target's place."""
    out: list[Piece] = []
    ps = list(pieces)
    for s in spans:
        lo, hi = s.src, s.src + s.length
        for p in ps:
            if p.value is not None:  # an in-memory value: cut it
                flat = p.inline().reshape(-1)
                a, b = max(lo, p.start), min(hi, p.start + p.numel)
                if b > a:
                    v = flat[a - p.start : b - p.start]
                    out.append(Piece("", 0, p.dtype, s.dst + a - lo, b - a, value=v))
                continue
            for at, off, n in p.runs(lo, hi):
                out.append(
                    Piece(
                        p.file, p.byte_offset + off * p.dtype.itemsize, p.dtype, s.dst + at - lo, n,
                        rank=p.rank, check=p.check,
                    )
                )  # fmt: skip
    return tuple(out)


def rows(pieces: Iterable[Piece], row: int, ranges: Sequence[tuple[int, int]]) -> tuple[Piece, ...]:
    """Rows ``[a, b)`` of each range (rows of ``row`` elements), stacked in order, as the target's pieces."""
    spans, at = [], 0
    for a, b in ranges:
        spans.append(Span(a * row, (b - a) * row, at))
        at += (b - a) * row
    return select(pieces, spans)
