"""CRC-32s of a file's byte ranges computed once for two checks of the same bytes: ``verify`` of a torch zip
file zckpt wrote (a DeepSpeed or torch checkpoint out of ``zckpt reshard``) compares each zip record's CRC-32
and, from its ``.crc32.json``, each block's. ``CrcPieces`` cuts the records' ranges at the block boundaries
(``cut_at``), CRCs the bytes between them in the same pass (zip headers: read with their neighbours
anyway), keeps each piece's CRC-32, and answers the records (``ranges``) and then the blocks (``blocks``) from
them with ``crc32_combine``: only the tail after the last record (the zip directory) is read for the blocks,
so each byte is read and CRC'd once, not twice."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from zckpt.storage.checks import crc32_combine
from zckpt.storage.location import Location
from zckpt.storage.scan import Segment

Compute = Callable[[Location, list[tuple[int, int]]], list[int]]
"""The CRC-32 of each ``(start, size)`` range of a file (``VerifyContext``'s scan threads)."""
Segments = Callable[[Location, list[tuple[int, int]], int], list[list[Segment]]]
"""The same, each range's in segments cut at the multiples of an edge (``scan.crc_segments``)."""


MIN_BLOCK = 1 << 20
"""The smallest block whose pieces are kept: a sidecar of tiny blocks (zckpt writes 16 MiB ones) would keep
a piece per block in memory."""


class CrcPieces:
    """The piece CRCs of one verify run's files, kept from the records' check to the blocks' (see the module
    doc). Thread-safe: files are checked side by side."""

    def __init__(self, compute: Compute, segments: Segments) -> None:
        self._compute = compute  # ranges of a file not cut at blocks
        self._segments = segments
        self._lock = threading.Lock()
        self._block: dict[str, int] = {}
        self._pieces: dict[str, dict[int, tuple[int, int]]] = {}  # file -> start -> (end, crc)

    def cut_at(self, f: Location, block: int) -> None:
        """``f``'s blocks of ``block`` bytes are checked after its ranges: cut the ranges there, keep them
        (blocks under ``MIN_BLOCK``: not kept, read whole as before)."""
        if block >= MIN_BLOCK:
            with self._lock:
                self._block[str(f)] = block

    def ranges(self, f: Location, ranges: Sequence[tuple[int, int]]) -> list[int]:
        """The CRC-32 of each ``(start, size)`` range of ``f`` (a short file: ``EOFError``). Cut at blocks
        (``cut_at``), the bytes between the ranges are CRC'd in the same pass and kept too: read with their
        neighbours anyway (``zckpt.storage.scan`` reads small ranges close together in one ``pread``)."""
        block = self._block.get(str(f))
        order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
        ends = [ranges[i][0] + ranges[i][1] for i in order]
        if block is None or any(ranges[i][0] < e for i, e in zip(order[1:], ends, strict=False)):
            return self._compute(f, list(ranges))  # not planned, or ranges that overlap: nothing kept
        parts: list[tuple[int, int]] = []
        owner: list[int] = []  # the range each part is; -1: the bytes between two ranges
        pos = 0
        for i in order:
            start, size = ranges[i]
            if start > pos:
                parts.append((pos, start - pos))
                owner.append(-1)
            parts.append((start, size))
            owner.append(i)
            pos = max(pos, start + size)
        got = self._segments(f, parts, block)
        with self._lock:
            kept = self._pieces.setdefault(str(f), {})
            for segs in got:
                for a, n, c in segs:
                    kept[a] = (a + n, c)
        out = [0] * len(ranges)
        for segs, who in zip(got, owner, strict=True):
            if who >= 0:
                for _, n, c in segs:
                    out[who] = crc32_combine(out[who], c, n)
        return out

    def blocks(self, f: Location, block: int, size: int) -> list[str] | None:
        """Each ``block``-byte block's CRC-32 (8 hex digits) of the first ``size`` bytes of ``f``, from the
        pieces kept plus the bytes they miss (read now: the tail; a short file: ``EOFError``); None when ``f``
        was not cut at ``block`` (its blocks are then read whole by the caller). The pieces are dropped."""
        with self._lock:
            planned = self._block.pop(str(f), None)
            kept = self._pieces.pop(str(f), {})
        if planned != block or block <= 0:
            return None
        segs: list[Segment] = []
        gaps: list[tuple[int, int]] = []  # the bytes no kept piece covers: read now
        pos = 0
        for a, (e, c) in sorted(kept.items()):
            if a < pos or e > size:
                continue  # overlaps a piece taken already (or lies past the end): its bytes are read instead
            if a > pos:
                gaps.append((pos, a - pos))
            segs.append((a, e - a, c))
            pos = e
        if pos < size:
            gaps.append((pos, size - pos))
        if gaps:
            segs += [seg for got in self._segments(f, gaps, block) for seg in got]
        out = [0] * (-(-size // block) if size else 0)
        for a, n, c in sorted(segs):
            out[a // block] = crc32_combine(out[a // block], c, n)
        return [f"{x:08x}" for x in out]
