"""safetensors / HF folder reader and writer (zckpt.formats.hf), checked against the safetensors library."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import zckpt
from zckpt.errors import CorruptCheckpoint, OutputExists, ShardMismatch, Unsupported
from zckpt.formats import hf, torch_file
from zckpt.model import Role
from zckpt.stream.items import WriteItem, entry_from_tensor, items_from_state_dict

torch.manual_seed(0)
EMB = torch.randn(13, 7)
SD = {
    "emb.weight": EMB,
    "fc.weight": torch.randn(11, 7).bfloat16(),
    "fc.bias": torch.randn(11).half(),
    "scale": torch.randn(1),
    "steps": torch.arange(5, dtype=torch.int64),
    "mask": torch.tensor([True, False, True]),
    "empty": torch.zeros(0, 3),
    "scalar": torch.tensor(2.5, dtype=torch.float64),
    "head.weight": EMB,  # tied to emb.weight
}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k], t), k


def test_write_then_safetensors_loads_it(tmp_path: Path) -> None:
    items, tied = items_from_state_dict(SD)
    assert tied == {"head.weight": "emb.weight"}
    files = hf.write_safetensors(tmp_path / "m.safetensors", items, tied=tied)
    assert sorted(f.name for f in files) == ["m.safetensors", "m.safetensors.crc32.json"]
    got = load_file(tmp_path / "m.safetensors")
    _assert_same(got, {k: v for k, v in SD.items() if k != "head.weight"})  # one copy of the tied weight
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        md = f.metadata()
    assert md["format"] == "pt"
    assert json.loads(md[hf.TIED_KEY]) == {"head.weight": "emb.weight"}
    (n,) = struct.unpack("<Q", (tmp_path / "m.safetensors").read_bytes()[:8])
    assert (8 + n) % 8 == 0  # data section aligned like safetensors' own writer


def test_read_file_written_by_safetensors_lazily(tmp_path: Path) -> None:
    sd = {k: v for k, v in SD.items() if k != "head.weight"}
    save_file(sd, tmp_path / "x.safetensors", metadata={"format": "pt"})
    assert hf.FORMAT.detect(tmp_path / "x.safetensors")
    with zckpt.open(tmp_path / "x.safetensors") as ck:
        assert ck.meta.format == "hf"
        assert all(len(e.pieces) == 1 for e in ck.entries.values())
        roles = {k: e.role for k, e in ck.entries.items()}
        assert roles == {k: Role.PARAM if t.is_floating_point() else Role.BUFFER for k, t in sd.items()}
        _assert_same({k: ck[k] for k in ck}, sd)


def test_roles_and_tied_roundtrip(tmp_path: Path) -> None:
    items = [
        WriteItem("w", entry_from_tensor("w", EMB), torch.float32),
        WriteItem("frz", entry_from_tensor("frz", EMB[:2], Role.FROZEN), torch.bfloat16),
        WriteItem("buf", entry_from_tensor("buf", torch.arange(3), Role.BUFFER), torch.int64),
    ]
    hf.write_safetensors(tmp_path / "r.safetensors", items, tied={"alias": "w"})
    ck = zckpt.open(tmp_path / "r.safetensors")
    assert {k: e.role for k, e in ck.entries.items()} == {
        "w": Role.PARAM,
        "frz": Role.FROZEN,
        "buf": Role.BUFFER,
    }
    assert ck.meta.tied == {"alias": "w"}
    assert torch.equal(ck["alias"], EMB)
    assert torch.equal(ck["frz"], EMB[:2].bfloat16())


def test_sharded_folder_index_and_read_back(tmp_path: Path) -> None:
    items, tied = items_from_state_dict(SD)
    out = tmp_path / "model"
    hf.write_safetensors(out, items, tied=tied, max_shard_size=300)
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert "head.weight" not in idx["weight_map"]  # transformers re-ties; listing it would be "missing"
    assert idx["metadata"][hf.TIED_KEY] == {"head.weight": "emb.weight"}
    assert idx["metadata"]["total_size"] == sum(it.nbytes for it in items)
    merged: dict[str, torch.Tensor] = {}
    for s in shards:
        part = load_file(out / s)
        assert all(idx["weight_map"][k] == s for k in part)
        merged.update(part)
    _assert_same(merged, {k: v for k, v in SD.items() if k != "head.weight"})
    with zckpt.open(out) as ck:
        assert ck.meta.tied == {"head.weight": "emb.weight"}
        _assert_same({k: ck[k] for k in ck}, SD)
    (out / shards[-1]).unlink()
    with pytest.raises(ShardMismatch, match="missing"):
        zckpt.open(out)


def test_hf_folder_of_sharded_bin(tmp_path: Path) -> None:
    items, tied = items_from_state_dict(SD)
    out = tmp_path / "binmodel"
    torch_file.write_torch(out, items, tied=tied, max_shard_size=300)
    assert (out / "pytorch_model.bin.index.json").is_file()
    assert hf.FORMAT.detect(out)
    with zckpt.open(out) as ck:
        assert ck.meta.format == "hf"
        _assert_same({k: ck[k] for k in ck}, SD)


def _raw(header: dict, data: bytes, *, n: int | None = None) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h) if n is None else n) + h + data


@pytest.mark.parametrize(
    ("header", "data", "n", "err", "match"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, None, CorruptCheckpoint,
         "truncated"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, 10**9, CorruptCheckpoint,
         "header length"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None, CorruptCheckpoint,
         "overlap"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, CorruptCheckpoint,
         "do not hold"),
        ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, Unsupported, "Q4"),
        ({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, CorruptCheckpoint, "data_offsets"),
        ({"__metadata__": {"x": 1}}, b"", None, CorruptCheckpoint, "__metadata__"),
    ],
)  # fmt: skip
def test_strict_header_validation(tmp_path: Path, header: dict, data: bytes, n: int | None, err: type,
                                  match: str) -> None:  # fmt: skip
    f = tmp_path / "bad.safetensors"
    f.write_bytes(_raw(header, data, n=n))
    with pytest.raises(err, match=match) as ei:
        zckpt.open(f)
    assert str(f) in str(ei.value)


def test_not_json_and_tiny_files(tmp_path: Path) -> None:
    f = tmp_path / "x.safetensors"
    f.write_bytes(b"\x03")
    with pytest.raises(CorruptCheckpoint, match="too short"):
        zckpt.open(f)
    f.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(CorruptCheckpoint, match="JSON"):
        zckpt.open(f)


def test_writer_refuses_existing_output(tmp_path: Path) -> None:
    items, _ = items_from_state_dict({"a": torch.ones(2)})
    hf.write_safetensors(tmp_path / "a.safetensors", items)
    before = (tmp_path / "a.safetensors").read_bytes()
    with pytest.raises(OutputExists, match="already exists") as ei:
        hf.write_safetensors(tmp_path / "a.safetensors", items)
    assert ei.value.hint and "--overwrite" in ei.value.hint
    assert (tmp_path / "a.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "a.safetensors.crc32.json"]
