"""Checksums verified while reading (zckpt.storage.checks): a bit flipped in a tensor's bytes of a real
DeepSpeed rank file or a torch .bin is refused by consolidate, reshard and diff (nothing written), and passes
with
--no-verify-data (the flipped value then shows); the CRC bookkeeping is exact for any read order."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from _damage import flip_byte
from _fixtures import fixture
from typer.testing import CliRunner

import zckpt
from zckpt.cli.app import app
from zckpt.codecs.torchzip import load_refs, record_offsets
from zckpt.errors import CorruptCheckpoint
from zckpt.model import Checked
from zckpt.storage import checks

runner = CliRunner()


def test_crc32_combine_matches_zlib() -> None:
    rng = random.Random(0)
    for _ in range(20):
        a, b = os.urandom(rng.randrange(0, 3000)), os.urandom(rng.randrange(0, 3000))
        want = zlib.crc32(a + b)
        assert checks.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == want
        assert checks.py_crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == want


def test_session_any_read_order_and_gaps(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    f = tmp_path / "blob"
    f.write_bytes(b"x" * 17 + data)
    good = Checked(str(f), 17, len(data), zlib.crc32(data), "record r")
    order = [
        (3000, 4000),
        (0, 1000),
        (9000, 10_000),
        (4000, 5000),
        (1500, 2600),
        (3500, 4500),
    ]  # gaps, overlap
    with checks.session() as s:
        assert s is not None
        for lo, hi in order:
            checks.consumed(good, 17 + lo, memoryview(data[lo:hi]))
        s.finish()  # reads the gaps, then the CRC of the whole record matches
    bad = Checked(str(f), 17, len(data), zlib.crc32(data) ^ 1, "record r")
    with checks.session() as s, pytest.raises(CorruptCheckpoint, match="record r fails its CRC-32"):
        assert s is not None
        checks.consumed(bad, 17, memoryview(data[:5000]))
        s.finish()


def _flip_tensor_byte(path: Path, record: str) -> None:
    """Flip one byte in the middle of ``record``'s data (a tensor storage of a torch zip archive)."""
    _, recs = record_offsets(str(path))
    start, size = next(v for k, v in recs.items() if k.endswith(record))
    flip_byte(path, start + size // 2, 0x40)


def _cli(*args: object) -> tuple[int, str]:
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


def test_sessions_of_two_threads_check_their_own_reads(tmp_path: Path) -> None:
    """Two operations in two threads, interleaved: A opens its session, B opens its own, A reads a damaged
    record and finishes (it must refuse it), then B reads a good one and finishes (it must pass). A session
    bound process-wide sent A's read to B's session: A passed a damaged record, B refused A's file."""
    import threading

    data = os.urandom(50_000)
    f = tmp_path / "blob"
    f.write_bytes(data)
    bad = Checked(str(f), 0, len(data), zlib.crc32(data) ^ 1, "record of A")
    good = Checked(str(f), 0, len(data), zlib.crc32(data), "record of B")
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    outcome: dict[str, str] = {}

    def run(name: str, check: Checked, enter: threading.Event, wait_in: threading.Event | None,
            wait_go: threading.Event | None, done: threading.Event | None) -> None:  # fmt: skip
        try:
            if wait_in is not None:
                wait_in.wait(10)
            with checks.session() as s:
                assert s is not None
                enter.set()
                if wait_go is not None:
                    wait_go.wait(10)
                checks.consumed(check, 0, memoryview(data))
                s.finish()
            outcome[name] = "passed"
        except CorruptCheckpoint as e:
            outcome[name] = str(e)
        finally:
            if done is not None:
                done.set()

    ta = threading.Thread(target=run, args=("A", bad, a_in, None, b_in, a_done))
    tb = threading.Thread(target=run, args=("B", good, b_in, a_in, a_done, None))
    ta.start()
    tb.start()
    ta.join(20)
    tb.join(20)
    assert "record of A fails its CRC-32" in outcome["A"], outcome
    assert outcome["B"] == "passed", outcome
    seen: list[object] = []
    t = threading.Thread(target=lambda: seen.append(checks._ACTIVE.get()))
    t.start()
    t.join()
    assert seen == [None] and checks._ACTIVE.get() is None  # nothing left bound once both ended


def test_deepspeed_flip_refused_everywhere(tmp_path: Path) -> None:
    src = fixture("ds", "s2_fp32_w2_g2")
    ck = tmp_path / "ck"
    shutil.copytree(src, ck, ignore=shutil.ignore_patterns("ref_*", "case.json"))
    # the first flat fp32 master partition of rank 1 (read by every command)
    optim = ck / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    master = load_refs(str(optim))["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    _flip_tensor_byte(optim, f"data/{master.storage.key}")
    jobs = [["consolidate", ck, tmp_path / "o.safetensors"], ["reshard", ck, tmp_path / "r", "--world", "3"],
            ["diff", ck, src]]  # fmt: skip
    for args in jobs:
        code, out = _cli(*args, "--no-progress")
        assert code == 2 and "fails its CRC-32 check" in out and "zero_pp_rank_1" in out, (args, out)
    assert not (tmp_path / "o.safetensors").exists() and not (tmp_path / "r").exists()
    assert not [p for p in tmp_path.iterdir() if "zckpt-tmp" in p.name]
    # without the check, the damaged value goes through: diff sees it, consolidate writes it
    code, out = _cli("diff", ck, src, "--no-verify-data", "--no-progress")
    assert code == 1, out
    code, out = _cli("consolidate", ck, tmp_path / "o.safetensors", "--no-verify-data", "--no-progress")
    assert code == 0, out


def test_bin_flip_refused(tmp_path: Path) -> None:
    sd = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3)}
    torch.save(sd, tmp_path / "m.bin")
    assert zckpt.diff(tmp_path / "m.bin", tmp_path / "m.bin", progress=False).equal
    _flip_tensor_byte(tmp_path / "m.bin", "data/0")
    with pytest.raises(CorruptCheckpoint, match="fails its CRC-32 check"):
        zckpt.consolidate(tmp_path / "m.bin", tmp_path / "o.safetensors", progress=False)
    assert not (tmp_path / "o.safetensors").exists()
    zckpt.consolidate(tmp_path / "m.bin", tmp_path / "o.safetensors", progress=False, verify_data=False)


def test_digest_any_read_order_and_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole-file sha256 fed in any order (held bytes, gaps read from disk, re-reads, a small hold
    budget forcing gap reads) equals hashlib's digest of the file; one wrong byte is refused."""
    import hashlib

    blob = os.urandom(200_000)
    f = tmp_path / "blob"
    f.write_bytes(blob)
    rng = random.Random(1)
    for hold, gap in ((1 << 30, 0), (5000, 0), (1 << 30, 3000)):
        monkeypatch.setattr(checks, "HOLD_BYTES", hold)
        monkeypatch.setattr(checks, "GAP_READ", gap)
        cuts = sorted(rng.sample(range(1, len(blob)), 40))
        parts = list(zip([0, *cuts], [*cuts, len(blob)], strict=True))
        rng.shuffle(parts)
        parts = parts[5:] + parts[:3]  # some never read (finish reads them), some read twice
        good = Checked(str(f), 0, len(blob), None, "sidecar", sha256=hashlib.sha256(blob).hexdigest())
        with checks.session() as s:
            assert s is not None
            for lo, hi in parts:
                checks.consumed(good, lo, memoryview(blob[lo:hi]))
            s.finish()
        bad = Checked(str(f), 0, len(blob), None, "sidecar", sha256=hashlib.sha256(blob[:-1]).hexdigest())
        with checks.session() as s, pytest.raises(CorruptCheckpoint, match="does not match the sha256"):
            assert s is not None
            for lo, hi in parts:
                checks.consumed(bad, lo, memoryview(blob[lo:hi]))
            s.finish()


def _flip_safetensors(path: Path, name: str | None) -> None:
    """Flip a byte in the middle of tensor ``name``'s data, or (None) one in a tensor name of the header."""
    from zckpt.codecs.safetensors import read_header

    h = read_header(path)
    if name is None:
        key = sorted(h.tensors)[-1]
        at = path.read_bytes().index(b'"' + key.encode() + b'"') + 2  # inside a tensor name in the header
    else:
        e = h.tensors[name]
        at = e.begin + e.numel * e.dtype.itemsize // 2
    flip_byte(path, at)


def test_sidecar_and_native_manifest_digests_refuse_flips(tmp_path: Path) -> None:
    """An HF file with its ``.crc32.json`` sidecar and a native rank file (its manifest records
    each tensor's CRC-32; an older one without them: the file's sha256): a flipped tensor byte, or a renamed
    tensor in the header, is refused by consolidate and diff; ``--no-verify-data`` reads the damaged file."""
    src = fixture("ds", "s2_fp32_w2_g2")
    hf = tmp_path / "hf"
    zckpt.consolidate(src, hf, progress=False)
    st = next(hf.glob("*.safetensors"))
    assert (hf / (st.name + ".crc32.json")).is_file()
    nat = tmp_path / "nat"
    zckpt.reshard(src, nat, world=2, to="native", progress=False)
    rank1 = next(nat.glob("*/rank_00001.safetensors"))
    from zckpt.codecs.safetensors import read_header

    manifest = json.loads(next(nat.glob("*/manifest.json")).read_text())
    for f in nat.glob("*/rank_*.safetensors"):  # the recorded CRC-32s are zlib's over each tensor's bytes
        raw, h = f.read_bytes(), read_header(f)
        want = {k: zlib.crc32(raw[e.begin : e.end]) for k, e in h.tensors.items()}
        assert manifest["files"][f.name]["crc32"] == want

    params = {k: e for k, e in read_header(rank1).tensors.items() if k.startswith("param/")}
    big = max(params.items(), key=lambda kv: kv[1].numel)[0]
    sha, crc = "match the sha256", "fails its CRC-32 check"
    old = tmp_path / "nat-old"  # a version-1 manifest (no per-tensor CRCs): the file sha256 is checked
    shutil.copytree(nat, old)
    mf = next(old.glob("*/manifest.json"))
    m = json.loads(mf.read_text())
    for name, rec in m["files"].items():
        del rec["crc32"], rec["sha256_blocks"]
        rec["sha256"] = hashlib.sha256((mf.parent / name).read_bytes()).hexdigest()
    m["version"] = 1
    mf.write_text(json.dumps(m))
    no_crc = tmp_path / "nat-nocrc"  # a version-2 manifest without its CRCs: nothing would check the tensors
    shutil.copytree(nat, no_crc)
    mf2 = next(no_crc.glob("*/manifest.json"))
    m2 = json.loads(mf2.read_text())
    del m2["files"][rank1.name]["crc32"]
    mf2.write_text(json.dumps(m2))
    code, msg = _cli("consolidate", no_crc, tmp_path / "nc.safetensors", "--no-progress")
    assert code == 2 and "records no CRC-32" in msg and rank1.name in msg, msg
    old1 = old / rank1.relative_to(nat)
    cases = [(hf, st, sorted(read_header(st).tensors)[0], crc), (hf, st, None, crc), (nat, rank1, big, crc),
             (old, old1, big, sha)]  # fmt: skip
    for root, f, name, expect in cases:
        work = tmp_path / f"w-{root.name}-{name}"
        shutil.copytree(root, work)
        _flip_safetensors(work / f.relative_to(root), name)
        out = tmp_path / f"o-{root.name}-{name}.safetensors"
        for args in (["consolidate", work, out], ["diff", work, root]):
            code, msg = _cli(*args, "--no-progress")
            assert code == 2 and expect in msg and f.name in msg, (args, msg)
        assert not out.exists()
        code, msg = _cli("diff", work, root, "--no-verify-data", "--no-progress")
        assert code == 1, msg  # the damage shows as a difference without the check


@pytest.mark.parametrize("case", ["fsdp2_w2", "tp_w2"])
def test_dcp_chunk_flip_refused(tmp_path: Path, case: str) -> None:
    """A flipped byte in a DCP chunk (a torch.save archive inside a .distcp file) fails its record's CRC-32
    while consolidate reads it (TP boxes included); --no-verify-data writes the damaged value."""
    ck = tmp_path / "ck"
    shutil.copytree(fixture("dcp", case, "checkpoint"), ck)
    c = zckpt.open(ck)
    p = max(c.model_entries(), key=lambda e: e.numel).pieces[-1]
    c.close()
    at = p.byte_offset + p.dtype.itemsize * (p.numel // 2)
    with open(p.file, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x20]))
    code, out = _cli("consolidate", ck, tmp_path / "o.safetensors", "--no-progress")
    assert code == 2 and "fails its CRC-32 check" in out and Path(p.file).name in out, out
    assert not (tmp_path / "o.safetensors").exists()
    code, out = _cli("consolidate", ck, tmp_path / "o.safetensors", "--no-verify-data", "--no-progress")
    assert code == 0, out


@pytest.mark.parametrize("suffix", [".crc32.json", ".sha256.json"])
def test_block_sidecar_reads_check_each_block(tmp_path: Path, suffix: str) -> None:
    """A file with a block-digest sidecar (``<file>.crc32.json``, or an older zckpt's ``.sha256.json``) is
    checked block by block as it is read: the blocks here are 4 KiB (digests by zlib and hashlib,
    independently of zckpt), so a flipped byte is named by its block; a clean copy reads; verify names the
    same block."""
    src = tmp_path / "m.safetensors"
    zckpt.consolidate(fixture("ds", "gpt2_s3_bf16_w2"), src, dtype="fp32", progress=False)
    for old in tmp_path.glob("m.safetensors.*.json"):
        old.unlink()
    raw = bytearray(src.read_bytes())
    b = 4096
    side: dict[str, object] = {"file": src.name, "size": len(raw), "block": b}
    if suffix == ".crc32.json":
        side |= {"format": "zckpt-block-crc32", "version": 1}
        side["crc32"] = [f"{zlib.crc32(raw[a : a + b]):08x}" for a in range(0, len(raw), b)]
    else:
        side["sha256"] = [hashlib.sha256(raw[a : a + b]).hexdigest() for a in range(0, len(raw), b)]
    (tmp_path / f"m.safetensors{suffix}").write_text(json.dumps(side))
    code, msg = _cli("diff", src, fixture("ds", "gpt2_s3_bf16_w2"), "--no-progress")
    assert code == 0, msg
    at = len(raw) - 3 * b - 5  # inside a tensor near the end: block len // b - 3 (or -4)
    k = at // b
    raw[at] ^= 0x01
    src.write_bytes(bytes(raw))
    code, msg = _cli("consolidate", src, tmp_path / "o.safetensors", "--no-progress")
    assert code == 2 and f"block {k})" in msg and "m.safetensors" in msg, msg
    assert not (tmp_path / "o.safetensors").exists()
    r = zckpt.verify(src)
    assert not r.ok and any(f"block {k}" in p.message for p in r.problems), r.to_text()


def test_big_diff_reads_are_crc_checked(tmp_path: Path) -> None:
    """diff reads a big tensor in 1 Mi-element chunks. Two 40 MiB files with their
    ``.crc32.json`` sidecars (3 blocks each, 16 MiB): equal copies diff clean; a flipped byte deep in block
    1 of one side (inside one big tensor) is refused naming that block; unchecked, it is a difference."""
    from zckpt.formats.hf import write_safetensors
    from zckpt.stream.items import items_from_state_dict

    g = torch.Generator().manual_seed(3)
    sd = {"w": torch.randn(10 << 20, generator=g), "b": torch.randn(7, generator=g)}
    items, tied = items_from_state_dict(sd)
    a, b = tmp_path / "a" / "m.safetensors", tmp_path / "b" / "m.safetensors"
    for f in (a, b):
        f.parent.mkdir()
        write_safetensors(f, items, tied=tied)
    side = json.loads(b.with_name(b.name + ".crc32.json").read_text())
    assert side["block"] == 16 << 20 and len(side["crc32"]) == 3
    assert zckpt.diff(a, b, progress=False).equal
    at = (16 << 20) + 12345  # inside block 1, inside "w" (the header is a few hundred bytes)
    with open(b, "r+b") as fh:
        fh.seek(at)
        x = fh.read(1)
        fh.seek(at)
        fh.write(bytes([x[0] ^ 0x10]))
    with pytest.raises(CorruptCheckpoint, match=r"block 1\)") as e:
        zckpt.diff(a, b, progress=False)
    assert e.value.path == str(b)
    assert not zckpt.diff(a, b, progress=False, verify_data=False).equal  # unchecked: a difference


@pytest.mark.parametrize("seed", [0, 2])
def test_consumed_same_credits_every_place_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Bytes found equal at two places (``diff``'s bit-identical chunks) are CRC'd once for both: a file
    checked by 64 KiB block CRC-32s (zlib's, the oracle) and a record at byte 37 of another file, so the
    block cuts fall elsewhere on each side; fed in random order and sizes, every record is complete without
    a read of either file; a wrong CRC on either side fails naming it."""
    rng = random.Random(seed)
    raw = os.urandom(1 << 20)
    x, y = tmp_path / "x.bin", tmp_path / "y.bin"
    x.write_bytes(raw)
    y.write_bytes(b"h" * 37 + raw + b"tail")
    b = 64 << 10
    blocks = tuple(f"{zlib.crc32(raw[a : a + b]):08x}" for a in range(0, len(raw), b))
    cx = Checked(str(x), 0, len(raw), None, "x's sidecar", block=b, blocks=blocks, algorithm="crc32")
    cy = Checked(str(y), 37, len(raw), zlib.crc32(raw), "record y")
    cuts = sorted({0, len(raw), *(rng.randrange(len(raw)) for _ in range(40))})
    parts = list(itertools.pairwise(cuts))
    rng.shuffle(parts)

    def run(px: Checked, py: Checked) -> None:
        with checks.session() as s:
            assert s is not None
            for lo, hi in parts:
                checks.consumed_same(((px, lo), (py, 37 + lo)), memoryview(raw)[lo:hi])
            s.finish()

    def no_read(*a: object, **k: object) -> None:
        raise AssertionError("a checked record was read again")

    monkeypatch.setattr(checks.fileio, "read_into", no_read)
    run(cx, cy)
    bad_block = blocks[:5] + (f"{int(blocks[5], 16) ^ 1:08x}",) + blocks[6:]
    bx = Checked(str(x), 0, len(raw), None, "x's sidecar", block=b, blocks=bad_block, algorithm="crc32")
    with pytest.raises(CorruptCheckpoint, match=r"x\.bin: x's sidecar \(bytes \[327680, 393216\), block 5\)"):
        run(bx, cy)
    with pytest.raises(CorruptCheckpoint, match=r"y\.bin: record y fails its CRC-32"):
        run(cx, Checked(str(y), 37, len(raw), zlib.crc32(raw) ^ 1, "record y"))


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("checked", ["a", "b", "ab"])
def test_diff_identical_damage_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: str, checked: str
) -> None:
    """diff CRCs a bit-identical chunk once for both sides: two files whose tensor bytes were damaged alike
    after the save (a damaged copy beside its original's sidecar) still fail, on the side that has its
    ``.crc32.json`` (``checked``: A's, B's or both), the blocks cut at other offsets on each side (B's header
    is longer), with one comparison thread and with two."""
    from zckpt.codecs.safetensors import read_header
    from zckpt.formats.hf import write_safetensors
    from zckpt.stream.items import items_from_state_dict

    monkeypatch.setenv("ZCKPT_WORKERS", workers)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(10 << 20, generator=g)
    a, b = tmp_path / "a" / "m.safetensors", tmp_path / "b" / "m.safetensors"
    for f, extra in ((a, "b"), (b, "a_bias_with_a_much_longer_name_that_moves_the_data_start")):
        f.parent.mkdir()
        items, tied = items_from_state_dict({"w": w, extra: torch.zeros(3)})
        write_safetensors(f, items, tied=tied)
    ea, eb = read_header(a).tensors["w"], read_header(b).tensors["w"]
    assert ea.begin != eb.begin
    for side, f in (("a", a), ("b", b)):
        if side not in checked:
            f.with_name(f.name + ".crc32.json").unlink()
    assert zckpt.diff(a, b, progress=False, keys=["w"]).equal
    k = (16 << 20) // 4 + 777  # an element of w in block 1 of both files
    for f, e in ((a, ea), (b, eb)):
        with open(f, "r+b") as fh:
            fh.seek(e.begin + 4 * k)
            x = fh.read(1)
            fh.seek(e.begin + 4 * k)
            fh.write(bytes([x[0] ^ 0x04]))
    damaged = r"\(bytes \[16777216, 33554432\), block 1\) fails its CRC"
    with pytest.raises(CorruptCheckpoint, match=damaged) as err:
        zckpt.diff(a, b, progress=False, keys=["w"])
    assert err.value.path in [str(f) for side, f in (("a", a), ("b", b)) if side in checked]
    assert zckpt.diff(a, b, progress=False, keys=["w"], verify_data=False).equal  # unchecked: equal
