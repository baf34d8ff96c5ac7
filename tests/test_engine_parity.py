"""Engine vs the single-process plain-PyTorch reference (``_engine_ref.reference``), step for step.

World 1 runs in-process; world 2 and 3 (uneven partitions) run in one spawn each, which also saves/loads
checkpoints (same world bit-exact; world 2 -> 3 load-time reshard) and runs mixed precision.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run
from _engine_ref import config, full_params, make_model, reference, rel_err, train

import engine

STEPS = 6
FP32_TOL = 1e-6


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    return reference(STEPS)


def _check_fp32(res: dict[str, Any], ref: dict[str, Any], tol: float = FP32_TOL) -> None:
    for a, b in zip(res["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= tol * abs(b), (res["losses"], ref["losses"])
    for name, want in ref["params"].items():
        assert rel_err(res["params"][name], want) <= tol, name


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("gas", [1, 2])
def test_world1_fp32_matches_reference(stage: int, gas: int, ref: dict[str, Any]) -> None:
    eng, losses = train(0, 1, config(stage, gas=gas), STEPS)
    _check_fp32({"losses": losses, "params": full_params(eng)}, ref)
    assert eng.global_steps == STEPS and eng.micro_steps == STEPS * gas
    assert eng.get_lr() == [pytest.approx(0.05)]


@pytest.mark.parametrize("precision,tol", [("bf16", 3e-2), ("fp16", 5e-3)])
def test_world1_mixed_precision_tracks_reference(precision: str, tol: float, ref: dict[str, Any]) -> None:
    eng, losses = train(0, 1, config(3, precision), STEPS)
    assert eng.skipped_steps == 0
    for a, b in zip(losses, ref["losses"], strict=True):
        assert abs(a - b) <= tol * abs(b)
    p = full_params(eng)
    assert rel_err(p["l1.weight"], ref["params"]["l1.weight"]) < 3 * tol


class _Boom(torch.nn.Module):
    """Wraps the tiny model; when ``armed``, the loss is multiplied by inf so every gradient overflows."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model()
        self.armed = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.inner(x, y)
        return loss * math.inf if self.armed else loss


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_overflow_skips_step_with_hysteresis(stage: int) -> None:
    model = _Boom()
    eng, _ = train(0, 1, config(stage, "fp16"), 2, model=model)
    assert eng.loss_scale == 2.0**8
    before, lr = full_params(eng), eng.get_lr()
    model.armed = True
    train(0, 1, config(stage, "fp16"), 1, first=2, engine_=eng)
    # hysteresis 2: the first overflow spends one unit, the scale stays
    assert (eng.skipped_steps, eng.global_steps, eng.loss_scale) == (1, 3, 2.0**8)
    assert full_params(eng) == before and eng.get_lr() == lr
    train(0, 1, config(stage, "fp16"), 1, first=3, engine_=eng)
    assert (eng.skipped_steps, eng.loss_scale) == (2, 2.0**7)
    assert full_params(eng) == before
    model.armed = False
    _, losses = train(0, 1, config(stage, "fp16"), 1, first=4, engine_=eng)
    assert eng.skipped_steps == 2 and full_params(eng) != before and math.isfinite(losses[0])


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_world1_save_load_continues_bit_exactly(stage: int, tmp_path: Path) -> None:
    cfg = config(stage, "bf16" if stage == 2 else "fp32", gas=2)
    _, full = train(0, 1, cfg, STEPS)
    eng, first = train(0, 1, cfg, 3)
    eng.save_checkpoint(str(tmp_path), client_state={"epoch": 1, "ids": torch.arange(4)})
    assert (tmp_path / "latest").read_text() == "global_step3"
    eng2, _ = train(0, 1, cfg, 0, model=make_model(seed=7))
    path, client = eng2.load_checkpoint(str(tmp_path))
    assert path == str(tmp_path / "global_step3" / "rank_00000.safetensors")  # no model-states file: the rank
    assert client is not None and client["epoch"] == 1 and client["ids"].tolist() == [0, 1, 2, 3]
    assert (eng2.global_steps, eng2.micro_steps) == (3, 6)
    _, rest = train(0, 1, cfg, 3, first=3, engine_=eng2)
    assert first + rest == full
    assert eng2.load_checkpoint(str(tmp_path / "nothing")) == (None, None)


def test_save_16bit_model_streams_gathered_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    eng, _ = train(0, 1, config(3, "bf16", stage3_gather_16bit_weights_on_model_save=True), 2)
    assert eng.save_16bit_model(str(tmp_path), "model.safetensors")
    sd = load_file(str(tmp_path / "model.safetensors"))
    want = full_params(eng)
    assert set(sd) == set(want) and sd["head.weight"].dtype == torch.bfloat16
    assert sd["l1.weight"].float().reshape(-1).tolist() == want["l1.weight"]
    fresh = make_model().to(torch.bfloat16)
    fresh.load_state_dict(sd, strict=True)
    eng3, _ = train(0, 1, config(3), 1)
    assert eng3.save_16bit_model(str(tmp_path), "x.safetensors") is False


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=61, n_positions=16, n_embd=12, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(cfg)


def test_gpt2_stage3_matches_plain_pytorch() -> None:
    ids = torch.randint(0, 61, (4, 9), generator=torch.Generator().manual_seed(3))
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    ref = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    model2 = _gpt2()
    cfg = {"train_batch_size": 4, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # fmt: skip
    eng, opt2, _, _ = engine.initialize(
        model=model2, optimizer=torch.optim.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.0), config=cfg
    )
    got = []
    for _ in range(3):
        loss = eng(input_ids=ids, labels=ids).loss
        eng.backward(loss)
        eng.step()
        got.append(loss.item())
    assert got == pytest.approx(ref, rel=1e-6)
    m: Any = model2
    wte = m.transformer.wte.weight
    # world 1 has nothing to partition: stage 3 keeps the 16-bit params materialised (no hooks, no copies)
    assert wte.numel() == 61 * 12 and m.lm_head.weight is wte  # tied


# ---- multi-rank ------------------------------------------------------------------------------------
def _dist_checks(rank: int, world: int, ckpt_dir: str, load_dir: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in (1, 2, 3):
        for gas in (1, 2):
            eng, losses = train(rank, world, config(stage, gas=gas), STEPS)
            out[f"fp32-s{stage}-g{gas}"] = {"losses": losses, "params": full_params(eng)}
    for precision in ("bf16", "fp16"):
        eng, losses = train(rank, world, config(3, precision), STEPS)
        out[precision] = {"losses": losses, "skipped": eng.skipped_steps}
    # save at step 3, load into a fresh engine, continue: must equal the uninterrupted fp32-s3-g2 run
    cfg = config(3, gas=2)
    eng, first = train(rank, world, cfg, 3)
    eng.save_checkpoint(ckpt_dir, client_state={"world": world})
    eng2, _ = train(rank, world, cfg, 0, model=make_model(seed=9))
    eng2.load_checkpoint(ckpt_dir)
    _, rest = train(rank, world, cfg, STEPS - 3, first=3, engine_=eng2)
    out["resume"] = first + rest
    if load_dir is not None:  # a checkpoint written at another world size: reshard at load time
        eng3, _ = train(rank, world, cfg, 0, model=make_model(seed=11))
        _, client = eng3.load_checkpoint(load_dir)
        _, rest = train(rank, world, cfg, STEPS - 3, first=3, engine_=eng3)
        out["resharded"] = {"rest": rest, "client": client, "params": full_params(eng3)}
    return out


@pytest.mark.dist
def test_multi_rank_parity_checkpoint_and_reshard(
    ref: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        res2 = run(_dist_checks, 2, f"{tmp}/w2", None)
        # world 3 moves every bucket through the shared-memory segments (engine.zero.shm), world 2 over gloo
        monkeypatch.setenv("ZCKPT_ENGINE_SHM_MIN_BYTES", "0")
        res3 = run(_dist_checks, 3, f"{tmp}/w3", f"{tmp}/w2")
        from zckpt.formats import open_checkpoint

        with open_checkpoint(f"{tmp}/w3") as ck:  # the zckpt reader consolidates the native format
            assert (
                ck.meta.world_size == 3
                and ck.meta.stage == 3
                and ck.meta.tied == {"head.weight": "emb.weight"}
            )
            assert ck["l1.weight"].shape == (15, 7)
    for world, res in ((2, res2), (3, res3)):
        r0 = res[0]
        assert all(r == r0 for r in res[1:]), "ranks disagree"
        for key, val in r0.items():
            if key.startswith("fp32"):
                _check_fp32(val, ref)
        for precision, tol in (("bf16", 3e-2), ("fp16", 5e-3)):
            assert r0[precision]["skipped"] == 0
            for a, b in zip(r0[precision]["losses"], ref["losses"], strict=True):
                assert abs(a - b) <= tol * abs(b), (world, precision)
        assert r0["resume"] == r0["fp32-s3-g2"]["losses"], world
    resh = res3[0]["resharded"]
    assert resh["client"] == {"world": 2}
    uninterrupted = res2[0]["fp32-s3-g2"]["losses"][3:]
    for a, b in zip(resh["rest"], uninterrupted, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    _check_fp32({"losses": res2[0]["fp32-s3-g2"]["losses"][:3] + resh["rest"], "params": resh["params"]}, ref)
