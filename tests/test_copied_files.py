"""Files zckpt copies byte for byte into an output (``zckpt.storage.copied``): the HF side files of
``consolidate`` to a folder and an HF Trainer folder's files under ``reshard``. A link leading out of the
checkpoint's folder is refused, so a checkpoint cannot make an output carry a file from elsewhere on the
machine; a FIFO, device, folder or broken link where a side file is named is refused instead of the side
files being left out in silence. Links inside the folder, and a hub cache snapshot's links to its blobs,
are followed. Input: the real HF Trainer ``checkpoint-3`` (ZeRO-2, world 2) of ``fixtures/trainer``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from _fixtures import fixture
from _safety import assert_one_line_error, cli

TRAINER = "trainer/trainer_z2_w2/checkpoint-3"
SECRET = b"aws_secret_access_key = not-for-the-output\n"


def _trainer_copy(tmp: Path) -> Path:
    src = fixture(TRAINER)
    dst = tmp / "in" / "checkpoint-3"
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _secret(tmp: Path) -> Path:
    s = tmp / "home" / "credentials"
    s.parent.mkdir(parents=True)
    s.write_bytes(SECRET)
    return s


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json"])
def test_consolidate_refuses_a_side_file_linking_out_of_the_folder(name: str, tmp_path: Path) -> None:
    ck = _trainer_copy(tmp_path)
    (ck / name).unlink()
    (ck / name).symlink_to(_secret(tmp_path))
    out = tmp_path / "out"
    err = assert_one_line_error(cli("consolidate", ck, out), name, "leading out")
    assert str(tmp_path / "home" / "credentials") in err
    assert not out.exists()


def test_reshard_of_a_trainer_folder_refuses_a_file_linking_out(tmp_path: Path) -> None:
    ck = _trainer_copy(tmp_path)
    (ck / "scheduler.pt").unlink()
    (ck / "scheduler.pt").symlink_to(_secret(tmp_path))
    out = tmp_path / "out"
    assert_one_line_error(cli("reshard", ck, out, "--world", "1"), "scheduler.pt", "leading out")
    assert not out.exists()


@pytest.mark.parametrize("kind", ["fifo", "folder", "broken-link"])
def test_consolidate_refuses_a_side_file_that_is_not_a_file(kind: str, tmp_path: Path) -> None:
    """Before: a FIFO ``config.json`` made every side file (config, tokenizer, generation config) be left
    out of the output, exit 0."""
    ck = _trainer_copy(tmp_path)
    cfg = ck / "config.json"
    cfg.unlink()
    if kind == "fifo":
        os.mkfifo(cfg)
    elif kind == "folder":
        cfg.mkdir()
    else:
        cfg.symlink_to(ck / "nowhere.json")
    out = tmp_path / "out"
    assert_one_line_error(cli("consolidate", ck, out), "config.json")
    assert not out.exists()


def test_links_inside_the_folder_are_followed(tmp_path: Path) -> None:
    ck = _trainer_copy(tmp_path)
    want = (ck / "tokenizer.json").read_bytes()
    (ck / "tokenizer.json").rename(ck / "global_step3" / "tok.json")
    (ck / "tokenizer.json").symlink_to(Path("global_step3") / "tok.json")
    r = cli("consolidate", ck, tmp_path / "out")
    assert r.code == 0, r.stderr
    got = tmp_path / "out" / "tokenizer.json"
    assert not got.is_symlink() and got.read_bytes() == want


def test_a_hub_cache_snapshot_is_consolidated_with_its_side_files(tmp_path: Path) -> None:
    """``models--org--name/snapshots/<rev>/<file> -> ../../blobs/<hash>``: the layout
    ``huggingface_hub`` downloads into; every file is a link to a blob outside the snapshot folder."""
    src = fixture(TRAINER)
    repo = tmp_path / "hub" / "models--org--name"
    snap = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, name in enumerate(["config.json", "model.safetensors", "tokenizer.json"]):
        shutil.copy(src / name, repo / "blobs" / f"blob{i}")
        (snap / name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    r = cli("consolidate", snap, tmp_path / "out")
    assert r.code == 0, r.stderr
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert (tmp_path / "out" / "config.json").is_file()


def test_consolidate_refuses_a_huge_side_file_before_copying_it(tmp_path: Path) -> None:
    """A 64 GiB sparse ``tokenizer.json``: refused at once (before: copied byte for byte, minutes of zeros
    filling the disk; the hostile-input run's limit killed it at 60 s)."""
    import time

    ck = _trainer_copy(tmp_path)
    os.truncate(ck / "tokenizer.json", 64 << 30)
    t0 = time.monotonic()
    r = cli("consolidate", ck, tmp_path / "out")
    assert_one_line_error(r, "tokenizer.json", "68,719,476,736 bytes")
    assert time.monotonic() - t0 < 30 and not (tmp_path / "out").exists()


def test_reshard_refuses_a_huge_small_file_of_a_trainer_folder(tmp_path: Path) -> None:
    """``scheduler.pt`` (kilobytes in a real Trainer folder) as a 64 GiB sparse file: refused before it is
    copied; weights the Trainer saved beside the ZeRO state are copied whatever their size."""
    ck = _trainer_copy(tmp_path)
    os.truncate(ck / "scheduler.pt", 64 << 30)
    r = cli("reshard", ck, tmp_path / "out", "--world", "1")
    assert_one_line_error(r, "scheduler.pt", "68,719,476,736 bytes")
    assert not (tmp_path / "out").exists()
