"""engine.optim.loss_scaler: DeepSpeed's dynamic loss scaling, static scaling, overflow detection.

Oracles: (scale, hysteresis) sequences traced by hand from DeepSpeed's ``update_scale`` for fixed overflow
patterns (window 3, hysteresis 2), and — when the dev venv exists — DeepSpeed's own ``DynamicLossScaler`` fed
the same random overflow pattern, compared state by state.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import parse_config
from engine.optim.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimum,
    LossScaler,
    build_loss_scaler,
    has_overflow,
    overflow_flag,
)

DS_PYTHON = Path(__file__).resolve().parents[1] / ".venv-ds" / "bin" / "python"

#            it: 0  1  2  3  4  5  6  7  8  9  10 11 12 13
_PATTERN = [0, 0, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 1]


def _trace(scaler: DynamicLossScaler, pattern: list[int]) -> list[tuple[float, int]]:
    out = []
    for o in pattern:
        scaler.update_scale(bool(o))
        out.append((scaler.cur_scale, scaler.cur_hysteresis))
    return out


def test_hysteresis_then_window_growth_hand_trace() -> None:
    s = DynamicLossScaler(
        init_scale=16, scale_window=3, min_scale=1, delayed_shift=2, consecutive_hysteresis=False
    )
    # it3: 3 clean steps since "overflow" at -1 -> x2; it4 spends hysteresis; it5 halves; it8 halves
    # (clean steps do not refill hysteresis); it12: 3 clean steps after it8 -> x2, hysteresis refilled;
    # it13 spends it.
    assert _trace(s, _PATTERN) == [
        (16, 2),
        (16, 2),
        (16, 2),
        (32, 2),
        (32, 1),
        (16, 1),
        (16, 1),
        (16, 1),
        (8, 1),
        (8, 1),
        (8, 1),
        (8, 1),
        (16, 2),
        (16, 1),
    ]
    assert s.cur_iter == 14 and s.last_overflow_iter == 13


def test_consecutive_hysteresis_hand_trace() -> None:
    s = DynamicLossScaler(
        init_scale=16, scale_window=3, min_scale=1, delayed_shift=2, consecutive_hysteresis=True
    )
    # every clean step refills the hysteresis, so the isolated overflow at it8 only spends it
    assert _trace(s, _PATTERN) == [
        (16, 2),
        (16, 2),
        (16, 2),
        (32, 2),
        (32, 1),
        (16, 1),
        (16, 2),
        (16, 2),
        (16, 1),
        (16, 2),
        (16, 2),
        (16, 2),
        (32, 2),
        (32, 1),
    ]


def test_no_hysteresis_and_min_scale() -> None:
    s = DynamicLossScaler(init_scale=4, scale_window=1000, min_scale=1, delayed_shift=1)
    assert _trace(s, [1, 1]) == [(2, 1), (1, 1)]
    with pytest.raises(LossScaleAtMinimum, match="minimum"):
        s.update_scale(True)
    t = DynamicLossScaler(init_scale=4, scale_window=1000, min_scale=1.5, raise_error_at_min_scale=False)
    assert _trace(t, [1, 1, 1]) == [(2, 1), (1.5, 1), (1.5, 1)]


def test_state_dict_json_round_trip_and_deepspeed_dict() -> None:
    s = DynamicLossScaler(init_scale=2**16, scale_window=5, min_scale=1, delayed_shift=2)
    _trace(s, [0, 1, 0, 1, 0, 0])
    sd = json.loads(json.dumps(s.state_dict()))
    assert sd["cur_scale"] == 2**15 and sd["cur_hysteresis"] == 1 and sd["last_overflow_iter"] == 3
    t = DynamicLossScaler()
    t.load_state_dict(sd)
    assert _trace(t, _PATTERN) == _trace(s, _PATTERN)
    # a DeepSpeed DynamicLossScaler's __dict__ (as pickled in its checkpoints) carries extra attributes
    ds_dict = {**sd, "dynamic": True, "dtype": "torch.float16", "cur_scale": 1024}
    u = DynamicLossScaler()
    u.load_state_dict(ds_dict)
    assert u.cur_scale == 1024.0 and u.scale_window == 5 and u.delayed_shift == 2
    with pytest.raises(KeyError, match="cur_iter"):
        u.load_state_dict({"cur_scale": 1.0})


def test_static_scaler() -> None:
    s = LossScaler(128)
    s.update_scale(True)
    assert s.loss_scale == 128.0 and not s.dynamic
    assert s.scale_loss(torch.tensor(2.0)).item() == 256.0
    s.load_state_dict(json.loads(json.dumps({**s.state_dict(), "cur_scale": 64})))
    assert s.cur_scale == 64.0


def test_build_loss_scaler_from_config() -> None:
    dyn = build_loss_scaler(parse_config({"train_batch_size": 1, "fp16": {"enabled": True}}, world_size=1))
    assert isinstance(dyn, DynamicLossScaler)
    assert (dyn.cur_scale, dyn.scale_window, dyn.min_scale, dyn.delayed_shift) == (65536.0, 1000, 1.0, 2)
    static = build_loss_scaler(
        parse_config({"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale": 8}}, world_size=1)
    )
    assert type(static) is LossScaler and static.cur_scale == 8.0
    bf16 = build_loss_scaler(parse_config({"train_batch_size": 1, "bf16": {"enabled": True}}, world_size=1))
    assert type(bf16) is LossScaler and bf16.cur_scale == 1.0


def test_overflow_detection() -> None:
    finite = [
        torch.tensor([65504.0, -65504.0], dtype=torch.float16),
        torch.randn(3, 4),
        None,
        torch.zeros(0),
        torch.ones(2, dtype=torch.bfloat16),
    ]
    assert not has_overflow(finite)
    assert not has_overflow([])
    flag = overflow_flag(finite)
    assert flag.shape == () and flag.dtype == torch.float32 and flag.item() == 0.0
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(5)
        t[3] = bad
        assert has_overflow([*finite, t]), bad
        assert overflow_flag([t, *finite]).item() == 1.0
    half_overflow = torch.tensor([60000.0], dtype=torch.float16) * 2  # inf in fp16
    assert has_overflow([half_overflow])


_DS_SCRIPT = r"""
import json, sys, logging
logging.disable(logging.WARNING)
from deepspeed.runtime.fp16 import loss_scaler as LS
LS.dist.get_rank = lambda *a, **k: 0  # update_scale logs on rank 0; no process group here
args, pattern = json.loads(sys.stdin.read())
s = LS.DynamicLossScaler(**args)
out = []
for o in pattern:
    try:
        s.update_scale(bool(o))
    except Exception as e:
        out.append("raised")
        break
    out.append([s.cur_scale, s.cur_hysteresis, s.cur_iter, s.last_overflow_iter])
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("consecutive", [False, True])
def test_matches_real_deepspeed(consecutive: bool) -> None:
    rng = random.Random(7)
    pattern = [int(rng.random() < 0.3) for _ in range(300)]
    args: dict[str, Any] = dict(
        init_scale=2**20, scale_window=4, min_scale=0.25, delayed_shift=3, consecutive_hysteresis=consecutive
    )
    proc = subprocess.run(
        [str(DS_PYTHON), "-c", _DS_SCRIPT],
        input=json.dumps([args, pattern]),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = json.loads(proc.stdout.strip().splitlines()[-1])
    s = DynamicLossScaler(**args)
    got: list = []
    for o in pattern:
        try:
            s.update_scale(bool(o))
        except LossScaleAtMinimum:
            got.append("raised")
            break
        got.append([s.cur_scale, s.cur_hysteresis, s.cur_iter, s.last_overflow_iter])
    assert got == want
    assert len(set(map(str, got))) > 20  # the pattern exercised growth, hysteresis and shrinking
