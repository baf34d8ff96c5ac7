"""Real DeepSpeed (dev venv ``.venv-ds``) resumes checkpoints that ``zckpt reshard`` wrote for a new world.

Each case trains with a global batch that does not depend on the world size, saves mid-run and keeps going
(the uninterrupted run); the checkpoint is resharded offline and DeepSpeed's own ``load_checkpoint`` resumes
it at the other world size. fp32 losses must follow the uninterrupted run within 1e-5 relative. Skipped
without the dev venv. Slow (each launch ~30-60 s on 2 cores): marked ``deepspeed``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from zckpt.ops.reshard import reshard

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = REPO / ".venv-ds" / "bin" / "torchrun"
pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.slow,
]
STEPS, SAVE_AT = 6, 3


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, DS_BUILD_OPS="0", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    cmd = [
        str(TORCHRUN),
        "--standalone",
        f"--nproc_per_node={spec['world']}",
        str(REPO / "tests" / "_ds_resume_worker.py"),
        "--spec",
        json.dumps(spec),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-4000:])
    out: dict[str, Any] = json.loads(Path(spec["out"]).read_text())
    return out


def _close(got: list[float], want: list[float], tol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= tol * abs(b), (got, want)


@pytest.mark.parametrize(
    ("stage", "w_from", "w_to", "sub_group_size"),
    [(1, 2, 3, None), (2, 3, 2, None), (3, 2, 3, 40)],
)
def test_deepspeed_resumes_resharded_checkpoint(
    stage: int, w_from: int, w_to: int, sub_group_size: int | None, tmp_path: Path
) -> None:
    base = {"stage": stage, "dtype": "fp32", "groups": 2, "sub_group_size": sub_group_size, "global_batch": 6}
    full = _run(
        {
            **base,
            "world": w_from,
            "first": 0,
            "last": STEPS,
            "load": None,
            "save": str(tmp_path / "ck"),
            "save_at": SAVE_AT,
            "out": str(tmp_path / "full.json"),
        }
    )
    res = reshard(tmp_path / "ck", tmp_path / "ck2", world=w_to, progress=False)
    assert res.stage == stage and res.world == w_to
    resumed = _run(
        {
            **base,
            "world": w_to,
            "first": SAVE_AT,
            "last": STEPS,
            "load": str(tmp_path / "ck2"),
            "save": None,
            "out": str(tmp_path / "res.json"),
        }
    )
    assert resumed["loaded"]["global_steps"] == SAVE_AT and resumed["loaded"]["note"] == "resume-test"
    _close(resumed["losses"], full["losses"][SAVE_AT:])


def _engine_run(rank: int, world: int, root: str) -> list[float]:
    from tests._engine_ref import config, make_model, train

    cfg = config(3)
    eng, first = train(rank, world, cfg, SAVE_AT, model=make_model(seed=11))
    eng.save_checkpoint(root, client_state={"note": "resume-test"})
    _, rest = train(rank, world, cfg, STEPS - SAVE_AT, first=SAVE_AT, engine_=eng)
    return first + rest


@pytest.mark.dist
def test_deepspeed_resumes_engine_run_resharded_to_deepspeed(tmp_path: Path) -> None:
    """native (engine, world 2) -> DeepSpeed ZeRO-3 at world 3: DeepSpeed continues the engine's curve."""
    from tests._dist import run

    engine_losses = run(_engine_run, 2, str(tmp_path / "native"))[0]
    res = reshard(tmp_path / "native", tmp_path / "ds", world=3, to="deepspeed", progress=False)
    assert res.dst_format == "deepspeed" and res.stage == 3
    resumed = _run(
        {
            "model": "engine_tiny",
            "stage": 3,
            "dtype": "fp32",
            "groups": 1,
            "global_batch": 12,
            "world": 3,
            "first": SAVE_AT,
            "last": STEPS,
            "load": str(tmp_path / "ds"),
            "save": None,
            "out": str(tmp_path / "res.json"),
        }
    )
    assert resumed["loaded"]["global_steps"] == SAVE_AT and resumed["loaded"]["note"] == "resume-test"
    _close(resumed["losses"], engine_losses[SAVE_AT:])
