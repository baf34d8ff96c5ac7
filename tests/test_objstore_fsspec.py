"""Schemes other than ``s3://`` go through fsspec (``zckpt.storage.objstore.backend.Fsspec``), tested with
fsspec's in-process ``memory://`` filesystem: consolidate and reshard read from it and write to it,
byte-identical to the local run (the oracle); a scheme nobody serves is refused in one line, exit 2."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import fsspec  # the dev extra installs it
import pytest
from _fixtures import fixture
from typer.testing import CliRunner

from zckpt.cli.app import app

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1", "ZCKPT_DEBUG": ""})


def _cli(*args: object) -> tuple[int, str]:
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


@pytest.fixture
def mem() -> Iterator[object]:
    """fsspec's memory filesystem, empty before and after (it is one store for the whole process)."""
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs[:] = [""]
    yield fs
    fs.store.clear()
    fs.pseudo_dirs[:] = [""]


def _put(fs: object, folder: Path, prefix: str) -> str:
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            fs.pipe_file(f"/{prefix}/{p.relative_to(folder).as_posix()}", p.read_bytes())  # type: ignore[attr-defined]
    return f"memory://{prefix}"


def _tree_local(p: Path) -> dict[str, bytes]:
    return {f.relative_to(p).as_posix(): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}


def _tree_mem(fs: object, prefix: str) -> dict[str, bytes]:
    names = fs.find(f"/{prefix}")  # type: ignore[attr-defined]
    return {n[len(prefix) + 2 :]: fs.cat_file(n) for n in sorted(names)}  # type: ignore[attr-defined]


@pytest.mark.parametrize("case", [("ds", "s3_fp32_w2"), ("dcp", "fsdp2_w2", "checkpoint")])
def test_consolidate_from_and_to_memory_matches_local(
    mem: object, case: tuple[str, ...], tmp_path: Path
) -> None:
    src = fixture(*case)
    url = _put(mem, src, "in")
    assert _cli("consolidate", src, tmp_path / "m.safetensors")[0] == 0
    code, out = _cli("consolidate", url, tmp_path / "from_mem.safetensors")
    assert code == 0, out
    assert (tmp_path / "from_mem.safetensors").read_bytes() == (tmp_path / "m.safetensors").read_bytes()
    # to the store: a sharded HF folder, every object byte-identical, the index among them
    assert _cli("consolidate", src, tmp_path / "hf", "--max-shard-size", "600B")[0] == 0
    code, out = _cli("consolidate", url, "memory://out/hf", "--max-shard-size", "600B")
    assert code == 0, out
    want = _tree_local(tmp_path / "hf")
    assert len(want) > 3 and _tree_mem(mem, "out/hf") == want
    assert _cli("verify", "memory://out/hf")[0] == 0
    code, out = _cli("consolidate", url, "memory://out/hf", "--max-shard-size", "600B")
    assert code == 2 and "already exists" in out  # refused without --overwrite, as a local folder


@pytest.mark.parametrize("to", ["native", "dcp", "deepspeed"])
def test_reshard_memory_to_memory_matches_local(mem: object, to: str, tmp_path: Path) -> None:
    src = fixture("ds", "s3_fp32_w2")
    url = _put(mem, src, "in")
    assert _cli("reshard", src, tmp_path / "local", "--world", "3", "--to", to)[0] == 0
    code, out = _cli("reshard", url, "memory://out/rs", "--world", "3", "--to", to)
    assert code == 0, out
    assert _tree_mem(mem, "out/rs") == _tree_local(tmp_path / "local")


def test_unknown_scheme_is_one_line(tmp_path: Path) -> None:
    for cmd in (
        ["inspect", "nosuchproto://b/x"],
        ["consolidate", "nosuchproto://b/x", tmp_path / "m.safetensors"],
    ):
        code, out = _cli(*cmd)
        lines = out.strip().splitlines()
        assert code == 2 and len(lines) == 2, out
        assert lines[0] == "error: nosuchproto://b/x: no client for nosuchproto:// URLs", out
        assert lines[1].startswith("hint: ") and "Traceback" not in out
    assert not (tmp_path / "m.safetensors").exists()
