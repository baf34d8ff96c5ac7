"""torch .bin/.pt reader and streaming writer (zckpt.formats.torch_file, zckpt.codecs.torchzip_write),
checked against torch.save / torch.load(weights_only=True)."""

from __future__ import annotations

import json
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import zckpt
from zckpt.codecs import torchzip
from zckpt.codecs.pickle_safe import LossScaler, ZeroStageEnum, safe_loads
from zckpt.codecs.torchzip_write import dumps
from zckpt.errors import Unsupported
from zckpt.formats import torch_file
from zckpt.model import Role
from zckpt.stream.items import WriteItem, entry_from_tensor, items_from_state_dict

torch.manual_seed(0)
EMB = torch.randn(13, 7)
SD = {
    "emb.weight": EMB,
    "fc.weight": torch.randn(11, 7).bfloat16(),
    "fc.bias": torch.randn(11).half(),
    "steps": torch.arange(5, dtype=torch.int64),
    "mask": torch.tensor([True, False, True]),
    "empty": torch.zeros(0, 3),
    "scalar": torch.tensor(2.5, dtype=torch.float64),
    "head.weight": EMB,
}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k


def test_write_then_torch_load_weights_only(tmp_path: Path) -> None:
    items, tied = items_from_state_dict(SD)
    files = torch_file.write_torch(tmp_path / "m.bin", items, tied=tied)
    assert sorted(f.name for f in files) == ["m.bin", "m.bin.crc32.json"]
    got = torch.load(tmp_path / "m.bin", weights_only=True)
    _assert_same(got, SD)
    # tied names come back as one tensor on one storage
    assert got["head.weight"].untyped_storage().data_ptr() == got["emb.weight"].untyped_storage().data_ptr()
    # every storage record starts 64-byte aligned, like torch.save's
    _, records = torchzip.record_offsets(str(tmp_path / "m.bin"))
    assert all(off % 64 == 0 for name, (off, _) in records.items() if "/data/" in name)
    # the sidecar: the CRC-32 of each 16 MiB block (one here), what zlib.crc32 computes for it
    side = json.loads((tmp_path / "m.bin.crc32.json").read_text())
    raw = (tmp_path / "m.bin").read_bytes()
    assert side == {
        "format": "zckpt-block-crc32",
        "version": 1,
        "file": "m.bin",
        "size": len(raw),
        "block": 16 << 20,
        "crc32": [f"{zlib.crc32(raw):08x}"],
    }


def test_zip64_records_load_in_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend the zip64 limit is tiny so records, offsets and the directory all take the zip64 path.
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 64)
    items, tied = items_from_state_dict(SD)
    torch_file.write_torch(tmp_path / "z.bin", items, tied=tied)
    monkeypatch.undo()
    _assert_same(torch.load(tmp_path / "z.bin", weights_only=True), SD)
    with zckpt.open(tmp_path / "z.bin") as ck:
        _assert_same({k: ck[k] for k in ck}, SD)


def test_read_torch_save_lazily(tmp_path: Path) -> None:
    torch.save(SD, tmp_path / "ref.pt")
    with zckpt.open(tmp_path / "ref.pt") as ck:
        assert ck.meta.format == "torch"
        assert ck.meta.tied == {"head.weight": "emb.weight"}
        assert ck.entry("steps").role is Role.BUFFER and ck.entry("emb.weight").role is Role.PARAM
        _assert_same({k: ck[k] for k in ck}, SD)


@pytest.mark.parametrize("key", ["state_dict", "model", "module"])
def test_read_nested_state_dict(tmp_path: Path, key: str) -> None:
    torch.save(
        {key: OrderedDict(SD), "epoch": 3, "global_step": 17, "optimizer": {"lr": 0.1}}, tmp_path / "c.pt"
    )
    with zckpt.open(tmp_path / "c.pt") as ck:
        assert ck.meta.step == 17 and ck.meta.extra["container"] == key
        _assert_same({k: ck[k] for k in ck}, SD)


def test_read_views_and_slices(tmp_path: Path) -> None:
    base = torch.randn(6, 8)
    sd = {"t": base.t(), "cols": base[:, 2:5], "row": base[3], "whole": base}
    torch.save(sd, tmp_path / "v.pt")
    with zckpt.open(tmp_path / "v.pt") as ck:
        assert len(ck.entry("cols").pieces) == 6 and len(ck.entry("whole").pieces) == 1
        _assert_same({k: ck[k] for k in ck}, {k: v.contiguous() for k, v in sd.items()})


def test_no_state_dict_and_legacy_format(tmp_path: Path) -> None:
    torch.save({"a": {"b": 1}}, tmp_path / "n.pt")
    with pytest.raises(Unsupported, match="no state dict"):
        zckpt.open(tmp_path / "n.pt")
    torch.save(SD, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(Unsupported, match="legacy"):
        zckpt.open(tmp_path / "old.pt")


def test_roles_roundtrip_through_bin(tmp_path: Path) -> None:
    ck0 = zckpt.open(_safetensors_with_roles(tmp_path))
    items = [WriteItem(e.name, e, e.dtype) for e in ck0.model_entries()]
    torch_file.write_torch(tmp_path / "r.bin", items)
    ck = zckpt.open(tmp_path / "r.bin")
    assert {k: e.role for k, e in ck.entries.items()} == {k: e.role for k, e in ck0.entries.items()}


def _safetensors_with_roles(tmp_path: Path) -> Path:
    from zckpt.formats import hf

    items = [
        WriteItem("w", entry_from_tensor("w", EMB), torch.float32),
        WriteItem("b", entry_from_tensor("b", torch.ones(3), Role.BUFFER), torch.float32),
        WriteItem("f", entry_from_tensor("f", torch.ones(2), Role.FROZEN), torch.float32),
    ]
    hf.write_safetensors(tmp_path / "roles.safetensors", items)
    return tmp_path / "roles.safetensors"


def test_pickler_writes_foreign_globals_without_importing_them() -> None:
    ls = LossScaler()
    ls.__dict__["cur_scale"] = 64.0
    data = dumps({"stage": ZeroStageEnum.weights, "scaler": ls, "n": [1, 2.5, "x", None]})
    assert b"deepspeed.runtime.fp16.loss_scaler\nLossScaler\n" in data
    assert b"deepspeed.runtime.zero.config\nZeroStageEnum\n" in data
    back = safe_loads(data, source="mem")
    assert back["stage"] is ZeroStageEnum.weights
    assert isinstance(back["scaler"], LossScaler) and back["scaler"].to_dict() == {"cur_scale": 64.0}
    assert back["n"] == [1, 2.5, "x", None]
