"""The engine on CUDA at world 1 (run on the lent GPU; skipped where there is none): parity with the
single-process CPU reference in fp32, bf16/fp16 tracking, optimizer/param offload (host-to-device copies on
the copy stream), external params and the live budget under param offload, save + load bit-exact, an
asynchronous save (pinned snapshot) byte-identical to a synchronous one."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import _engine_ref as R
import pytest
import test_engine_external as X
import torch

import engine

pytestmark = pytest.mark.cuda  # skipped (and counted in the summary) on a machine without a GPU


def _train(
    cfg: dict[str, Any], steps: int, *, first: int = 0, eng: Any = None, name: str = "tiny"
) -> tuple[Any, list[float]]:
    if eng is None:
        model = X._make(name)
        opt = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=R.MAX_LR, betas=R.BETAS, eps=R.EPS,
            weight_decay=R.WD,
        )  # fmt: skip
        eng, _, _, _ = engine.initialize(model=model, optimizer=opt, config=cfg)
    losses = []
    for k in range(first, first + steps):
        x, y = R.batch(k)
        loss = eng(x.cuda(), y.cuda())
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return eng, losses


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    return R.reference(6)


@pytest.mark.parametrize(
    ("stage", "offload"), [(s, o) for s in (0, 1, 2, 3) for o in (False, True) if s or not o]
)  # offload needs ZeRO: no stage 0 with offload
def test_cuda_fp32_matches_cpu_reference(stage: int, offload: bool, ref: dict[str, Any]) -> None:
    zero: dict[str, Any] = {}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    eng, losses = _train(R.config(stage, **zero), 6)
    assert next(eng.module.parameters()).device.type == "cuda" or stage == 3
    for a, b in zip(losses, ref["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, ref["losses"])
    full = R.full_params(eng)
    for name, want in ref["params"].items():
        assert R.rel_err(full[name], want) < 1e-5, name


@pytest.mark.parametrize("precision,tol", [("bf16", 3e-2), ("fp16", 5e-3)])
def test_cuda_mixed_precision_tracks_reference(precision: str, tol: float, ref: dict[str, Any]) -> None:
    _, losses = _train(R.config(3, precision), 6)
    for a, b in zip(losses, ref["losses"], strict=True):
        assert abs(a - b) <= tol * abs(b), (precision, losses, ref["losses"])


def test_cuda_save_load_continues_bit_exactly(tmp_path: Path) -> None:
    cfg = R.config(3, "bf16")
    eng, _ = _train(cfg, 3)
    eng.save_checkpoint(str(tmp_path))
    _, rest = _train(cfg, 3, first=3, eng=eng)
    eng2, _ = _train(cfg, 0)
    path, _ = eng2.load_checkpoint(str(tmp_path))
    assert path is not None
    _, again = _train(cfg, 3, first=3, eng=eng2)
    assert again == rest


@pytest.mark.parametrize("offload", [False, True])
def test_cuda_async_save_same_files_and_resumes_bit_exactly(tmp_path: Path, offload: bool) -> None:
    """``checkpoint.writer.decoupled`` on CUDA (pinned snapshot, device-to-host copies): the rank file is
    byte-identical to a synchronous save of the same state, training goes on while it is written, and a
    load of it (pinned reads, host-to-device copies) resumes bit-exactly."""
    off = {"device": "cpu", "pin_memory": True}
    zero: dict[str, Any] = {"offload_optimizer": off, "offload_param": off} if offload else {}
    cfg = {**R.config(3, "bf16", **zero), "checkpoint": {"writer": {"decoupled": True}}}
    eng, _ = _train(cfg, 3)
    saver, eng.checkpointer = eng.checkpointer, None
    eng.save_checkpoint(str(tmp_path / "sync"), tag="t")
    eng.checkpointer = saver
    assert saver is not None and saver.staging.pinned
    eng.save_checkpoint(str(tmp_path / "async"), tag="t")
    _, rest = _train(cfg, 3, first=3, eng=eng)  # while the background write runs
    eng.wait_for_checkpoint()
    a, b = (tmp_path / m / "t" / "rank_00000.safetensors" for m in ("sync", "async"))
    assert a.read_bytes() == b.read_bytes()
    eng2, _ = _train(cfg, 0)
    path, _ = eng2.load_checkpoint(str(tmp_path / "async"))
    assert path is not None
    _, again = _train(cfg, 3, first=3, eng=eng2)
    assert again == rest
    eng.destroy()
    eng2.destroy()


@pytest.mark.parametrize("name", [*X.MODELS, "tiny"])
def test_cuda_param_offload_external_params_and_live_budget(name: str) -> None:
    ref = R.reference(6, make=partial(X._make, name))
    zero: dict[str, Any] = {"offload_param": {"device": "cpu", "pin_memory": True}}
    if name == "tiny":
        zero["stage3_max_live_parameters"] = X.BUDGET
    eng, losses = _train(R.config(3, **zero), 6, name=name)
    assert eng.fetcher is not None and eng.fetcher.copy_stream is not None
    peak = eng.fetcher.live.peak
    for a, b in zip(losses, ref["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (name, losses, ref["losses"])
    full = R.full_params(eng)
    for key, want in ref["params"].items():
        assert R.rel_err(full[key], want) < 1e-5, (name, key)
    if name == "tiny":
        assert peak <= X.BUDGET
