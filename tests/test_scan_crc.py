"""``zckpt.storage.scan.crc_ranges``: the CRC-32 of each byte range, small ranges close together read and
summed by one task (a large world's rank files hold hundreds of small zip records). Oracle: ``zlib.crc32``
of the same slices of the file's bytes."""

from __future__ import annotations

import random
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from zckpt.storage import scan


def _ranges(size: int, rng: random.Random) -> list[tuple[int, int]]:
    """Adjacent small records, small ones a gap apart, a large one, an empty one, one out of order."""
    out, at = [], 0
    for _ in range(40):
        n = rng.choice([0, 1, 7, 64, 4096, 300_000])
        out.append((at, n))
        at += n + rng.choice([0, 0, 0, 63, 70_000])  # mostly back to back, some beyond the grouping gap
    out.append((at, 3 * scan.SMALL_BYTES + 5))  # large: its own pieces
    at += 3 * scan.SMALL_BYTES + 5
    out += [(at, 10), (at + 10, 20), (5, 100)]  # small after a large, then one going backwards
    assert at + 30 <= size
    return out


def test_crc_ranges_match_zlib(tmp_path: Path) -> None:
    rng = random.Random(7)
    data = rng.randbytes(16 << 20)
    f = tmp_path / "blob"
    f.write_bytes(data)
    ranges = _ranges(len(data), rng)
    groups = scan._small_runs(ranges)
    assert sorted(i for g in groups for i in g) == list(range(len(ranges)))
    assert any(len(g) > 5 for g in groups), groups  # the grouping is exercised
    with ThreadPoolExecutor(3) as pool:
        got = scan.crc_ranges(f, ranges, pool)
    assert got == [zlib.crc32(data[s : s + n]) for s, n in ranges]


def test_crc_ranges_past_the_end_is_eoferror(tmp_path: Path) -> None:
    f = tmp_path / "short"
    f.write_bytes(b"x" * 1000)
    with ThreadPoolExecutor(2) as pool, pytest.raises(EOFError):
        scan.crc_ranges(f, [(0, 10), (10, 10), (20, 2000)], pool)
