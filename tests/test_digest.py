"""zckpt.storage.digest: block digests and region CRC-32s computed on several threads equal hashlib's sha256
of each block and zlib's CRC-32 of each region (oracles independent of zckpt), for stable (in-place) and
copied writes of awkward sizes, with ``O_DIRECT`` on and off; ``block_digests`` (verify's recomputation)
agrees; a native checkpoint written with small blocks verifies, and a flipped byte is reported with the
byte range of its block."""

from __future__ import annotations

import hashlib
import json
import os
import random
import zlib
from pathlib import Path

import pytest
import torch
from _fixtures import fixture

import zckpt
from zckpt.storage import direct_io, scan
from zckpt.storage.digest import block_digests, lanes
from zckpt.storage.sink import HashingSink

DATA = os.urandom(5 * direct_io.BUF_BYTES + 12345)


def _pieces(rng: random.Random, total: int) -> list[int]:
    out, left = [], total
    while left:
        n = min(left, rng.choice([1, 100, 4095, 4096, 70_000, 1 << 20, direct_io.BUF_BYTES + 3, 3 << 24]))
        out.append(n)
        left -= n
    return out


def _oracle(algorithm: str, data: bytes) -> str:
    """A block's digest computed by hashlib or zlib (independent of zckpt's ISA-L CRC and hash lanes)."""
    return f"{zlib.crc32(data):08x}" if algorithm == "crc32" else hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize(("direct", "algorithm"), [("1", "sha256"), ("0", "crc32")])
@pytest.mark.parametrize("stable", [False, True])
@pytest.mark.parametrize("block", [4096, 3 * 4096 + 512, 1 << 26])
def test_block_digests_and_crcs_match_hashlib_and_zlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: str, algorithm: str, stable: bool, block: int
) -> None:
    monkeypatch.setenv("ZCKPT_DIRECT_IO", direct)
    rng = random.Random(block + stable)
    total = len(DATA) - rng.randrange(10_000)
    cuts = sorted(rng.sample(range(1, total), 40))
    regions = [(a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=True)]
    # page-aligned source memory, so stable writes go to the device in place
    src = torch.empty(total + 4096, dtype=torch.uint8)
    pad = -src.data_ptr() % 4096
    mem = src[pad : pad + total]
    mem.copy_(torch.frombuffer(bytearray(DATA[:total]), dtype=torch.uint8))
    view = memoryview(mem.numpy())
    sink = HashingSink(tmp_path / "f", crc_regions=regions, block=block, algorithm=algorithm)
    at = 0
    for n in _pieces(rng, total):
        sink.write(view[at : at + n], stable=stable)
        at += n
    sink.close()
    raw = DATA[:total]
    assert (tmp_path / "f").read_bytes() == raw
    d = sink.digest()
    want = [_oracle(algorithm, raw[a : a + block]) for a in range(0, total, block)]
    assert d.block == block and list(d.blocks) == want and d.algorithm == algorithm
    assert sink.crcs == [zlib.crc32(raw[a:b]) for a, b in regions]
    assert block_digests(tmp_path / "f", block, total, algorithm) == want
    with pytest.raises(EOFError):
        block_digests(tmp_path / "f", block, total + 1, algorithm)
    monkeypatch.setenv("ZCKPT_WORKERS", "3")  # lanes that do not divide the block count
    assert block_digests(tmp_path / "f", block, total, algorithm) == want
    with scan.shared(8):  # files checked side by side: one lane each
        assert block_digests(tmp_path / "f", block, total, algorithm) == want
        with pytest.raises(EOFError):
            block_digests(tmp_path / "f", block, total + 1, algorithm)
    assert lanes() >= 1


def test_whole_file_digest_unchanged(tmp_path: Path) -> None:
    """Without ``block`` the digest stays the one sha256 ``sha256sum`` prints (sidecars)."""
    sink = HashingSink(tmp_path / "f", crc_regions=[(3, 70_000)])
    for a in range(0, len(DATA), 1 << 22):
        sink.write(memoryview(DATA[a : a + (1 << 22)]))
    sink.close()
    assert sink.hexdigest() == hashlib.sha256(DATA).hexdigest() and sink.digest().blocks == ()
    assert sink.crcs == [zlib.crc32(DATA[3:70_000])]


def test_native_block_digests_verify_and_name_the_damaged_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zckpt.formats.native.write as native_write

    monkeypatch.setattr(native_write, "BLOCK_BYTES", 4096)
    out = tmp_path / "nat"
    zckpt.reshard(fixture("ds", "s2_fp32_w2_g2"), out, world=2, to="native", progress=False)
    td = out / (out / "latest").read_text().strip()
    man = json.loads((td / "manifest.json").read_text())
    assert man["version"] == 2
    f = td / "rank_00000.safetensors"
    raw = f.read_bytes()
    blocks = man["files"][f.name]["sha256_blocks"]
    assert blocks["block"] == 4096 and len(blocks["sha256"]) == -(-len(raw) // (4096)) >= 3
    r = zckpt.verify(out)
    assert r.ok and r.checksums >= len(blocks["sha256"]), r.to_text()
    at = 2 * (4096) + 100
    f.write_bytes(raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1 :])
    r = zckpt.verify(out)
    assert [p.kind for p in r.problems] == ["checksum"], r.to_text()
    assert f"[{2 * 4096}, {min(len(raw), 3 * 4096)}) (block 2)" in str(r.problems[0])
