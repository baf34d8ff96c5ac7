"""``--overwrite`` replaces only what zckpt writes and never deletes a file zckpt did not write.

consolidate into an HF folder keeps every other file (transformers' ``save_pretrained`` convention: only
its own weights name's stale shards go); reshard into a checkpoint folder refuses, naming them. Stale
shards of an earlier run with another shard count never survive beside the new set. Oracles: the folder
listings and bytes written by hand before the run, safetensors' own loader."""

from __future__ import annotations

import errno
import json
import tempfile
import warnings
from pathlib import Path

import pytest
from _fixtures import fixture
from safetensors.torch import load_file

import zckpt
from zckpt.errors import OutputExists, OutputNotWritable, WriteFailed
from zckpt.formats._names import HF_WEIGHT_BASES
from zckpt.stream.shards import family

DS = "s1_bf16_w2"


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _user_files(out: Path) -> dict[str, bytes]:
    """Files a user put in an HF folder: none of them zckpt's."""
    files = {
        "config.json": b'{"model_type": "toy", "mine": true}',
        "tokenizer.json": b'{"tok": 1}',
        "README.md": b"# my model\n",
        "notes/eval.txt": b"ppl 3.1\n",
        "mymodel.safetensors": b"not zckpt's name",
    }
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    return files


def test_consolidate_folder_overwrite_keeps_files_zckpt_did_not_write(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    mine = _user_files(out)
    # an earlier zckpt output: 3 shards + index + sidecars, and a .bin set (both would shadow the new set)
    for k in (1, 2, 3):
        (out / f"model-0000{k}-of-00003.safetensors").write_bytes(b"old")
        (out / f"model-0000{k}-of-00003.safetensors.sha256").write_text("x")
        (out / f"model-0000{k}-of-00003.safetensors.sha256.json").write_text("x")  # an older zckpt's
    (out / "model.safetensors.index.json").write_text("{}")
    (out / "pytorch_model.bin").write_bytes(b"old")
    res = zckpt.consolidate(fixture("ds", DS), out, overwrite=True, progress=False)
    assert _listing(out) == sorted(
        ["README.md", "config.json", "mymodel.safetensors", "notes", "notes/eval.txt", "tokenizer.json",
         "model.safetensors", "model.safetensors.crc32.json"]
    )  # fmt: skip
    for name, data in mine.items():
        assert (out / name).read_bytes() == data, name
    assert sorted(res.kept) == ["README.md", "config.json", "mymodel.safetensors", "notes", "tokenizer.json"]
    assert len(load_file(out / "model.safetensors")) == res.tensors


def test_consolidate_folder_overwrite_fewer_shards_leaves_no_stale_shard(tmp_path: Path) -> None:
    src = fixture("ds", DS)
    out = tmp_path / "hf"
    zckpt.consolidate(src, out, max_shard_size=400, dtype="fp32", progress=False)
    many = [p.name for p in out.glob("model-*-of-*.safetensors")]
    assert len(many) >= 3
    (out / "tokenizer.json").write_text("{}")
    zckpt.consolidate(src, out, max_shard_size="1KB", dtype="fp32", overwrite=True, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert shards == sorted(set(index["weight_map"].values())) and len(shards) < len(many)
    assert sorted(p.name for p in out.glob("*.json") if p.name.startswith("model-")) == [
        s + ".crc32.json" for s in shards
    ]
    assert (out / "tokenizer.json").read_text() == "{}"


def test_copied_hf_files_replace_their_namesakes(tmp_path: Path) -> None:
    """Files zckpt copies in (config/tokenizer from beside the checkpoint) are its own: replaced."""
    src = fixture("trainer", "trainer_z2_w2", "checkpoint-3")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"old": true}')
    (out / "extra.txt").write_text("mine")
    res = zckpt.consolidate(src, out, overwrite=True, progress=False)
    assert "config.json" in res.copied and "config.json" not in res.kept
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
    assert (out / "extra.txt").read_text() == "mine" and res.kept == ("extra.txt",)


def test_hf_weight_family_names() -> None:
    owns = family(HF_WEIGHT_BASES)
    for n in ("model.safetensors", "model-00002-of-00009.safetensors.sha256", "pytorch_model.bin.index.json",
              "model.safetensors.crc32.json", "model-00001-of-00002.safetensors.sha256.json",
              "pytorch_model-00001-of-00002.bin", "model.safetensors.index.json"):  # fmt: skip
        assert owns(n), n
    for n in ("config.json", "mymodel.safetensors", "model.safetensors.bak", "model-1-of-2.safetensors",
              "adapter_model.safetensors", "model.bin"):  # fmt: skip
        assert not owns(n), n


def test_reshard_overwrite_refuses_foreign_files_and_names_them(tmp_path: Path) -> None:
    src = fixture("ds", DS)
    out = tmp_path / "r"
    zckpt.reshard(src, out, world=3, progress=False)
    (out / "notes.txt").write_text("mine")
    (out / "global_step3" / "eval.json").write_text("{}")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(OutputExists, match=r"2 other file\(s\): global_step3/eval.json, notes.txt"):
        zckpt.reshard(src, out, world=2, overwrite=True, progress=False)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing touched


def test_reshard_overwrite_replaces_an_earlier_output_of_another_world(tmp_path: Path) -> None:
    src = fixture("ds", DS)
    out = tmp_path / "r"
    zckpt.reshard(src, out, world=3, progress=False)
    zckpt.reshard(src, out, world=2, overwrite=True, progress=False)
    ranks = sorted(p.name for p in (out / "global_step3").glob("*optim_states.pt"))
    assert ranks == [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]  # no stale rank 2
    assert zckpt.verify(out).ok


def test_trainer_reshard_overwrite_replaces_its_own_rng_files(tmp_path: Path) -> None:
    src = fixture("trainer", "trainer_z2_w2", "checkpoint-3")
    out = tmp_path / "ck"
    zckpt.reshard(src, out, world=2, progress=False)
    assert (out / "rng_state_1.pth").exists()
    zckpt.reshard(src, out, world=1, overwrite=True, progress=False)
    assert sorted(p.name for p in out.glob("rng_state*")) == ["rng_state.pth"]


def test_unwritable_output_names_the_given_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "o.safetensors"

    def denied(*a: object, **k: object) -> str:
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / ".o.safetensors.zckpt-tmp-x"))

    monkeypatch.setattr(tempfile, "mkdtemp", denied)
    with pytest.raises(OutputNotWritable) as ei:
        zckpt.consolidate(fixture("ds", DS), out, progress=False)
    assert isinstance(ei.value, PermissionError)
    assert str(ei.value).startswith(f"{out}: cannot write here (Permission denied)")
    assert "zckpt-tmp" not in str(ei.value) and ei.value.path == str(out)


def test_missing_parent_is_reported_as_the_given_path(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("a file, not a folder")
    out = tmp_path / "f" / "o.safetensors"
    with pytest.raises(WriteFailed, match=rf"^{out}: cannot write here") as ei:
        zckpt.consolidate(fixture("ds", DS), out, progress=False)
    assert "zckpt-tmp" not in str(ei.value)


def test_cli_unwritable_output_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from zckpt.cli.app import app

    (tmp_path / "f").write_text("")
    r = CliRunner(env={"ZCKPT_DEBUG": ""}).invoke(
        app, ["consolidate", str(fixture("ds", DS)), str(tmp_path / "f" / "o.safetensors")]
    )
    assert r.exit_code == 2
    first = r.output.splitlines()[0]
    assert (
        first.startswith(f"error: {tmp_path / 'f' / 'o.safetensors'}: cannot write here (")
        and "tmp-" not in first
    )


def test_overwrite_keeps_files_without_renameat2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rename-twice fallback (no ``RENAME_EXCHANGE``) keeps the same files."""
    from zckpt.storage import staging

    monkeypatch.setattr(staging, "_renameat2", lambda a, b, flags: False)
    out = tmp_path / "hf"
    out.mkdir()
    mine = _user_files(out)
    zckpt.consolidate(fixture("ds", DS), out, overwrite=True, progress=False)
    assert all((out / n).read_bytes() == d for n, d in mine.items())
    assert not [p for p in tmp_path.iterdir() if "zckpt-tmp" in p.name]


def test_a_killed_swaps_old_folder_is_never_removed(tmp_path: Path) -> None:
    """``.<out>.zckpt-tmp-<host>-<pid>-old`` of a dead process is the previous output (user files included):
    the next run leaves it; staging folders of dead processes are removed as before."""
    import socket
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    old = tmp_path / f".hf.zckpt-tmp-{socket.gethostname()}-{pid}-old"
    tmp = tmp_path / f".hf.zckpt-tmp-{socket.gethostname()}-{pid}-abc123"
    for d in (old, tmp):
        d.mkdir()
        (d / "config.json").write_text("{}")
    with pytest.warns(UserWarning, match="staging folder of a killed run"):
        zckpt.consolidate(fixture("ds", DS), tmp_path / "hf", progress=False)
    assert (old / "config.json").exists() and not tmp.exists()


def test_kept_config_naming_another_dtype_is_warned(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "toy", "torch_dtype": "float32"}')
    want = r"config.json \(kept, not written by zckpt\) names dtype float32; the weights are bfloat16"
    with pytest.warns(UserWarning, match=want):
        zckpt.consolidate(fixture("ds", DS), out, overwrite=True, progress=False)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"  # the user's, untouched
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same dtype: nothing to say
        zckpt.consolidate(fixture("ds", DS), out, overwrite=True, dtype="fp32", progress=False)
