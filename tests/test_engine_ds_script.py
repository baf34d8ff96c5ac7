"""The DeepSpeed-API oracle: ``tests/data/ds_script.py`` (written for DeepSpeed) runs unchanged on the
engine under torchrun and matches a single-process plain-PyTorch run of the same model and data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _fixtures import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "data" / "ds_script.py"


def _script_module() -> Any:
    return load_script(SCRIPT, "ds_script")


def _reference(ds: Any) -> list[float]:
    torch.manual_seed(0)
    model = ds.Net()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=ds.LR, weight_decay=0.01)
    losses = []
    for step in range(ds.STEPS):
        it = step - 1  # WarmupLR (linear, 2 warm-up steps) as DeepSpeed steps it: min rate first
        for g in opt.param_groups:
            g["lr"] = 0.0 if step == 0 else ds.LR * min(1.0, it / 2)
        x, y = ds.data(step)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.3)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.dist
def test_deepspeed_script_runs_unchanged_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "losses.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        str(torchrun),
        "--nproc_per_node",
        "2",
        "--standalone",
        "-m",
        "engine.run",  # the engine as `deepspeed` (engine/run.py), chosen on purpose
        str(SCRIPT),
        "--stage",
        "3",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    got = json.loads(out.read_text())
    assert got["losses"] == pytest.approx(_reference(_script_module()), rel=1e-6)
