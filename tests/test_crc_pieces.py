"""One read for two checks of the same bytes (``zckpt.storage.crc_pieces``): ``verify`` of a torch zip file
zckpt wrote computes its records' CRC-32s and its ``.crc32.json`` block CRC-32s from one read of each byte;
the answers equal zlib's over the file's bytes, and damage inside a record or between records is found."""

from __future__ import annotations

import itertools
import random
import zipfile
import zlib
from collections import Counter
from pathlib import Path

import pytest
from _damage import flip_byte
from _fixtures import fixture

import zckpt
from zckpt.formats.deepspeed import archive
from zckpt.storage import crc_pieces, fileio
from zckpt.storage.crc_pieces import CrcPieces
from zckpt.storage.location import Location


def _pieces_over(raw: bytes, read: list[tuple[int, int]]) -> CrcPieces:
    """``CrcPieces`` over ``raw`` (zlib's CRCs, the oracle), noting each range read."""

    def compute(f: Location, ranges: list[tuple[int, int]]) -> list[int]:
        return [s[0][2] if s else 0 for s in segments(f, ranges, len(raw) + 1)]

    def segments(f: Location, ranges: list[tuple[int, int]], edge: int) -> list[list[tuple[int, int, int]]]:
        out = []
        for a, n in ranges:
            if a + n > len(raw):
                raise EOFError(f"file ends at byte {len(raw)}")
            read.append((a, n))
            cuts = [a, *range((a // edge + 1) * edge, a + n, edge), a + n] if n else []
            out.append([(x, y - x, zlib.crc32(raw[x:y])) for x, y in itertools.pairwise(cuts)])
        return out

    return CrcPieces(compute, segments)


@pytest.mark.parametrize("seed", range(6))
def test_records_and_blocks_equal_zlib_and_blocks_read_only_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    rng = random.Random(seed)
    raw = rng.randbytes(rng.randrange(200_000, 400_000))
    block = rng.choice([4096, 65536, 100_000])
    monkeypatch.setattr(crc_pieces, "MIN_BLOCK", 1)
    f = tmp_path / "x.pt"
    cuts = sorted(rng.sample(range(len(raw)), 40))
    records = [(a, b - a) for a, b in zip(cuts[::2], cuts[1::2], strict=True)]  # disjoint, gaps between
    records.append((cuts[-1], 0))  # an empty record
    read: list[tuple[int, int]] = []
    pieces = _pieces_over(raw, read)
    pieces.cut_at(f, block)
    got = pieces.ranges(f, records)
    assert got == [zlib.crc32(raw[a : a + n]) for a, n in records]
    blocks = pieces.blocks(f, block, len(raw))
    assert blocks == [f"{zlib.crc32(raw[a : a + block]):08x}" for a in range(0, len(raw), block)]
    assert sorted(read) == sorted(set(read))  # no byte read twice...
    assert sum(n for _, n in read) == len(raw)  # ...and every byte once
    assert pieces.blocks(f, block, len(raw)) is None  # the pieces are gone once used


def test_overlapping_ranges_and_another_block_size_still_equal_zlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(crc_pieces, "MIN_BLOCK", 1)
    raw = random.Random(7).randbytes(50_000)
    f = tmp_path / "x.pt"
    read: list[tuple[int, int]] = []
    pieces = _pieces_over(raw, read)
    pieces.cut_at(f, 8192)
    pieces.ranges(f, [(100, 20_000), (15_000, 10_000), (30_000, 19_000)])  # the second overlaps the first
    assert pieces.blocks(f, 8192, len(raw)) == [
        f"{zlib.crc32(raw[a : a + 8192]):08x}" for a in range(0, len(raw), 8192)
    ]
    pieces.cut_at(f, 8192)
    pieces.ranges(f, [(0, 10_000)])
    assert pieces.blocks(f, 4096, len(raw)) is None  # cut at other blocks: the caller reads them whole
    with pytest.raises(EOFError):  # the file is shorter than the size the sidecar records
        pieces.cut_at(f, 8192)
        pieces.ranges(f, [(0, 10_000)])
        pieces.blocks(f, 8192, len(raw) + 5000)


@pytest.fixture
def resharded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A real DeepSpeed ZeRO-3 save resharded by zckpt to world 4: torch zip rank files with ``.crc32.json``
    sidecars of 4 KiB blocks (so each file has many blocks, and records cross their edges)."""
    monkeypatch.setattr(archive, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(crc_pieces, "MIN_BLOCK", 4096)
    out = tmp_path / "w4"
    zckpt.reshard(fixture("ds", "gpt2_s3_bf16_w2"), out, world=4, progress=False)
    pts = sorted(out.rglob("*.pt"))
    assert pts and all(p.with_name(p.name + ".crc32.json").is_file() for p in pts)
    return out


def test_verify_reads_each_byte_of_a_checked_rank_file_once(
    resharded: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    got: Counter[str] = Counter()
    pread = fileio.pread_into

    def counting(fd: fileio.Handle, view: memoryview, pos: int, *a: object) -> int:
        k = pread(fd, view, pos, *a)  # type: ignore[arg-type]
        got[fd.name] += k
        return k

    monkeypatch.setattr(fileio, "pread_into", counting)
    report = zckpt.verify(resharded, progress=False)
    assert report.ok, report.to_text()
    for p in sorted(resharded.rglob("*.pt")):
        size = p.stat().st_size
        assert size <= got[str(p)] <= size + 4096, (p.name, got[str(p)], size)  # once (twice before)


def _record(p: Path, name_part: str) -> zipfile.ZipInfo:
    with zipfile.ZipFile(p) as zf:
        return next(i for i in zf.infolist() if name_part in i.filename and i.file_size > 64)


def test_verify_finds_damage_inside_a_record_and_between_records(resharded: Path) -> None:
    p = next(iter(sorted(resharded.rglob("*optim_states.pt"))))
    info = _record(p, "/data/")
    with open(p, "rb") as fh:  # the local header: 30 bytes, the name, then the extra field (torch's padding)
        fh.seek(info.header_offset + 26)
        n, extra = int.from_bytes(fh.read(2), "little"), int.from_bytes(fh.read(2), "little")
    assert extra > 8
    between = info.header_offset + 30 + n + extra - 2  # padding: no zip CRC covers it, only the sidecar
    flip_byte(p, between)
    report = zckpt.verify(resharded, progress=False)
    assert not report.ok
    assert [(q.file, q.kind) for q in report.problems] == [(str(p), "checksum")], report.to_text()
    assert f"(block {between // 4096})" in report.problems[0].message
    flip_byte(p, between)  # back
    assert zckpt.verify(resharded, progress=False).ok
    inside = info.header_offset + 30 + n + extra + info.file_size // 2
    flip_byte(p, inside)
    report = zckpt.verify(resharded, progress=False)
    assert not report.ok
    assert any(q.file == str(p) and "fails its CRC-32 check" in q.message for q in report.problems), (
        report.to_text()
    )
