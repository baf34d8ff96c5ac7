"""Chunk boxes: how a DCP chunk (``offsets``, ``sizes`` in a tensor's element coordinates) maps onto zckpt's
``Piece``, and the check that a tensor's boxes tile it exactly.

A box stored row-major is, in the flattened tensor, ``prod(outer sizes)`` runs of equal length: the inner
dimensions the box spans whole fold into one run with the first dimension it cuts. FSDP's dim-0 shards are
one run (a plain piece); a box cut along inner dimensions (tensor parallelism, 2-D meshes) is one piece with
``Piece.grid`` outer loops. Replicas (the same box twice) are counted once; any other overlap, a gap or a
box outside the tensor is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from zckpt.dtypes import DType
from zckpt.errors import CorruptCheckpoint
from zckpt.formats.dcp.metadata import Chunk
from zckpt.model import Checked, Piece


def strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def box_piece(
    shape: tuple[int, ...],
    box: Chunk,
    file: str,
    byte_offset: int,
    dtype: DType,
    rank: int | None,
    check: Checked | None = None,
) -> Piece | None:
    """The piece holding ``box`` (stored contiguously, row-major, at ``byte_offset`` of ``file``); None for an
    empty box."""
    if box.numel == 0:
        return None
    st = strides(shape)
    start = sum(o * s for o, s in zip(box.offsets, st, strict=True))
    k = len(shape) - 1
    while k > 0 and box.sizes[k] == shape[k]:
        k -= 1  # dims after k are spanned whole: they fold into the run
    grid = tuple((box.sizes[j], st[j]) for j in range(max(k, 0)) if box.sizes[j] > 1)
    return Piece(file, byte_offset, dtype, start, box.numel, rank=rank, grid=grid, check=check)


def distinct(boxes: Sequence[Chunk]) -> list[Chunk]:
    """The boxes with replicas (equal offsets and sizes) and empty boxes dropped, first occurrence kept."""
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    out = []
    for b in boxes:
        if b.numel and (b.offsets, b.sizes) not in seen:
            seen.add((b.offsets, b.sizes))
            out.append(b)
    return out


def tiling_problem(shape: tuple[int, ...], boxes: Sequence[Chunk]) -> str | None:
    """Why ``boxes`` do not tile a tensor of ``shape`` exactly (replicas and empty boxes allowed), or None.

    Every box lies inside the tensor and the volumes of the distinct boxes add up to its size; then no two
    distinct boxes may overlap (a sweep along dimension 0 compares only boxes whose row ranges meet), which
    with the volume sum means every element is covered exactly once."""
    for b in boxes:
        if len(b.offsets) != len(shape) or any(
            o + s > d for o, s, d in zip(b.offsets, b.sizes, shape, strict=True)
        ):
            return f"box {list(b.offsets)}+{list(b.sizes)} lies outside the shape {list(shape)}"
    uniq = distinct(boxes)
    total, want = sum(b.numel for b in uniq), math.prod(shape)
    if not shape:
        return None if uniq or not want else "holds no chunk"
    if total != want:
        what = "leave a gap" if total < want else "overlap"
        return f"boxes {what}: they hold {total} elements, the shape {list(shape)} has {want}"
    return _overlap(uniq)


def _overlap(boxes: list[Chunk]) -> str | None:
    order = sorted(boxes, key=lambda b: b.offsets)
    active: list[Chunk] = []
    for b in order:
        active = [a for a in active if a.offsets[0] + a.sizes[0] > b.offsets[0]]
        for a in active:
            if all(
                max(x, y) < min(x + dx, y + dy)
                for x, dx, y, dy in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
            ):
                return (
                    f"boxes {list(a.offsets)}+{list(a.sizes)} and {list(b.offsets)}+{list(b.sizes)} overlap"
                )
        active.append(b)
    return None


def check_tiling(where: str, key: str, shape: tuple[int, ...], boxes: Sequence[Chunk]) -> None:
    why = tiling_problem(shape, boxes)
    if why is not None:
        raise CorruptCheckpoint(
            f"{where}: tensor {key!r:.100}: {why}",
            hint="the metadata is damaged, or files of several saves are mixed",
            path=where,
        )
