"""engine.optim.scheduler: DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR / LRRangeTest.

Oracles: values worked out by hand from DeepSpeed's formulas (log10(2) for a log warm-up over 10 steps, etc.),
and — when the dev venv with real DeepSpeed exists — DeepSpeed's own classes run in that venv, compared
exactly (==) step by step.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import parse_config
from engine.optim.scheduler import LRRangeTest, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler

DS_PYTHON = Path(__file__).resolve().parents[1] / ".venv-ds" / "bin" / "python"


def _opt(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def _run(sched, opt: torch.optim.Optimizer, steps: int) -> list[list[float]]:
    """LRs in the optimizer after construction, then after each ``step()``."""
    seq = [[g["lr"] for g in opt.param_groups]]
    for _ in range(steps):
        sched.step()
        seq.append([g["lr"] for g in opt.param_groups])
    return seq


def test_warmup_lr_log_hand_values() -> None:
    opt = _opt(0.5)
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10)
    seq = [lr[0] for lr in _run(s, opt, 12)]
    # construction (iteration -1) writes min_lr; iteration i < 10 gives log(i+1)/log(10)
    assert seq[0] == 0.0
    assert seq[1] == 0.0  # iteration 0: log(1) = 0
    assert seq[2] == pytest.approx(math.log10(2), rel=1e-15)
    assert seq[5] == pytest.approx(math.log10(5), rel=1e-15)
    assert seq[10] == pytest.approx(1.0, rel=1e-15)  # iteration 9: log(10)/log(10)
    assert seq[11] == 1.0 and seq[12] == 1.0  # held at max
    assert s.get_last_lr() == [seq[-1]]
    assert s.state_dict() == {"last_batch_iteration": 11}


def test_warmup_lr_linear_min_offset_and_groups() -> None:
    opt = _opt(0.1, 0.2)
    s = WarmupLR(
        opt, warmup_min_lr=[0.01, 0.02], warmup_max_lr=[0.11, 0.42], warmup_num_steps=4, warmup_type="linear"
    )
    seq = _run(s, opt, 6)
    assert seq[0] == [0.01, 0.02]
    assert seq[1] == [0.01, 0.02]  # iteration 0
    assert seq[2] == pytest.approx([0.01 + 0.1 * 0.25, 0.02 + 0.4 * 0.25])
    assert seq[3] == pytest.approx([0.06, 0.22])
    assert seq[5] == pytest.approx([0.11, 0.42]) and seq[6] == pytest.approx([0.11, 0.42])


def test_warmup_lr_defaults_max_from_optimizer_and_min_two_steps() -> None:
    opt = _opt(0.3)
    s = WarmupLR(opt, warmup_num_steps=1)  # raised to 2; max lr = the group's lr
    assert s.warmup_num_steps == 2
    seq = [lr[0] for lr in _run(s, opt, 3)]
    assert seq == [0.0, 0.0, pytest.approx(0.3), 0.3]  # iteration 1: log(2)/log(2)
    with pytest.raises(ValueError, match="positive integer"):
        WarmupLR(opt, warmup_num_steps=0)
    with pytest.raises(ValueError, match="expected 1 value for min_lr"):
        WarmupLR(opt, warmup_min_lr=[0.0, 0.0])


def test_warmup_decay_lr_hand_values() -> None:
    opt = _opt(1.0)
    s = WarmupDecayLR(opt, total_num_steps=20, warmup_max_lr=2.0, warmup_num_steps=10, warmup_type="linear")
    seq = [lr[0] for lr in _run(s, opt, 26)]
    assert seq[6] == pytest.approx(2.0 * 5 / 10)  # iteration 5
    assert seq[11] == pytest.approx(2.0)  # iteration 10: (20-10)/10
    assert seq[16] == pytest.approx(1.0)  # iteration 15: (20-15)/10
    assert seq[21] == 0.0 and seq[26] == 0.0  # iteration 20 and beyond: clamped at 0


def test_warmup_cosine_lr_hand_values() -> None:
    opt = _opt(2.0)
    s = WarmupCosineLR(
        opt,
        total_num_steps=20,
        warmup_min_ratio=0.1,
        warmup_num_steps=10,
        cos_min_ratio=0.01,
        warmup_type="linear",
    )
    seq = [lr[0] for lr in _run(s, opt, 31)]
    assert seq[0] == 0.0  # construction writes ratio 0
    assert seq[1] == pytest.approx(2.0 * 0.1)  # iteration 0: warmup_min_ratio
    assert seq[6] == pytest.approx(2.0 * (0.1 + 0.5 * 0.9))  # iteration 5
    cos = (1 + math.cos(math.pi * 0.1)) / 2  # iteration 10: first decay step, progress 1/10
    assert seq[11] == pytest.approx(2.0 * (0.01 + 0.99 * cos))
    assert seq[20] == pytest.approx(2.0 * 0.01)  # iteration 19: progress 1
    assert seq[31] == pytest.approx(2.0 * 0.01)  # clamped afterwards
    assert s.org_lrs == [2.0]


def test_state_dict_round_trip_continues_identically() -> None:
    opt_a = _opt(1.0)
    a = WarmupLR(opt_a, warmup_max_lr=1.0, warmup_num_steps=50)
    full = _run(a, opt_a, 30)
    opt_b = _opt(1.0)
    b = WarmupLR(opt_b, warmup_max_lr=1.0, warmup_num_steps=50)
    _run(b, opt_b, 12)
    sd = json.loads(json.dumps(b.state_dict()))
    opt_c = _opt(1.0)
    c = WarmupLR(opt_c, warmup_max_lr=1.0, warmup_num_steps=50)
    c.load_state_dict(sd)
    assert _run(c, opt_c, 18)[1:] == full[13:]


def test_build_scheduler_from_config_uses_class_defaults() -> None:
    cfg = parse_config(
        {"train_batch_size": 2, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "100"}}},
        world_size=1,
    )
    opt = _opt(0.5)
    s = build_scheduler(cfg, opt)
    assert isinstance(s, WarmupDecayLR)
    assert s.max_lrs == [0.001] and s.warmup_num_steps == 1000 and s.total_num_steps == 100
    assert build_scheduler(parse_config({"train_batch_size": 2}, world_size=1), opt) is None
    s2 = build_scheduler(cfg.scheduler, opt)
    assert isinstance(s2, WarmupDecayLR)


_DS_SCRIPT = r"""
import json, sys, logging
import torch
from deepspeed.runtime import lr_schedules as L
logging.disable(logging.WARNING)
cases = json.loads(sys.stdin.read())
out = []
for case in cases:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in case["lrs"]]
    opt = torch.optim.SGD(groups, lr=case["lrs"][0])
    s = getattr(L, case["type"])(opt, **case["params"])
    seq = [[g["lr"] for g in opt.param_groups]]
    for _ in range(case["steps"]):
        s.step()
        seq.append([g["lr"] for g in opt.param_groups])
    out.append(seq)
print(json.dumps(out))
"""

_CASES: list[dict[str, Any]] = [
    {
        "type": "WarmupLR",
        "lrs": [3e-5],
        "steps": 520,
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500},
    },
    {
        "type": "WarmupLR",
        "lrs": [0.1, 0.01],
        "steps": 60,
        "params": {"warmup_min_lr": [0.0, 0.001], "warmup_num_steps": 50, "warmup_type": "linear"},
    },
    {
        "type": "WarmupDecayLR",
        "lrs": [1.0],
        "steps": 140,
        "params": {
            "total_num_steps": 120,
            "warmup_min_lr": 1e-4,
            "warmup_max_lr": 3e-3,
            "warmup_num_steps": 37,
        },
    },
    {
        "type": "WarmupCosineLR",
        "lrs": [3e-4, 1e-3],
        "steps": 140,
        "params": {
            "total_num_steps": 120,
            "warmup_min_ratio": 0.05,
            "warmup_num_steps": 13,
            "cos_min_ratio": 0.02,
        },
    },
    {
        "type": "WarmupCosineLR",
        "lrs": [1.0],
        "steps": 30,
        "params": {"total_num_steps": 10, "warmup_num_steps": 17, "warmup_type": "linear"},
    },
    {
        "type": "LRRangeTest",
        "lrs": [0.1, 0.2],
        "steps": 40,
        "params": {"lr_range_test_min_lr": [1e-4, 3e-4], "lr_range_test_step_size": 7},
    },
    {
        "type": "LRRangeTest",
        "lrs": [0.1],
        "steps": 40,
        "params": {
            "lr_range_test_step_size": 5,
            "lr_range_test_step_rate": 0.3,
            "lr_range_test_staircase": True,
        },
    },
]


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.skipif(not DS_PYTHON.exists(), reason="dev venv with real DeepSpeed (.venv-ds) not present")
def test_matches_real_deepspeed_exactly() -> None:
    proc = subprocess.run(
        [str(DS_PYTHON), "-c", _DS_SCRIPT],
        input=json.dumps(_CASES),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = json.loads(proc.stdout.strip().splitlines()[-1])
    classes = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
               "LRRangeTest": LRRangeTest}  # fmt: skip
    for case, want in zip(_CASES, expected, strict=True):
        opt = _opt(*case["lrs"])
        got = _run(classes[case["type"]](opt, **case["params"]), opt, case["steps"])
        assert got == want, case  # bit-exact: same formulas, same float operations
