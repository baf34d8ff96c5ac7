"""zckpt.ops.verify on intact and deliberately damaged checkpoints: each damage is made by hand here
(truncate, flip a byte, delete or add a rank file) and must be reported, naming the file."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from _fixtures import fixture
from test_diff import validate

from zckpt.errors import PathNotFound
from zckpt.formats.hf import write_safetensors
from zckpt.ops.verify import VerifyReport, verify
from zckpt.stream.items import items_from_state_dict

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "docs" / "verify-json-schema.json").read_text())


def _sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(64, 16, generator=g)
    return {"emb.weight": emb, "head.weight": emb, "fc.weight": torch.randn(32, 16, generator=g),
            "fc.bias": torch.randn(32, generator=g), "ids": torch.arange(8)}  # fmt: skip


def _write_st(out: Path, max_shard_size: int | None = None) -> list[Path]:
    items, tied = items_from_state_dict(_sd())
    return write_safetensors(out, items, tied=tied, max_shard_size=max_shard_size)


def _flip(f: Path, at: int) -> None:
    b = bytearray(f.read_bytes())
    b[at] ^= 0x40
    f.write_bytes(bytes(b))


def _records(f: Path) -> list[zipfile.ZipInfo]:
    with zipfile.ZipFile(f) as zf:
        return zf.infolist()


def _data_start(f: Path, info: zipfile.ZipInfo) -> int:
    """Where a stored record's bytes start: after its *local* header (whose extra field torch uses
    for alignment padding and which differs from the central directory's)."""
    with open(f, "rb") as fh:
        fh.seek(info.header_offset)
        head = fh.read(30)
    assert head[:4] == b"PK\x03\x04"
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _files(r: VerifyReport) -> dict[str, str]:
    return {Path(p.file).name: p.kind for p in r.problems}


def _check_json(r: VerifyReport) -> None:
    js = r.to_json()
    validate(js, SCHEMA)
    json.dumps(js, allow_nan=False)
    assert js["ok"] == r.ok and len(js["problems"]) == len(r.problems)


def test_clean_safetensors_with_sidecar(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    _write_st(f)
    side = json.loads(f.with_name(f.name + ".crc32.json").read_text())  # block CRC-32s (16 MiB blocks)
    raw, b = f.read_bytes(), side["block"]
    assert side["format"] == "zckpt-block-crc32" and side["version"] == 1
    assert side["file"] == f.name and side["size"] == len(raw) and b == 16 << 20
    assert side["crc32"] == [f"{zlib.crc32(raw[a : a + b]):08x}" for a in range(0, len(raw), b)]
    assert not f.with_name(f.name + ".sha256.json").exists()
    r = verify(f)
    assert r.ok and r.checksums == 1 and r.format == "hf", r.to_text()
    assert r.to_text().endswith("OK")
    _check_json(r)


def test_older_sha256_block_sidecar_is_still_checked(tmp_path: Path) -> None:
    """A ``<file>.sha256.json`` of an earlier zckpt (sha256 per block, made here with hashlib) is verified,
    and a flipped byte is named by its block; a damaged one is not mistaken for the CRC sidecar's."""
    f = tmp_path / "model.safetensors"
    _write_st(f)
    f.with_name(f.name + ".crc32.json").unlink()
    raw, b = f.read_bytes(), 4096
    digests = [hashlib.sha256(raw[a : a + b]).hexdigest() for a in range(0, len(raw), b)]
    side = {"file": f.name, "size": len(raw), "block": b, "sha256": digests}
    f.with_name(f.name + ".sha256.json").write_text(json.dumps(side))
    r = verify(f)
    assert r.ok and r.checksums == len(digests), r.to_text()
    _flip(f, len(raw) - 10)
    r = verify(f)
    k = (len(raw) - 10) // b
    assert [p.kind for p in r.problems] == ["checksum"], r.to_text()
    assert f"sha256 of bytes [{k * b}, {len(raw)}) (block {k})" in str(r.problems[0])


def test_sha256_on_request(tmp_path: Path) -> None:
    """``verify --sha256`` also prints each file's whole sha256 in ``sha256sum`` format (hashlib is the
    oracle) and lists them in ``--json``; without it the JSON has no such key."""
    import subprocess

    from typer.testing import CliRunner

    from zckpt.cli.app import app

    files = _write_st(tmp_path / "hf", max_shard_size=600)
    assert len(files) >= 2
    want = {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.suffix == ".safetensors"}
    r = verify(tmp_path / "hf", sha256=True)
    assert r.ok and dict(r.sha256) == want, r.to_text()
    js = r.to_json()
    validate(js, SCHEMA)
    assert js["sha256"] == want and "sha256" not in verify(tmp_path / "hf").to_json()
    res = CliRunner().invoke(app, ["verify", str(tmp_path / "hf"), "--sha256"])
    assert res.exit_code == 0, res.output
    sums = [ln for ln in res.output.splitlines() if "  " in ln and not ln.endswith("OK")]
    assert sums == [f"{d}  {f}" for f, d in want.items()]
    (tmp_path / "SUMS").write_text("\n".join(sums) + "\n")
    ok = subprocess.run(["sha256sum", "-c", "--quiet", str(tmp_path / "SUMS")], capture_output=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_crc_sidecar_of_a_later_version_or_another_format_is_named(tmp_path: Path) -> None:
    """A ``.crc32.json`` of a later version is reported as unsupported (never read as if it were version 1);
    one without the format's name is corrupt."""
    f = tmp_path / "model.safetensors"
    _write_st(f)
    side = f.with_name(f.name + ".crc32.json")
    doc = json.loads(side.read_text())
    side.write_text(json.dumps({**doc, "version": 2}))
    r = verify(f)
    assert [(p.file, p.kind) for p in r.problems] == [(str(side), "unsupported")], r.to_text()
    assert "version 2" in str(r.problems[0]) and "upgrade zckpt" in (r.problems[0].hint or "")
    side.write_text(json.dumps({k: v for k, v in doc.items() if k != "format"}))
    r = verify(f)
    assert [(p.file, p.kind) for p in r.problems] == [(str(side), "corrupt")], r.to_text()


@pytest.mark.parametrize("stand_in", ["dev-zero", "fifo", "dangling-link", "folder"])
@pytest.mark.parametrize("suffix", [".crc32.json", ".sha256.json", ".sha256"])
def test_sidecar_that_is_no_regular_file_is_named(stand_in: str, suffix: str, tmp_path: Path) -> None:
    """A checksum sidecar replaced by a device, a FIFO, a link to nothing or a folder: verify names it and
    consolidate refuses naming it (before, it read as "no sidecar": OK, checksums unchecked)."""
    import os

    import zckpt
    from zckpt.errors import CorruptCheckpoint

    f = tmp_path / "model.safetensors"
    _write_st(f)
    f.with_name(f.name + ".crc32.json").unlink()
    side = f.with_name(f.name + suffix)
    if stand_in == "dev-zero":
        side.symlink_to("/dev/zero")
    elif stand_in == "fifo":
        os.mkfifo(side)
    elif stand_in == "dangling-link":
        side.symlink_to(tmp_path / "gone")
    else:
        side.mkdir()
    r = verify(f)
    assert not r.ok and [(p.file, p.kind) for p in r.problems] == [(str(side), "corrupt")], r.to_text()
    assert "checksum sidecar is" in str(r.problems[0])
    _check_json(r)
    with pytest.raises(CorruptCheckpoint, match="checksum sidecar is") as e:
        zckpt.consolidate(f, tmp_path / "out.safetensors", progress=False)
    assert e.value.path == str(side)
    assert not (tmp_path / "out.safetensors").exists()


def test_flipped_byte_fails_checksum(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    _write_st(f)
    _flip(f, f.stat().st_size - 10)  # inside tensor data: the header still parses
    r = verify(f)
    assert not r.ok and [p.kind for p in r.problems] == ["checksum"]
    assert r.problems[0].file == str(f) and "crc32 of bytes" in str(r.problems[0])
    _check_json(r)


def test_truncated_and_padded_safetensors(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    _write_st(f)
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    r = verify(f)
    assert not r.ok and r.problems[0].kind == "truncated" and r.problems[0].file == str(f), r.to_text()
    f.write_bytes(data + b"\0" * 16)  # trailing bytes: header no longer covers the file
    r = verify(f)
    kinds = sorted(p.kind for p in r.problems)
    assert kinds == ["corrupt"] and any("16 trailing bytes" in str(p) for p in r.problems)


def test_hf_shards_missing_and_stale(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    _write_st(out, max_shard_size=1000)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3
    assert verify(out).ok
    stale = out / f"model-00009-of-{len(shards) + 6:05d}.safetensors"
    shutil.copy(shards[0], stale)
    r = verify(out)
    assert _files(r) == {stale.name: "stale"}, r.to_text()
    stale.unlink()
    shards[1].unlink()
    r = verify(out)
    assert not r.ok and _files(r).get(shards[1].name) == "missing", r.to_text()
    assert any(shards[1].name in str(p) for p in r.problems)
    _check_json(r)


def test_torch_zip_crc_and_truncation(tmp_path: Path) -> None:
    f = tmp_path / "model.pt"
    torch.save({k: v.clone() for k, v in _sd().items()}, f)
    assert verify(f).ok
    info = next(i for i in _records(f) if "/data/" in i.filename and i.file_size > 64)
    _flip(f, _data_start(f, info) + 20)  # inside the first tensor record
    r = verify(f)
    assert [(p.kind, p.file) for p in r.problems] == [("corrupt", str(f))] and "CRC-32" in str(r.problems[0])
    f.write_bytes(f.read_bytes()[:-200])
    r = verify(f)
    assert not r.ok and r.problems[0].file == str(f) and r.problems[0].kind in ("truncated", "corrupt")


def test_torch_zip_local_header_naming_another_record(tmp_path: Path) -> None:
    """A flipped byte in a record's local-header name: torch still loads the file (its reader uses the
    directory), every CRC-32 still holds, yet the file is damaged. Found by the fuzz suite (seed 1, case 119)
    on a DeepSpeed rank file."""
    f = tmp_path / "model.pt"
    torch.save({k: v.clone() for k, v in _sd().items()}, f)
    info = next(i for i in _records(f) if "/data/" in i.filename)
    name_at = info.header_offset + 30 + len(info.filename) - 1  # the name's last byte (a digit of the key)
    _flip(f, name_at)
    assert torch.load(f, weights_only=True).keys() == _sd().keys()  # the oracle: torch does not notice
    r = verify(f)
    assert [(p.kind, p.file) for p in r.problems] == [("corrupt", str(f))], r.to_text()
    assert "local header names another record" in str(r.problems[0])


def test_missing_path_raises(tmp_path: Path) -> None:
    with pytest.raises(PathNotFound) as ei:  # a FileNotFoundError, as Python's own open() raises
        verify(tmp_path / "nope")
    assert (
        isinstance(ei.value, FileNotFoundError)
        and str(ei.value) == f"{tmp_path / 'nope'}: no such file or folder"
    )


# -- real DeepSpeed checkpoints: missing / stale / truncated / flipped rank files -------------------------

DS = ROOT / "fixtures" / "ds"


def _ds_copy(tmp_path: Path, case: str) -> Path:
    src = fixture("ds", case, "latest").parent  # a missing fixture is an error, never a skip
    dst = tmp_path / case
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("ref_*", "*.py"))
    return dst


@pytest.mark.parametrize("case", ["s1_bf16_w2", "s2_fp16_w2", "s3_bf16_w2_g2", "s3_fp16_w3_g2"])
def test_deepspeed_rank_files(tmp_path: Path, case: str) -> None:
    ck = _ds_copy(tmp_path, case)
    world = json.loads((ck / "case.json").read_text())["world"]
    td = ck / (ck / "latest").read_text().strip()
    r = verify(ck)
    assert r.ok and r.world_size == world and r.format == "deepspeed", r.to_text()
    assert len(r.files) == len(list(td.glob("*.pt")))
    _check_json(r)
    optim = sorted(td.glob("*optim_states.pt"))
    # stale: a rank-`world` file beside a checkpoint of that world size
    stale = td / optim[1].name.replace("rank_1_", f"rank_{world}_")
    shutil.copy(optim[1], stale)
    r = verify(ck)
    assert [(Path(p.file).name, p.kind) for p in r.problems] == [(stale.name, "stale")], r.to_text()
    stale.unlink()
    # missing: rank 1's optimizer file
    saved = optim[1].read_bytes()
    optim[1].unlink()
    r = verify(ck)
    assert [(Path(p.file).name, p.kind) for p in r.problems] == [(optim[1].name, "missing")], r.to_text()
    # truncated
    optim[1].write_bytes(saved[: len(saved) // 2])
    r = verify(ck)
    assert not r.ok and {Path(p.file).name for p in r.problems} == {optim[1].name}, r.to_text()
    # a flipped byte inside a tensor record: only the CRC-32 catches it
    optim[1].write_bytes(saved)
    info = max((i for i in _records(optim[1]) if "/data/" in i.filename), key=lambda i: i.file_size)
    _flip(optim[1], _data_start(optim[1], info) + info.file_size // 2)
    r = verify(ck)
    assert [(Path(p.file).name, p.kind) for p in r.problems] == [(optim[1].name, "corrupt")], r.to_text()
    assert "CRC-32" in r.problems[0].message
    optim[1].write_bytes(saved)
    models = sorted(td.glob("zero_pp_rank_*_model_states.pt"))
    if models:  # ZeRO-3: one model-states file per rank
        models[-1].unlink()
        r = verify(ck)
        assert [(Path(p.file).name, p.kind) for p in r.problems] == [(models[-1].name, "missing")], (
            r.to_text()
        )


def test_consolidated_output_verifies_and_diffs_clean(tmp_path: Path) -> None:
    from zckpt.ops.consolidate import consolidate
    from zckpt.ops.diff import diff

    ck = _ds_copy(tmp_path, "s2_fp16_w2")
    out = tmp_path / "out"
    consolidate(ck, out, dtype="fp32", max_shard_size=400, progress=False)
    r = verify(out)
    shards = sorted(out.glob("*.safetensors"))
    assert r.ok and r.checksums == len(shards) >= 2, r.to_text()
    d = diff(ck, out, progress=False)  # 16-bit frozen params upcast to fp32
    assert d.equal and d.differing == 0, d.to_text()
    _flip(shards[-1], shards[-1].stat().st_size - 3)
    r = verify(out)
    assert [(Path(p.file).name, p.kind) for p in r.problems] == [(shards[-1].name, "checksum")]


def test_cli(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from zckpt.cli.app import app

    f = tmp_path / "model.safetensors"
    _write_st(f)
    run = CliRunner().invoke
    res = run(app, ["verify", str(f)])
    assert res.exit_code == 0 and res.output.strip().endswith("OK")
    res = run(app, ["verify", str(f), "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["ok"] is True
    _flip(f, f.stat().st_size - 1)
    res = run(app, ["verify", str(f)])
    assert res.exit_code == 1 and res.output.startswith(f"{f}: crc32 ")
    js = json.loads(run(app, ["verify", str(f), "--json"]).output)
    validate(js, SCHEMA)
    assert js["problems"][0]["kind"] == "checksum"
    assert run(app, ["verify", str(tmp_path / "nope")]).exit_code == 2


def test_native_manifest_checksums_and_rank_files(tmp_path: Path) -> None:
    from zckpt.ops.reshard import reshard

    src = _ds_copy(tmp_path, "s3_bf16_w2_g2")
    out = tmp_path / "native"
    reshard(src, out, world=3, to="native", progress=False)
    r = verify(out)
    td = out / (out / "latest").read_text().strip()
    man = json.loads((td / "manifest.json").read_text())
    ranks = sorted(td.glob("rank_*.safetensors"))
    assert r.ok and r.format == "native" and r.world_size == 3 and len(ranks) == 3, r.to_text()
    for f in ranks:  # the manifest's per-block hashes, checked independently of zckpt
        blocks, raw = man["files"][f.name]["sha256_blocks"], f.read_bytes()
        b = blocks["block"]
        assert blocks["sha256"] == [hashlib.sha256(raw[a : a + b]).hexdigest() for a in range(0, len(raw), b)]
    assert r.checksums >= 3
    _check_json(r)
    # flipped byte in a checksummed rank file (tensor data, so the header still parses): one line
    saved = ranks[1].read_bytes()
    _flip(ranks[1], len(saved) - 5)
    r = verify(out)
    assert [(Path(p.file).name, p.kind) for p in r.problems] == [(ranks[1].name, "checksum")], r.to_text()
    ranks[1].write_bytes(saved)
    # stale rank file from a bigger world
    stale = td / "rank_00003.safetensors"
    shutil.copy(ranks[2], stale)
    r = verify(out)
    assert [(Path(p.file).name, p.kind) for p in r.problems] == [(stale.name, "stale")], r.to_text()
    stale.unlink()
    # missing rank file
    ranks[2].unlink()
    r = verify(out)
    assert not r.ok and {Path(p.file).name for p in r.problems} == {ranks[2].name}, r.to_text()
    assert all(p.kind == "missing" for p in r.problems)
    # truncated rank file
    ranks[2].write_bytes(saved[: len(saved) // 3])
    r = verify(out)
    assert not r.ok and {Path(p.file).name for p in r.problems} == {ranks[2].name}, r.to_text()


@pytest.mark.parametrize("relative", [True, False])
def test_one_damaged_file_is_one_problem_in_one_path_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, relative: bool
) -> None:
    """Issue 40.2: a truncated DeepSpeed rank file was reported twice, by the reader (absolute path) and by
    the file check (the path as given), and counted as "2 problems in 2 files". One line, one path form (the
    user's), and the summary counts one problem in one file; ``--json`` agrees."""
    from typer.testing import CliRunner

    from zckpt.cli.app import app

    ck = _ds_copy(tmp_path, "s1_bf16_w2")
    f = ck / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[:-100])
    monkeypatch.chdir(tmp_path)
    arg = Path(ck.name) if relative else ck
    want = str(arg / "global_step3" / f.name)
    res = CliRunner().invoke(app, ["verify", str(arg)])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 2, res.output
    assert lines[0].startswith(f"{want}: ") and lines[1].endswith(": 1 problem in 1 file"), res.output
    js = json.loads(CliRunner().invoke(app, ["verify", str(arg), "--json"]).output)
    validate(js, SCHEMA)
    assert [p["file"] for p in js["problems"]] == [want]


def test_progress_bar_counts_the_bytes_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal, verify shows a bar of the bytes of the files checked, out of their total (issue 40
    point 3: a verify of a bucket said nothing for 52 s); ``progress=False`` shows none."""
    import io
    import sys

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    files = _write_st(tmp_path / "hf", max_shard_size=600)
    total = sum(f.stat().st_size for f in files if f.suffix == ".safetensors")
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    assert verify(tmp_path / "hf").ok
    out = err.getvalue()
    assert "verify:   0%|" in out and f"/{total / 1024:.2f}k [" in out, out
    err2 = Tty()
    monkeypatch.setattr(sys, "stderr", err2)
    assert verify(tmp_path / "hf", progress=False).ok and err2.getvalue() == ""
