"""Damaged DCP folders (issue 24, the DCP fuzz seeds), each built from a real torch save (``fixtures/dcp``).

``.metadata`` cross-checks: every table that names a key (``planner_data`` paths, ``storage_data`` indices)
agrees with ``state_dict_metadata``, and no two items share bytes of a file. ``.metadata`` is edited through
the fuzz harness's inert pickle round trip (``tests/fuzz/pickles.py``: nothing from the file is imported or
called); each case expects one ``error:`` line naming the file (exit 2, nothing written) and ``verify`` not
to say OK. Chunk archives: damage the fuzz seeds found (``tests/fuzz/FINDINGS.md``, DCP seeds).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import zckpt
from tests.fuzz import pickles
from zckpt.errors import CorruptCheckpoint

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "fixtures" / "dcp"


def _edited(tmp: Path, folder: str, edit: Callable[[Any], None]) -> Path:
    src = FIX / folder
    assert (src / ".metadata").is_file(), f"fixture missing: {src}"
    d = tmp / "ck"
    shutil.copytree(src, d)
    md = pickles.load_opaque((d / ".metadata").read_bytes())
    edit(md.state)
    (d / ".metadata").write_bytes(pickles.dump_opaque(md))
    return d


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "zckpt.cli.app", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def _refused(d: Path, tmp: Path, *phrases: str) -> None:
    out = tmp / "out.safetensors"
    p = _cli("consolidate", d, out, "--no-progress")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and lines[0].startswith("error: "), p.stderr
    assert len(lines) <= 2 and ".metadata" in lines[0] and "Traceback" not in p.stderr, p.stderr
    assert all(ph in lines[0] for ph in phrases), lines[0]
    assert not out.exists() and not list(tmp.glob("out*"))
    rep = zckpt.verify(d)
    assert not rep.ok and any(".metadata" in pr.file for pr in rep.problems), rep.problems


def test_planner_path_renamed_by_a_bit_flip_is_refused(tmp_path: Path) -> None:
    """Issue 24: ``norm.weight`` -> ``norm*weight`` in its ``planner_data`` path was consolidated under the
    misspelled name with exit 0, and verify said OK."""

    def edit(st: dict[str, Any]) -> None:
        assert st["planner_data"]["model.norm.weight"] == ("model", "norm.weight")
        st["planner_data"]["model.norm.weight"] = ("model", "norm*weight")

    d = _edited(tmp_path, "fsdp2_w2/checkpoint", edit)
    _refused(d, tmp_path, "planner_data", "'model.norm.weight'", "'model.norm*weight'")


def test_planner_path_of_another_key_is_refused(tmp_path: Path) -> None:
    """torchtitan's root keys: ``emb.weight`` given ``norm.weight``'s path would be written as norm.weight."""

    def edit(st: dict[str, Any]) -> None:
        st["planner_data"]["emb.weight"] = ("norm.weight",)

    d = _edited(tmp_path, "torchtitan_w2/checkpoint/step-3", edit)
    _refused(d, tmp_path, "'emb.weight'", "'norm.weight'")


@pytest.mark.parametrize("how", ["extra", "missing", "renamed-key"])
def test_planner_data_keys_must_be_state_dict_keys(tmp_path: Path, how: str) -> None:
    def edit(st: dict[str, Any]) -> None:
        pd = st["planner_data"]
        if how == "extra":
            pd["model.ghost.weight"] = ("model", "ghost.weight")
        elif how == "missing":
            del pd["model.fc1.weight"]
        else:  # the key (not the path) flipped: both "lacks" and "names" hold; either is reported
            pickles.rename_at(st, (("key", "planner_data"), ("key", "model.emb.weight")), "model.emb*weight")

    d = _edited(tmp_path, "fsdp2_w2/checkpoint", edit)
    _refused(d, tmp_path, "planner_data")


def _storage_key(st: dict[str, Any], fqn: str) -> Any:
    return next(k for k in st["storage_data"] if k.state["fqn"] == fqn)


def test_storage_index_of_no_chunk_is_refused(tmp_path: Path) -> None:
    """A storage entry whose chunk offsets are not one of the tensor's chunks (a key or offset flipped in a
    copy of an entry), beside the intact entries."""

    def edit(st: dict[str, Any]) -> None:
        ix = _storage_key(st, "model.fc1.weight")
        off = ix.state["offset"]
        ghost = type(ix)()
        ghost.state = {**ix.state, "offset": type(off)(tuple(x + 3 for x in off.args[0]))}
        st["storage_data"][ghost] = st["storage_data"][ix]

    d = _edited(tmp_path, "fsdp2_w2/checkpoint", edit)
    _refused(d, tmp_path, "storage_data", "'model.fc1.weight'")


def test_item_offset_pointing_at_another_item_is_refused(tmp_path: Path) -> None:
    """``exp_avg``'s storage moved onto ``exp_avg_sq``'s archive (same shape and dtype, valid CRCs): read
    as is, the output would hold exp_avg_sq twice."""

    def edit(st: dict[str, Any]) -> None:
        sd = st["storage_data"]
        a = next(k for k in sd if k.state["fqn"] == "optim.state.fc1.weight.exp_avg")
        b = next(k for k in sd if k.state["fqn"] == "optim.state.fc1.weight.exp_avg_sq"
                 and k.state["offset"].args == a.state["offset"].args)  # fmt: skip
        sa, sb = sd[a], sd[b]
        assert sa.state["relative_path"] == sb.state["relative_path"]
        sa.state["offset"], sa.state["length"] = sb.state["offset"], sb.state["length"]

    d = _edited(tmp_path, "fsdp2_w2/checkpoint", edit)
    with pytest.raises(CorruptCheckpoint, match="overlap"):
        zckpt.open(d)
    p = _cli("consolidate", d, tmp_path / "o.safetensors", "--no-progress")
    assert p.returncode == 2 and "overlap" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not zckpt.verify(d).ok


def test_bytes_item_pointed_at_an_empty_chunks_archive_is_refused(tmp_path: Path) -> None:
    """Fuzz seed 41, case 37: an optimizer option's bytes item pointed at the archive of an empty chunk (the
    1-element ``scale``'s rank-1 chunk). That archive is never read, so the overlap check passed over it, the
    option became a tensor and ``reshard --to native`` died on it (``unexpected TypeError``)."""

    def edit(st: dict[str, Any]) -> None:
        sd = st["storage_data"]
        empty = next(k for k in sd if k.state["fqn"] == "optimizer.state.scale.exp_avg_sq"
                     and k.state["offset"].args[0] == (1,))  # fmt: skip
        opt = _storage_key(st, "optimizer.param_groups.1.initial_lr")
        to, at = sd[opt].state, sd[empty].state
        to["offset"], to["length"] = at["offset"], at["length"]

    d = _edited(tmp_path, "accelerate_w2/checkpoints/checkpoint_0/optimizer_0", edit)
    with pytest.raises(CorruptCheckpoint, match="initial_lr.*overlap"):
        zckpt.open(d)
    p = _cli("reshard", d, tmp_path / "rs", "--world", "3", "--to", "native", "--no-progress")
    line = p.stderr.strip().splitlines()[0]
    assert p.returncode == 2 and "overlap" in line and ".distcp" in line, p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "rs").exists()


def test_every_fixture_passes_the_cross_checks() -> None:
    """The checks hold on every real save (no false refusal): each folder's metadata parses."""
    from zckpt.formats.dcp.metadata import load_metadata

    folders = sorted(p.parent for p in FIX.rglob(".metadata"))
    assert len(folders) >= 18
    for f in folders:
        md = load_metadata(f)
        assert md.keys and all(".".join(map(str, md.paths[k])) == k for k in md.keys), f


# ---- chunk archives (DCP fuzz seeds) --------------------------------------------------------------------
def _archive_record(d: Path, name: str) -> tuple[Path, int]:
    """(file, absolute offset) of record ``name`` (e.g. ``byteorder``) of the first archive of ``__0_0``."""
    import io
    import zipfile

    f = d / "__0_0.distcp"
    md = pickles.load_opaque((d / ".metadata").read_bytes())
    first = min(i.state["offset"] for i in md.state["storage_data"].values()
                if i.state["relative_path"] == f.name)  # fmt: skip
    length = next(i.state["length"] for i in md.state["storage_data"].values()
                  if i.state["relative_path"] == f.name and i.state["offset"] == first)  # fmt: skip
    blob = f.read_bytes()[first : first + length]
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/" + name))
    n, m = int.from_bytes(blob[info.header_offset + 26 : info.header_offset + 28], "little"), int.from_bytes(
        blob[info.header_offset + 28 : info.header_offset + 30], "little")  # fmt: skip
    return f, first + info.header_offset + 30 + n + m


def test_flipped_bookkeeping_record_is_refused_while_reading(tmp_path: Path) -> None:
    """Seed 11 case 120: a bit flipped in an archive's ``byteorder`` record (CRC-covered; torch.load
    refuses an unknown byte order) was read as intact: diff said EQUAL, consolidate exit 0."""
    d = tmp_path / "ck"
    shutil.copytree(FIX / "threads_w2" / "checkpoint", d)
    f, at = _archive_record(d, "byteorder")
    data = bytearray(f.read_bytes())
    assert data[at : at + 6] == b"little"
    data[at + 1] ^= 0x10
    f.write_bytes(bytes(data))
    p = _cli("consolidate", d, tmp_path / "o.safetensors", "--no-progress")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and lines[0].startswith("error: ") and "__0_0.distcp" in lines[0], p.stderr
    assert "CRC" in lines[0] or "damaged" in lines[0], lines[0]
    assert not zckpt.verify(d).ok


def test_item_that_is_no_archive_is_one_short_line(tmp_path: Path) -> None:
    """Seed 11 case 115: a flipped local-header signature made the item 'neither a torch.save archive nor
    a safetensors blob (<the file's path again>: ...)': a 307-char line. The inner reason no longer repeats
    the path."""
    d = tmp_path / "ck"
    shutil.copytree(FIX / "fsdp2_w2" / "checkpoint", d)
    md = pickles.load_opaque((d / ".metadata").read_bytes())
    info = next(i for k, i in md.state["storage_data"].items() if k.state["fqn"] == "model.fc1.weight")
    f = d / info.state["relative_path"]
    data = bytearray(f.read_bytes())
    data[info.state["offset"]] ^= 0x80  # "PK\x03\x04" -> not a zip local header
    f.write_bytes(bytes(data))
    p = _cli("inspect", d)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) <= 2 and "neither a torch.save archive" in lines[0], p.stderr
    assert lines[0].count(str(f)) == 1 and len(lines[0]) - len(str(f)) < 200, lines[0]


def test_folder_without_metadata_says_so(tmp_path: Path) -> None:
    """Seed 11 case 126: rank files without ``.metadata`` were 'unrecognised' (verify named nothing). Now the
    folder is claimed as DCP and refused: the missing ``.metadata`` is named."""
    d = tmp_path / "ck"
    shutil.copytree(FIX / "fsdp1_w2" / "checkpoint", d)
    (d / ".metadata").unlink()
    p = _cli("consolidate", d, tmp_path / "o.safetensors", "--no-progress")
    assert p.returncode == 2 and p.stderr.startswith(f"error: {d / '.metadata'}: missing"), p.stderr
    rep = zckpt.verify(d)
    assert rep.format == "dcp" and [q.file for q in rep.problems] == [str(d / ".metadata")], rep.problems


@pytest.mark.parametrize("where", ["/etc/passwd", "../__0_0.distcp", "__0_0.distcp\x00"])
def test_item_file_outside_the_folder_names_metadata(tmp_path: Path, where: str) -> None:
    """Seed 11 case 137: a storage entry's file outside the folder was blamed on the folder."""

    def edit(st: dict[str, Any]) -> None:
        next(iter(st["storage_data"].values())).state["relative_path"] = where

    d = _edited(tmp_path, "tp2d_w4/checkpoint", edit)
    _refused(d, tmp_path, "is not a name inside the folder")


@pytest.mark.parametrize("field", [4, 8, 24, 40, 56 + 4, 56 + 8, 76 + 4, 76 + 8, 76 + 12, 76 + 20])
def test_flipped_end_record_field_fails_verify(tmp_path: Path, field: int) -> None:
    """Seed 12 case 15: a bit flipped in an embedded archive's end records (zip64 end record, its locator,
    the end record: disk numbers, entry counts, directory size and offset) passed verify (``zipfile``
    ignores those fields). ``field``: byte offset from the start of the 98-byte tail."""
    d = tmp_path / "ck"
    shutil.copytree(FIX / "fsdp2_bf16_w3" / "checkpoint", d)
    md = pickles.load_opaque((d / ".metadata").read_bytes())
    info = next(i for k, i in md.state["storage_data"].items() if k.state["fqn"] == "model.fc1.weight")
    f, off, n = d / info.state["relative_path"], info.state["offset"], info.state["length"]
    data = bytearray(f.read_bytes())
    assert (
        data[off + n - 98 : off + n - 94] == b"PK\x06\x06"
        and data[off + n - 22 : off + n - 18] == b"PK\x05\x06"
    )
    data[off + n - 98 + field] ^= 0x02
    f.write_bytes(bytes(data))
    rep = zckpt.verify(d)
    assert not rep.ok and {q.file for q in rep.problems} == {str(f)}, rep.problems
    assert all("zip" in q.message for q in rep.problems), rep.problems


@pytest.mark.parametrize(("gone", "how"), [("optimizer_0", "deleted"), ("pytorch_model_fsdp_0", "deleted"),
                                           ("optimizer_0", "fifo")])  # fmt: skip
def test_accelerate_half_pair_is_refused(tmp_path: Path, gone: str, how: str) -> None:
    """Seed 12 case 126 (and 13/206, a FIFO in its place): accelerate's ``optimizer_0/.metadata`` deleted:
    the model folder alone was read as the checkpoint (no optimizer, roles and ties changed), exit 0. Now
    refused, naming the missing file, whichever folder is given."""
    d = tmp_path / "ck"
    shutil.copytree(FIX / "accelerate_w2" / "checkpoints" / "checkpoint_0", d)
    (d / gone / ".metadata").unlink()
    if how == "fifo":
        os.mkfifo(d / gone / ".metadata")
    other = "pytorch_model_fsdp_0" if gone == "optimizer_0" else "optimizer_0"
    for given in (d, d / other):
        p = _cli("consolidate", given, tmp_path / "o.safetensors", "--no-progress")
        want = f"error: {d / gone / '.metadata'}: {'missing' if how == 'deleted' else 'not a readable'}"
        assert p.returncode == 2 and p.stderr.startswith(want), p.stderr
        assert not (tmp_path / "o.safetensors").exists()
    assert not zckpt.verify(d).ok


@pytest.mark.parametrize(
    ("where", "at"),
    [("central", 6), ("central", 8), ("central", 10), ("central", 16), ("central", 24), ("central", 34),
     ("local", 4), ("local", 6), ("local", 8), ("local", 14), ("local", 22)],
)  # fmt: skip
def test_flipped_directory_or_local_header_field_fails_verify(tmp_path: Path, where: str, at: int) -> None:
    """Seed 12 case 155: a bit flipped in a directory entry of a chunk archive passed verify (``zipfile``
    reads some fields only). Every field a reader may use is compared between the directory entry, the
    local header and the data descriptor. ``at``: byte offset in the entry / header of ``data.pkl``."""
    import io
    import zipfile

    d = tmp_path / "ck"
    shutil.copytree(FIX / "fsdp2_bf16_w3" / "checkpoint", d)
    md = pickles.load_opaque((d / ".metadata").read_bytes())
    info = next(i for k, i in md.state["storage_data"].items() if k.state["fqn"] == "model.fc1.weight")
    f, off, n = d / info.state["relative_path"], info.state["offset"], info.state["length"]
    data = bytearray(f.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(data[off : off + n]))) as zf:
        pkl = next(i for i in zf.infolist() if i.filename.endswith("data.pkl"))
        start_dir = zf.start_dir
    base = off + (pkl.header_offset if where == "local" else start_dir)  # data.pkl's entry comes first
    assert data[base : base + 4] == (b"PK\x03\x04" if where == "local" else b"PK\x01\x02")
    data[base + at] ^= 0x04
    f.write_bytes(bytes(data))
    rep = zckpt.verify(d)
    assert not rep.ok and {q.file for q in rep.problems} == {str(f)}, rep.problems


@pytest.mark.parametrize("how", ["fifo", "missing", "garbage", "newer-garbage"])
def test_torchtitan_step_without_readable_metadata_names_it(tmp_path: Path, how: str) -> None:
    """Seed 14 case 61: a FIFO in place of torchtitan's ``step-3/.metadata``: the save folder was "not a
    checkpoint zckpt recognises" (the step lookup skipped the step; verify named nothing). A step folder whose
    ``.metadata`` is there but unreadable, newer than every readable step, or the only step's missing one, is
    now refused naming that file; an older complete step is never read in its place."""
    d = tmp_path / "ck"
    shutil.copytree(FIX / "torchtitan_w2" / "checkpoint", d)
    step = d / "step-3"
    if how == "newer-garbage":  # a complete step-3, and a damaged step-5 after it
        step = d / "step-5"
        shutil.copytree(d / "step-3", step)
    md = step / ".metadata"
    md.unlink()
    if how == "fifo":
        os.mkfifo(md)
    elif how != "missing":
        md.write_bytes(b"not a pickle")
    for args in (("consolidate", d), ("consolidate", d, "--tag", step.name)):
        p = _cli(*args[:2], tmp_path / "o.safetensors", *args[2:], "--no-progress")
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) <= 2 and lines[0].startswith(f"error: {md}: "), p.stderr
        assert not (tmp_path / "o.safetensors").exists()
    rep = zckpt.verify(d)
    assert not rep.ok and [q.file for q in rep.problems] == [str(md)], rep.problems


def test_torchtitan_unfinished_newer_step_is_passed_over(tmp_path: Path) -> None:
    """A newer ``step-N`` folder with ``.distcp`` files and no ``.metadata`` is a save in progress: like
    torchtitan's own loader, the newest complete step is read."""
    d = tmp_path / "ck"
    shutil.copytree(FIX / "torchtitan_w2" / "checkpoint", d)
    shutil.copytree(d / "step-3", d / "step-5")
    (d / "step-5" / ".metadata").unlink()
    with zckpt.open(d) as ck:
        assert ck.meta.path == str(d / "step-3")


def test_local_header_name_flip_is_one_short_line(tmp_path: Path) -> None:
    """Seed 15 case 115: a bit flipped in the local header name of a value item's ``.data/serialization_id``
    record: the error quoted zipfile's whole message (both names), a 304-char line. Now the header's name
    only, without zipfile's class name."""
    import io
    import zipfile

    d = tmp_path / "ck"
    shutil.copytree(FIX / "torchtitan_w2" / "checkpoint", d)
    md = pickles.load_opaque((d / "step-3" / ".metadata").read_bytes())
    info = next(i for k, i in md.state["storage_data"].items() if k.state.get("offset") is None)
    f, off, n = d / "step-3" / info.state["relative_path"], info.state["offset"], info.state["length"]
    data = bytearray(f.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(data[off : off + n]))) as zf:
        rec = next(i for i in zf.infolist() if i.filename.endswith("/.data/serialization_id"))
    at = off + rec.header_offset + 30 + len(rec.filename) - len("a/serialization_id")  # '.data' -> '.date'
    assert data[at : at + 1] == b"a"
    data[at] ^= 0x04
    f.write_bytes(bytes(data))
    p = _cli("inspect", d)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) <= 2 and lines[0].startswith(f"error: {f} "), p.stderr
    assert "local header name" in lines[0] and "BadZipFile" not in lines[0], lines[0]
    assert len(lines[0]) - len(str(f)) < 200, lines[0]
    assert not zckpt.verify(d).ok
    # consolidate opens the model chunks only: the value's archive is not read, the model is intact
    src = FIX / "torchtitan_w2" / "checkpoint"
    ref = zckpt.consolidate(src, tmp_path / "ref.safetensors", progress=False)
    got = zckpt.consolidate(d, tmp_path / "o.safetensors", progress=False)
    assert got.bytes == ref.bytes
    assert (tmp_path / "o.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_bytes_after_the_last_item_fail_verify(tmp_path: Path) -> None:
    """Seed 15 case 165: 770 bytes appended to a ``.distcp`` file: verify said OK (items are read by offset,
    and DCP writes a file's items back to back to its end). Files of safetensors items are not checked (their
    header and alignment are between items): that fixture still verifies."""
    d = tmp_path / "ck"
    shutil.copytree(FIX / "torchtitan_w2" / "checkpoint", d)
    f = d / "step-3" / "__0_0.distcp"
    with f.open("ab") as out:
        out.write(b"\0" * 770)
    rep = zckpt.verify(d)
    assert not rep.ok and [q.file for q in rep.problems] == [str(f)], rep.problems
    assert "770 bytes after its last item" in rep.problems[0].message, rep.problems
    assert zckpt.verify(FIX / "stformat_w2" / "checkpoint").ok


def test_blob_item_of_an_empty_chunk_given_another_items_length_is_refused(tmp_path: Path) -> None:
    """DCP seed 32: in a safetensors-serialized save, the storage entry of an empty chunk (never read) was
    re-pointed at another item of the same blob (4 bytes); verify said OK. A blob's item is exactly its
    chunk's bytes, so that length names another item."""

    def edit(st: dict[str, Any]) -> None:
        sd = st["storage_data"]
        empty = next(k for k in sd if k.state["fqn"] == "optim.state.scale.exp_avg_sq"
                     and tuple(k.state["offset"].args[0]) == (1,))  # fmt: skip
        assert sd[empty].state["length"] == 0
        sd[empty].state["length"] = 4

    d = _edited(tmp_path, "stformat_w2/checkpoint", edit)
    _refused(d, tmp_path, "storage_data", "'optim.state.scale.exp_avg_sq' chunk [1]", "holds 0")
