"""``engine.compile`` (DeepSpeed's ``DeepSpeedEngine.compile``, which accelerate calls when the HF Trainer's
``torch_compile`` is on): the wrapped model is ``torch.compile``d in place and still trains as the
single-process plain-PyTorch reference (``_engine_ref.reference``) does, at stage 3 where the hooks gather
and release params around each module (they stay eager; a param read dynamo traces keeps its guards), with
an external param read (the root reading its embedding's weight), at world 1 (param offload) and 2.

The backend is dynamo's ``eager``: the tracing, graph breaks at the hooks and guards are the engine's concern;
inductor's kernels are not (a Trainer run with inductor was checked against real DeepSpeed by hand:
docs/engine-trainer.md).
"""

from __future__ import annotations

from typing import Any

import _engine_ref as R
import pytest
import torch
from _dist import run
from test_engine_external import STEPS, RootLinear

TOL = 1e-6


def _make(name: str) -> torch.nn.Module:
    if name == "tiny":
        return R.make_model()
    torch.manual_seed(0)
    return RootLinear()


def _train(rank: int, world: int, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    import engine

    model = _make(name)
    eng, _, _, _ = engine.initialize(model=model, optimizer=R.optimizer(model), config=cfg)
    assert not eng.is_compiled
    torch._dynamo.reset()
    eng.compile(backend="eager", compile_kwargs={"backend": "inductor", "dynamic": False})
    assert eng.is_compiled and eng.module._compiled_call_impl is not None
    eng.compile(backend="eager")  # a second call is a no-op, as DeepSpeed's
    eng, losses = R.train(rank, world, cfg, STEPS, engine_=eng)
    return {"losses": losses, "params": R.full_params(eng)}


def _check(res: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    for a, b in zip(res["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= TOL * abs(b), (what, res["losses"], ref["losses"])
    for name, want in ref["params"].items():
        assert R.rel_err(res["params"][name], want) <= TOL, (what, name)


@pytest.mark.parametrize("name", ["tiny", "root_linear"])
def test_compiled_stage3_world1_trains_like_reference(name: str) -> None:
    res = _train(0, 1, name, R.config(3, offload_param={"device": "cpu"}))
    _check(res, R.reference(STEPS, make=lambda: _make(name)), name)


def _dist(rank: int, world: int) -> dict[str, Any]:
    return {stage: _train(rank, world, "root_linear", R.config(stage)) for stage in (2, 3)}


@pytest.mark.dist
def test_compiled_multi_rank_trains_like_reference() -> None:
    res = run(_dist, 2)
    assert res[0] == res[1], "ranks disagree"
    ref = R.reference(STEPS, make=lambda: _make("root_linear"))
    for stage, val in res[0].items():
        _check(val, ref, f"stage {stage}")


def test_compile_refuses_deepspeed_compiler_passes() -> None:
    import engine

    model = R.make_model()
    opt = torch.optim.AdamW(model.parameters())
    eng, _, _, _ = engine.initialize(model=model, optimizer=opt, config=R.config(3))
    with pytest.raises(ValueError, match="not supported by the engine"):
        eng.compile(schedule=[(0, ["z3"])])
    assert not eng.is_compiled
