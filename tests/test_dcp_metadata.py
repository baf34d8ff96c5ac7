"""``.metadata`` cross-checks on real DCP fixtures: every table that names a key (``planner_data`` paths,
``storage_data`` indices) agrees with ``state_dict_metadata``, and no two items share bytes of a file.

Each case edits a copy of a real torch save (``fixtures/dcp``) through the fuzz harness's inert pickle
round trip (``tests/fuzz/pickles.py``: nothing from the file is imported or called), then expects one
``error:`` line naming ``.metadata`` (exit 2, nothing written) and ``verify`` not to say OK.
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


def test_every_fixture_passes_the_cross_checks() -> None:
    """The checks hold on every real save (no false refusal): each folder's metadata parses."""
    from zckpt.formats.dcp.metadata import load_metadata

    folders = sorted(p.parent for p in FIX.rglob(".metadata"))
    assert len(folders) >= 18
    for f in folders:
        md = load_metadata(f)
        assert md.keys and all(".".join(map(str, md.paths[k])) == k for k in md.keys), f
