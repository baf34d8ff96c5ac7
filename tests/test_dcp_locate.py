"""A model-only DCP open (consolidate, diff) locates each tensor's chunk archives when its bytes are first
needed (``zckpt.formats.dcp.locate``), on real torch saves (``fixtures/dcp``): nothing located at the open,
what was read located once, the files closed when all are, the output bit-exact to the full open's; a damaged
archive is still one line from the command, now raised by the thread that fills that tensor, with nothing
written; and a file's tensor items are all archives or all in one safetensors blob.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import zckpt
from tests.fuzz import pickles
from zckpt.formats.dcp import chunks

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "fixtures" / "dcp"


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "zckpt.cli.app", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def _copy(tmp: Path, case: str = "fsdp2_w2") -> Path:
    src = FIX / case / "checkpoint"
    assert (src / ".metadata").is_file(), f"fixture missing: {src}"
    return Path(shutil.copytree(src, tmp / "ck"))


def _fds() -> set[str]:
    out = set()
    for n in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            out.add(os.readlink(f"/proc/self/fd/{n}"))
    return out


def _chunk_items(d: Path) -> list[tuple[str, Any]]:
    """(fqn, storage info) of every tensor item of the ``.metadata``, in its order."""
    md = pickles.load_opaque((d / ".metadata").read_bytes())
    return [(k.state["fqn"], i) for k, i in md.state["storage_data"].items() if k.state.get("offset")]


def _flip_signature(d: Path, info: Any) -> Path:
    f = d / info.state["relative_path"]
    data = bytearray(f.read_bytes())
    data[info.state["offset"]] ^= 0x80  # "PK\x03\x04": no zip header now
    f.write_bytes(bytes(data))
    return f


def _refused_while_writing(d: Path, tmp: Path, *phrases: str) -> str:
    out = tmp / "out.safetensors"
    p = _cli("consolidate", d, out, "--no-progress")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and lines[0].startswith("error: ") and len(lines) <= 2, p.stderr
    assert "Traceback" not in p.stderr and all(ph in lines[0] for ph in phrases), p.stderr
    assert not out.exists() and not list(tmp.glob("out*"))
    return lines[0]


def test_chunks_are_located_when_first_read_once_and_the_files_then_closed(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    calls: list[str] = []
    real = chunks.Files.tensor

    def counted(self: chunks.Files, key: str, *a: object) -> chunks.ChunkData:
        calls.append(key)
        return real(self, key, *a)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunks.Files, "tensor", counted)
        with zckpt.open(d) as full:
            want = {k: full[k] for k in full}
            zckpt.consolidate(full, tmp_path / "ref.safetensors", progress=False)
        full_calls = len(calls)
        calls.clear()
        before = _fds()
        with zckpt.open(d, model_only=True) as part:
            at_open = list(calls)  # the optimizer's step; would-be ties (frozen tensors and their owners)
            rest = [k for k in want if f"model.{k}" not in at_open]
            assert "fc1.weight" in rest and len(rest) >= len(want) // 2, at_open
            first = rest[0]
            assert torch.equal(part[first], want[first])
            once = calls[len(at_open) :]
            assert once and set(once) == {f"model.{first}"}  # its chunks, and nothing else
            assert torch.equal(part[first], want[first]) and calls[len(at_open) :] == once  # located once
            out = tmp_path / "o.safetensors"
            zckpt.consolidate(part, out, progress=False)
            assert sorted(set(calls)) == sorted(set(at_open) | {f"model.{k}" for k in want})
            assert len(calls) < full_calls  # no optimizer state's archive was opened
        assert not {f for f in _fds() - before if f.startswith(str(d))}  # none left open after the close
        part = zckpt.open(d, model_only=True)  # nothing read: the locator's files close when it is dropped
        part.close()  # the reads' files (the step's)
        assert {f for f in _fds() - before if f.startswith(str(d))}
        del part
        gc.collect()
        assert not {f for f in _fds() - before if f.startswith(str(d))}
    assert out.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    got = load_file(out)
    assert got and all(torch.equal(got[k], want[k]) for k in got)


def test_damaged_archive_fails_the_consolidate_not_the_open(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    info = next(i for fqn, i in _chunk_items(d) if fqn == "model.fc1.weight")
    f = _flip_signature(d, info)
    with zckpt.open(d, model_only=True) as part:
        assert "fc1.weight" in part  # nothing located yet
    line = _refused_while_writing(d, tmp_path, "neither a torch.save archive", str(f))
    assert ".metadata" not in line


def test_first_tensor_item_of_its_file_damaged_is_not_taken_for_a_blob(tmp_path: Path) -> None:
    """Which files hold a safetensors blob is read from each file's first tensor item: a damaged one is an
    archive the locate names, not a blob whose length the ``.metadata`` got wrong."""
    d = _copy(tmp_path)
    items = _chunk_items(d)
    rel = items[0][1].state["relative_path"]
    info = min((i for _, i in items if i.state["relative_path"] == rel), key=lambda i: i.state["offset"])
    f = _flip_signature(d, info)
    line = _refused_while_writing(d, tmp_path, "neither a torch.save archive", str(f))
    assert ".metadata" not in line


def test_a_blob_in_a_file_of_archives_is_refused(tmp_path: Path) -> None:
    """A chunk pointed at a safetensors blob appended to a file whose tensor items are archives: no real save
    mixes them, and a blob's offsets are not checked against the archives'. Refused naming the file (the
    open that located everything first refused it too, blaming the ``.metadata``'s item lengths)."""
    d = _copy(tmp_path)
    md = pickles.load_opaque((d / ".metadata").read_bytes())
    key, info = next(
        (k, i) for k, i in md.state["storage_data"].items() if k.state["fqn"] == "model.fc1.weight"
    )
    chunk = md.state["state_dict_metadata"]["model.fc1.weight"].state["chunks"][0]
    assert chunk.state["offsets"].args == key.state["offset"].args
    sizes = list(chunk.state["sizes"].args[0])
    raw = torch.full(sizes, 7.0).numpy().tobytes()
    header = json.dumps({"model.fc1.weight": {"dtype": "F32", "shape": sizes, "data_offsets": [0, len(raw)]}})
    hb = header.encode() + b" " * (-len(header) % 8)
    f = d / info.state["relative_path"]
    start = f.stat().st_size
    with f.open("ab") as fh:
        fh.write(struct.pack("<Q", len(hb)) + hb + raw)
    info.state["offset"], info.state["length"] = start, len(raw)
    (d / ".metadata").write_bytes(pickles.dump_opaque(md))
    _refused_while_writing(d, tmp_path, "holds both torch.save archives and a safetensors blob", str(f))


def test_threads_asking_at_once_get_the_same_pieces(tmp_path: Path) -> None:
    d = _copy(tmp_path, "fsdp2_w4")
    with zckpt.open(d) as full:
        want = {k: full[k] for k in full}
    with zckpt.open(d, model_only=True) as part, ThreadPoolExecutor(8) as pool:
        keys = list(part)
        got = list(pool.map(lambda k: part.entry(k).pieces, keys * 4))
        assert all(g is part.entry(k).pieces for g, k in zip(got, keys * 4, strict=True))
        read = pool.map(part.__getitem__, keys)
        assert all(torch.equal(x, want[k]) for k, x in zip(keys, read, strict=True))
