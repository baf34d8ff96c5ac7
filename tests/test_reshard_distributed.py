"""reshard split over gloo processes: the output folder is byte-identical to the single-process reshard of
the same input and options (oracle: a single-process run made in the parent before spawning), for native
and DeepSpeed targets; no staging folder is left; a failure on any one process publishes nothing.

Input: the real DeepSpeed fixture ``s3_fp32_w3_offall_sub_g2`` (ZeRO-3, offload, sub-groups, tied and frozen
params), resharded to 5 ranks, so 3 processes write an uneven share (2, 2, 1 rank files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _dist import outcome, run
from _fixtures import fixture

from zckpt.ops.reshard import reshard

pytestmark = pytest.mark.dist

FIXTURE = fixture("ds", "s3_fp32_w3_offall_sub_g2")
CASES: dict[str, dict[str, Any]] = {
    "native": {"to": "native"},
    "ds3": {"to": "deepspeed"},
    "ds2": {"to": "deepspeed", "stage": 2},  # one model-states file all ranks share: process 0 writes it
}


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _procs(rank: int, world: int, root: str) -> dict[str, Any]:
    from zckpt.codecs import safetensors as hf  # every safetensors file goes through its write_file

    out = Path(root) / "dist"
    seen: dict[str, Any] = {}
    real = hf.write_file
    mine: list[str] = []

    def counting(path: Path, *a: Any, **k: Any) -> str:
        mine.append(path.name)
        return real(path, *a, **k)

    hf.write_file = counting
    for name, kw in CASES.items():
        res = reshard(FIXTURE, out / name, world=5, progress=False, distributed=True, **kw)
        seen[name] = {"files": res.files, "bytes": res.bytes_written, "stage": res.stage}
    hf.write_file = real
    seen["wrote"] = sorted(mine)  # the native case's rank files this process wrote itself

    # the CLI under a torchrun-like group: same output, only rank 0 prints
    from typer.testing import CliRunner

    from zckpt.cli.app import app

    args = ["reshard", str(FIXTURE), str(out / "cli"), "--world", "5", "--to", "native", "--no-progress"]
    cli = CliRunner().invoke(app, args)
    seen["cli"] = {"code": cli.exit_code, "stdout": cli.stdout}

    # the last process fails after writing a rank file: every process raises, nothing is published

    def flaky(path: Path, *a: Any, **k: Any) -> str:
        sha = real(path, *a, **k)
        if rank == world - 1:
            raise OSError(5, "injected I/O error", str(path))
        return sha

    hf.write_file = flaky
    try:
        seen["failed"] = outcome(
            lambda: reshard(FIXTURE, out / "failed", world=5, to="native", progress=False, distributed=True)
        )
    finally:
        hf.write_file = real
    return seen


def test_distributed_reshard_matches_single_process(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    want = {}
    for name, kw in CASES.items():
        res = reshard(FIXTURE, ref / name, world=5, progress=False, distributed=False, **kw)
        want[name] = {"files": sorted(res.files), "bytes": res.bytes_written, "stage": res.stage}
    reshard(FIXTURE, ref / "cli", world=5, to="native", progress=False, distributed=False)

    world = 3
    results = run(_procs, world, str(tmp_path))
    dist = tmp_path / "dist"
    for name in [*CASES, "cli"]:
        got, exp = _tree(dist / name), _tree(ref / name)
        assert sorted(got) == sorted(exp), name
        assert got == exp, name  # manifest (every file's hash), rank files, latest: byte for byte
    assert len([n for n in _tree(dist / "ds3") if n.endswith("optim_states.pt")]) == 5
    for r in results:
        for name in CASES:
            assert r[name] == want[name], (name, r[name], want[name])
    # each process wrote its own share of the rank files, rank i the files i::3
    for i, r in enumerate(results):
        assert r["wrote"] == [f"rank_{k:05d}.safetensors" for k in range(i, 5, world)], (i, r["wrote"])
    assert results[0]["cli"]["code"] == 0 and "world 5" in results[0]["cli"]["stdout"]
    assert all(r["cli"]["code"] == 0 and r["cli"]["stdout"] == "" for r in results[1:])
    assert results[-1]["failed"] == "own:injected I/O error"
    assert all(
        r["failed"].startswith("peer:reshard: writing rank files failed on rank 2") for r in results[:-1]
    )
    assert not (dist / "failed").exists()
    assert sorted(p.name for p in dist.iterdir()) == sorted([*CASES, "cli"])  # no staging folder left
