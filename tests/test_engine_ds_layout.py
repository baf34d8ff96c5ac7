"""The engine's ``save_checkpoint`` in DeepSpeed's own layout (``"checkpoint": {"format": "deepspeed"}``,
``engine.checkpoint.ds_layout``), read by real DeepSpeed 0.19.8 (``.venv-ds``) with no conversion.

The engine trains the engine tests' tiny model (``tests/_engine_ref``: a frozen layer, LayerNorm, fp32) on 2
gloo ranks, saves at step 3 in DeepSpeed's layout (synchronously at ZeRO-1, in the background at ZeRO-2) and
keeps going (the uninterrupted run). Oracles, none of them zckpt's own reader:

- DeepSpeed's file names: ``mp_rank_00_model_states.pt``, ``zero_pp_rank_{0,1}_mp_rank_00_optim_states.pt``,
  ``latest`` and DeepSpeed's ``zero_to_fp32.py`` / ``zero_to_torch.py`` beside it, byte for byte its own;
- real DeepSpeed's ``load_checkpoint`` of that folder at world 2 (``tests/_ds_resume_worker.py``): steps 4-6
  follow the engine's uninterrupted run within 1e-5 relative;
- DeepSpeed's ``zero_to_fp32.py``, run from the folder: its fp32 state dict equals the engine's native save
  of the same step, bit for bit (at ZeRO-1 without the frozen params: DeepSpeed records their shapes from
  ZeRO-2 on only, so its script leaves them out of its own ZeRO-1 checkpoints too).

The ZeRO-3 layout, with CPU offload, bf16 and a background save, is resumed by real DeepSpeed in the HF
Trainer (``tests/test_engine_hf_trainer.py``). Marked ``deepspeed``: 81-287 s and 77-117 s on 2 cores
shared with 5 other sessions (load 11-18). Unmarked, one process, 1.5-11 s each: the engine resumes its own
DeepSpeed-layout save (steps 4-6 equal the uninterrupted run's exactly), and stage 0 / an ``s3://`` save dir
are refused in one line with nothing written.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from test_reshard_deepspeed import SAVE_AT, STEPS, _close, _run

import zckpt
from zckpt.model import Role

REPO = Path(__file__).resolve().parents[1]
DS_UTILS = REPO / ".venv-ds" / "lib"


def _engine_run(rank: int, world: int, root: str, stage: int, decoupled: bool) -> list[float]:
    from tests._engine_ref import config, make_model, train

    cfg = config(stage)
    cfg["checkpoint"] = {"format": "deepspeed", "writer": {"decoupled": decoupled}}
    eng, first = train(rank, world, cfg, SAVE_AT, model=make_model(seed=11))
    eng.save_checkpoint(f"{root}/ds", client_state={"note": "resume-test"})
    from engine.checkpoint import save

    save(eng, f"{root}/native")  # the same step in the native format, for the zero_to_fp32 oracle
    _, rest = train(rank, world, cfg, STEPS - SAVE_AT, first=SAVE_AT, engine_=eng)
    eng.wait_for_checkpoint()
    return first + rest


def _ds_script(name: str) -> Path:
    (found,) = DS_UTILS.glob(f"python3*/site-packages/deepspeed/utils/{name}")
    return found


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(("stage", "decoupled"), [(1, False), (2, True)], ids=["zero1-sync", "zero2-async"])
def test_deepspeed_loads_engine_save_in_deepspeed_layout(stage: int, decoupled: bool, tmp_path: Path) -> None:
    from tests._dist import run

    losses = run(_engine_run, 2, str(tmp_path), stage, decoupled)[0]
    ds = tmp_path / "ds"
    tag = ds / f"global_step{SAVE_AT}"
    assert (ds / "latest").read_text() == tag.name
    assert sorted(p.name for p in tag.glob("*.pt")) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):
        assert (ds / name).read_bytes() == _ds_script(name).read_bytes(), name
    resumed = _run(
        {
            "model": "engine_tiny",
            "stage": stage,
            "dtype": "fp32",
            "groups": 1,
            "global_batch": 4,
            "world": 2,
            "first": SAVE_AT,
            "last": STEPS,
            "load": str(ds),
            "save": None,
            "out": str(tmp_path / "res.json"),
        }
    )
    assert resumed["loaded"]["global_steps"] == SAVE_AT and resumed["loaded"]["note"] == "resume-test"
    _close(resumed["losses"], losses[SAVE_AT:])
    # DeepSpeed's zero_to_fp32.py, as a user runs it from the folder
    py = str(REPO / ".venv-ds" / "bin" / "python")
    cmd = [py, str(ds / "zero_to_fp32.py"), str(ds), str(tmp_path / "fp32")]  # tied: no safetensors
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ds)
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(tmp_path / "fp32" / "pytorch_model.bin", weights_only=True)
    want = zckpt.open(tmp_path / "native")
    frozen = {e.name for e in want.model_entries() if e.role is Role.FROZEN}
    assert frozen and set(got) == set(want.keys()) - (frozen if stage == 1 else set())  # as DeepSpeed's own
    for k, v in got.items():
        assert torch.equal(v, want.read(k, torch.float32).reshape(v.shape)), k


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_resumes_its_deepspeed_layout_exactly(stage: int, tmp_path: Path) -> None:
    from tests._engine_ref import config, make_model, train

    cfg = {**config(stage), "checkpoint": {"format": "deepspeed"}}
    eng, first = train(0, 1, cfg, SAVE_AT, model=make_model(seed=11))
    eng.save_checkpoint(str(tmp_path))
    _, rest = train(0, 1, cfg, STEPS - SAVE_AT, first=SAVE_AT, engine_=eng)
    fresh, _ = train(0, 1, cfg, 0, model=make_model(seed=5))
    path, _client = fresh.load_checkpoint(str(tmp_path))
    assert Path(path).name == ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3
                               else "mp_rank_00_model_states.pt")  # fmt: skip
    _, again = train(0, 1, cfg, STEPS - SAVE_AT, first=SAVE_AT, engine_=fresh)
    assert again == rest


def test_refused_in_one_line_with_nothing_written(tmp_path: Path) -> None:
    from engine.config import ConfigError
    from tests._engine_ref import config, train

    eng, _ = train(0, 1, {**config(0), "checkpoint": {"format": "deepspeed"}}, 1)
    with pytest.raises(ConfigError, match="ZeRO-1/2/3 layout, not stage 0") as info:
        eng.save_checkpoint(str(tmp_path / "out"))
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()
    eng3, _ = train(0, 1, {**config(3), "checkpoint": {"format": "deepspeed"}}, 1)
    with pytest.raises(ConfigError, match="local folder only"):
        eng3.save_checkpoint("s3://bucket/run")
