"""Partition and padding math shared by the readers, the writers and the engine. Pure functions only.

Vocabulary: a *flat* tensor is a 1-D concatenation of tensors; a *partition* is the slice of a flat
tensor that one rank owns; *padding* are trailing elements that belong to no tensor.

ZeRO-3 (and the native engine format) partitions every tensor on its own: rank r holds elements
``[r*c, r*c + c)`` with ``c = ceil(numel / world)``; the last rank(s) hold padding.
ZeRO-1/2 partition a whole param group: the group is padded to a multiple of ``align`` and split
into ``world`` equal slices.
"""

from __future__ import annotations

from dataclasses import dataclass


def ceil_div(a: int, b: int) -> int:
    if b <= 0:
        raise ValueError(f"divisor must be positive, got {b}")
    return -(-a // b)


def pad_to(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= n."""
    return ceil_div(n, multiple) * multiple


def chunk_size(numel: int, world: int) -> int:
    """Per-rank partition length of one tensor partitioned ZeRO-3 style (padding included)."""
    return ceil_div(numel, world)


def chunk_range(numel: int, world: int, rank: int) -> tuple[int, int]:
    """(start, valid length) of ``rank``'s ZeRO-3 partition within the flattened tensor.

    The valid length is ``chunk_size`` except on the trailing ranks, where it may shrink to 0.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world {world}")
    c = chunk_size(numel, world)
    start = rank * c
    return min(start, numel), max(0, min(c, numel - start))


def chunk_padding(numel: int, world: int, rank: int) -> int:
    """Padding elements at the end of ``rank``'s ZeRO-3 partition."""
    return chunk_size(numel, world) - chunk_range(numel, world, rank)[1]


def group_partition_size(total: int, world: int, align: int | None = None) -> int:
    """Per-rank slice length of a ZeRO-1/2 flat group of ``total`` elements (padding included).

    DeepSpeed pads each group to a multiple of ``2 * world`` (``nccl_start_alignment_factor`` 2).
    """
    a = 2 * world if align is None else align
    return pad_to(total, a) // world


@dataclass(frozen=True)
class Overlap:
    """Part of a segment that falls in one partition."""

    rank: int
    offset_in_partition: int
    offset_in_segment: int
    length: int


def overlaps(seg_start: int, seg_len: int, part_size: int, world: int) -> list[Overlap]:
    """Split the flat range ``[seg_start, seg_start + seg_len)`` over equal partitions of ``part_size``.

    Used for ZeRO-1/2 groups, where a param may straddle rank boundaries. Empty partitions and
    zero-length segments produce no overlaps.
    """
    out: list[Overlap] = []
    if seg_len <= 0 or part_size <= 0:
        return out
    end = seg_start + seg_len
    first = seg_start // part_size
    last = min(world - 1, (end - 1) // part_size)
    for r in range(first, last + 1):
        lo = max(seg_start, r * part_size)
        hi = min(end, (r + 1) * part_size)
        if hi > lo:
            out.append(Overlap(r, lo - r * part_size, lo - seg_start, hi - lo))
    if sum(o.length for o in out) != seg_len:
        raise ValueError(
            f"segment [{seg_start}, {end}) does not fit {world} partitions of {part_size} elements"
        )
    return out


def reshard_chunks(numel: int, src_world: int, dst_world: int, dst_rank: int) -> list[Overlap]:
    """Which source ZeRO-3 partitions hold ``dst_rank``'s new partition, as overlaps of the source.

    Offsets in the result: ``offset_in_partition`` inside the *source* rank's chunk,
    ``offset_in_segment`` inside the *destination* chunk.
    """
    start, length = chunk_range(numel, dst_world, dst_rank)
    return overlaps(start, length, chunk_size(numel, src_world), src_world)
