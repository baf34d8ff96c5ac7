"""``save_checkpoint(exclude_frozen_parameters=True)``: frozen params are left out of the native checkpoint
(as DeepSpeed 0.19.8 leaves them out of its model-states ``module``), and what reads it sees the model
without them: ``zckpt consolidate`` writes only the trainable tensors, a strict load names the missing ones,
``load_module_strict=False`` restores the rest and keeps the model's own frozen values.

Oracle: the same engine's checkpoint saved without the option (the trainable tensors must be equal), and the
model's own frozen weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import engine
from engine.checkpoint_optim import CheckpointMismatch
from zckpt.ops.consolidate import consolidate


def _engine() -> engine.Engine:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    model[0].requires_grad_(False)
    cfg = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 2}}  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    eng, *_ = engine.initialize(model=model, model_parameters=params, config=cfg)
    return eng


def test_frozen_params_left_out(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    eng = _engine()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        eng.backward(eng(x).square().mean())
        eng.step()
    eng.save_checkpoint(str(tmp_path / "all"), tag="t")
    eng.save_checkpoint(str(tmp_path / "x"), tag="t", exclude_frozen_parameters=True)
    full = load_file(consolidate(tmp_path / "all", tmp_path / "all.safetensors", progress=False).files[0])
    part = load_file(consolidate(tmp_path / "x", tmp_path / "x.safetensors", progress=False).files[0])
    assert set(full) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert set(part) == {"2.weight", "2.bias"}  # never invented
    assert all(torch.equal(part[k], full[k]) for k in part)

    other = _engine()
    with torch.no_grad():
        other.module[0].weight.fill_(0.5)
    with pytest.raises(CheckpointMismatch, match=r"0\.weight"):
        other.load_checkpoint(str(tmp_path / "x"), tag="t")
    path, _ = other.load_checkpoint(str(tmp_path / "x"), tag="t", load_module_strict=False)
    assert path is not None and other.global_steps == 2
    assert torch.equal(other.module[2].weight, eng.module[2].weight)
    assert bool((other.module[0].weight == 0.5).all())  # the model's own frozen values
