"""Engine fault tolerance under torchrun: a rank SIGKILLs itself mid-step (or, saving asynchronously, in the
middle of its background write) on the first attempt; torchrun
(``--max-restarts 1``) restarts every rank, they resume from ``latest``, and the run ends bit-identical to an
uninterrupted one (same final loss, same per-step losses after the restart, same parameters).

One torchrun job (gloo, 2 ranks, ``--standalone``: rendezvous on a free port) runs ``tests/_ft_worker.py``,
which trains the uninterrupted oracle and then the fault-tolerant run in the same processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
STEPS, KILL_STEP = 6, 3


@pytest.mark.dist
@pytest.mark.parametrize(
    "asynchronous", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sync", "async"]
)
def test_torchrun_restart_resumes_from_latest(tmp_path: Path, asynchronous: bool) -> None:
    """Sync: rank 1 is killed mid-step. Async: rank 1 is killed while its background writer writes the
    checkpoint of step ``KILL_STEP + 1``; ``latest`` still names step ``KILL_STEP``'s, the restart resumes
    from it."""
    ck, res = tmp_path / "ckpt", tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FT_KILL_STEP": str(KILL_STEP), "FT_KILL_RANK": "1"}
    env["FT_ASYNC"] = "1" if asynchronous else "0"
    cmd = [str(TORCHRUN), "--standalone", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1",
           str(HERE / "_ft_worker.py"), str(ck), str(res), str(STEPS)]  # fmt: skip
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    if asynchronous:  # rank 0 may fail first (its peer vanished) and be the one torchrun reports
        killed = (tmp_path / "ckpt.killed-mid-write").read_text()
        assert killed == f"global_step{KILL_STEP + 1}", killed
    else:
        assert "exitcode: -9" in p.stderr or "SIGKILL" in p.stderr, "the first attempt was not killed"
    out = json.loads(res.read_text())
    run, ref = out["run"], out["uninterrupted"]
    assert out["attempt"] == 1, "the run did not go through a restart"
    assert run["start_step"] == KILL_STEP, "did not resume from the last checkpoint before the kill"
    assert ref["start_step"] == 0 and len(ref["losses"]) == STEPS
    assert run["losses"][-1] == ref["losses"][-1], "final loss differs from the uninterrupted run"
    assert run["losses"] == ref["losses"][KILL_STEP:]
    assert run["params"] == ref["params"]
    assert (ck / "latest").read_text().strip() == f"global_step{STEPS}"
    from zckpt.ops.verify import verify

    assert verify(ck).ok
