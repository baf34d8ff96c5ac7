"""Asynchronous checkpoints (``"checkpoint": {"writer": {"decoupled": true}}``) on CPU.

Oracles: a synchronous save of the same state (the rank files byte for byte, the manifest but for the
config's ``checkpoint.writer`` block), ``zckpt verify``, and resuming next to an engine that never stopped.
Checked: training goes on while the file is written and ``latest`` moves only once it is complete; a new
save and a load of the same folder wait for the one in flight; an error in the background surfaces on the
next save, on ``wait_for_checkpoint()``, ``destroy()`` and at interpreter exit, and leaves ``latest``
alone; the snapshot memory is allocated once and reused; ``load_stats`` counts exactly the bytes of the
masters and moments; world 2 (gloo) saves over the side group, and
a failure on one rank fails the save on both; SIGKILL during the background write leaves ``latest`` on
the previous checkpoint (here, world 1, forked; under torchrun with a restart in
``tests/test_fault_tolerance.py``); at world 2 with ~100M params the save call blocks for at most 0.35x a
synchronous save (``slow``).
"""

from __future__ import annotations

import copy
import errno
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import _engine_ref as R
import _slow_writes
import pytest
import torch

from engine.checkpoint import CheckpointSaveError
from zckpt.formats.native import write as W
from zckpt.ops.verify import verify

HERE = Path(__file__).resolve().parent
DELAY = _slow_writes.ENV
_slow_writes.install()


def _cfg(stage: int = 3, **writer: Any) -> dict[str, Any]:
    return {**R.config(stage), "checkpoint": {"writer": {"decoupled": True, **writer}}}


def _rank_bytes(d: Path, tag: str, rank: int = 0) -> bytes:
    return (d / tag / f"rank_{rank:05d}.safetensors").read_bytes()


def _manifest(d: Path, tag: str) -> dict[str, Any]:
    return json.loads((d / tag / "manifest.json").read_text())


def _same_but_writer(sync: dict[str, Any], asy: dict[str, Any]) -> None:
    """Manifests equal except the recorded config's ``checkpoint.writer`` block."""
    differ = {k for k in sync if sync[k] != asy.get(k)}
    assert differ <= {"config"} and set(sync) == set(asy), differ
    a, s = copy.deepcopy(asy["config"]), copy.deepcopy(sync["config"])
    for c in (a, s):
        c.get("checkpoint", {}).pop("writer", None)
        if c.get("checkpoint") == {}:
            del c["checkpoint"]
    assert a == s


def _sync_save(eng: Any, d: Path, tag: str) -> None:
    """A synchronous save of ``eng`` (its background writer set aside for the call)."""
    saver, eng.checkpointer = eng.checkpointer, None
    try:
        eng.save_checkpoint(str(d), tag=tag)
    finally:
        eng.checkpointer = saver


def _load_stats_match_the_file(st: dict[str, Any], rank_file: Path) -> None:
    """``load_stats``: the tensor reads are exactly the file's masters and Adam moments (its safetensors
    header's byte ranges), read whole from storage, within the load's time."""
    raw = rank_file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    want = sum(
        v["data_offsets"][1] - v["data_offsets"][0]
        for k, v in header.items()
        if k.startswith(("param/", "optim/exp_avg/", "optim/exp_avg_sq/"))
    )
    assert st["path"] == str(rank_file.parent) and st["read"]["bytes"] == want > 0
    assert want <= st["read"]["storage_bytes"] <= len(raw) + 4096
    assert 0 <= st["read"]["wait_read_s"] <= st["read"]["wall_s"] <= st["total_s"]


@pytest.mark.parametrize("stage", [2, 3])
def test_same_files_as_sync_verify_and_resume(stage: int, tmp_path: Path) -> None:
    ref, _ = R.train(0, 1, R.config(stage), 3)
    eng, _ = R.train(0, 1, _cfg(stage), 3)
    staging = eng.checkpointer.staging
    blocks, alloc = list(staging._blocks), staging.alloc_s
    ref.save_checkpoint(str(tmp_path / "s"), tag="t")
    eng.save_checkpoint(str(tmp_path / "a"), tag="t")
    eng.wait_for_checkpoint()
    assert _rank_bytes(tmp_path / "s", "t") == _rank_bytes(tmp_path / "a", "t")
    _same_but_writer(_manifest(tmp_path / "s", "t"), _manifest(tmp_path / "a", "t"))
    assert all(rec["crc32"] for rec in _manifest(tmp_path / "a", "t")["files"].values())  # same CRC-32s too
    assert (tmp_path / "a" / "latest").read_text() == "t" and verify(tmp_path / "a").ok
    eng.save_checkpoint(str(tmp_path / "a"), tag="t2")  # the snapshot memory is reused, not reallocated
    eng.wait_for_checkpoint()
    assert [id(b) for b in staging._blocks] == [id(b) for b in blocks] and staging.alloc_s == alloc
    _, want = R.train(0, 1, R.config(stage), 2, first=3, engine_=ref)
    fresh, _ = R.train(0, 1, _cfg(stage), 0)
    path, _ = fresh.load_checkpoint(str(tmp_path / "a"), tag="t")
    _load_stats_match_the_file(fresh.load_stats, tmp_path / "a" / "t" / "rank_00000.safetensors")
    _, got = R.train(0, 1, _cfg(stage), 2, first=3, engine_=fresh)
    assert path is not None and got == want
    for e in (eng, fresh):
        e.destroy()


@pytest.mark.parametrize(
    "writer", [{"type": "python"}, {"io_buffer_double": False, "io_buffer_size": 8192}, {"io_multiplier": 3}]
)
def test_writer_options_write_the_same_bytes(writer: dict[str, Any], tmp_path: Path) -> None:
    eng, _ = R.train(0, 1, _cfg(**writer), 2)
    _sync_save(eng, tmp_path / "s", "t")
    eng.save_checkpoint(str(tmp_path / "a"), tag="t")
    eng.destroy()
    assert _rank_bytes(tmp_path / "s", "t") == _rank_bytes(tmp_path / "a", "t")
    assert verify(tmp_path / "s").ok and verify(tmp_path / "a").ok


def test_training_goes_on_and_latest_moves_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eng, _ = R.train(0, 1, _cfg(), 2)
    eng.save_checkpoint(str(tmp_path), tag="a")
    eng.wait_for_checkpoint()
    _sync_save(eng, tmp_path / "ref", "b")
    monkeypatch.setenv(DELAY, "1.5")  # every write of the background thread starts 1.5 s late
    t0 = time.perf_counter()
    eng.save_checkpoint(str(tmp_path), tag="b")
    assert time.perf_counter() - t0 < 1.0 and eng.checkpointer.busy
    assert (tmp_path / "latest").read_text() == "a" and not (tmp_path / "b").exists()
    R.train(0, 1, _cfg(), 2, first=2, engine_=eng)  # training goes on meanwhile
    eng.wait_for_checkpoint()
    assert (tmp_path / "latest").read_text() == "b" and not (tmp_path / ".b.staging").exists()
    assert _rank_bytes(tmp_path, "b") == _rank_bytes(tmp_path / "ref", "b")  # the state at the call
    eng.destroy()


def test_next_save_and_load_wait_for_the_one_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng, _ = R.train(0, 1, _cfg(), 2)
    monkeypatch.setenv(DELAY, "0.5")
    eng.save_checkpoint(str(tmp_path), tag="a")
    R.train(0, 1, _cfg(), 1, first=2, engine_=eng)
    eng.save_checkpoint(str(tmp_path), tag="b")  # waits for a first
    assert (tmp_path / "a" / "manifest.json").is_file()
    other = tmp_path / "elsewhere"
    eng.checkpointer.wait_for(other)  # another folder: no wait
    assert eng.checkpointer.busy
    fresh, _ = R.train(0, 1, _cfg(), 0)
    eng.load_checkpoint(str(tmp_path))  # the same folder: b is published first, then loaded
    assert not eng.checkpointer.busy and eng.global_steps == 3
    path, _ = fresh.load_checkpoint(str(tmp_path))
    assert Path(path).parent == tmp_path / "b" and fresh.global_steps == 3
    for e in (eng, fresh):
        e.destroy()


def _boom(*_a: Any, **_k: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device (injected)")


def test_background_errors_surface(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eng, _ = R.train(0, 1, _cfg(), 2)
    eng.save_checkpoint(str(tmp_path), tag="a")
    eng.wait_for_checkpoint()
    monkeypatch.setattr(W, "write_rank_views", _boom)
    eng.save_checkpoint(str(tmp_path), tag="b")  # returns: the failure happens in the background
    with pytest.raises(CheckpointSaveError, match="No space left") as err:
        eng.wait_for_checkpoint()
    assert isinstance(err.value.__cause__, OSError)
    assert (tmp_path / "latest").read_text() == "a" and not (tmp_path / "b").exists()
    assert not (tmp_path / ".b.staging").exists() and verify(tmp_path).ok
    eng.wait_for_checkpoint()  # raised once
    eng.save_checkpoint(str(tmp_path), tag="c")
    with pytest.raises(CheckpointSaveError, match="background save of .*c failed"):
        eng.save_checkpoint(str(tmp_path), tag="d")  # the next save raises it (and saves nothing)
    eng.save_checkpoint(str(tmp_path), tag="e")
    with pytest.raises(CheckpointSaveError):
        eng.load_checkpoint(str(tmp_path))  # a load of the same folder too
    eng.save_checkpoint(str(tmp_path), tag="f")
    with pytest.raises(CheckpointSaveError):
        eng.destroy()  # and destroy()
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "latest"]


_EXIT_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import _engine_ref as R
from zckpt.formats.native import write as W
cfg = {{**R.config(3), "checkpoint": {{"writer": {{"decoupled": True}}}}}}
eng, _ = R.train(0, 1, cfg, 2)
if {fail}:
    def boom(*a, **k):
        raise OSError(28, "No space left on device (injected)")
    W.write_rank_views = boom
eng.save_checkpoint({out!r}, tag="x")
print("returned", flush=True)
"""


@pytest.mark.parametrize("fail", [False, True])
def test_interpreter_exit_flushes_and_reports(fail: bool, tmp_path: Path) -> None:
    """Exit without waiting: the background save is finished first; a failure is printed, exit status 1."""
    script = textwrap.dedent(_EXIT_SCRIPT.format(tests=str(HERE), fail=fail, out=str(tmp_path / "ck")))
    env = {**os.environ, DELAY: "0.5", "PYTHONPATH": _slow_writes.child_pythonpath(HERE.parent),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "returned" in p.stdout, p.stderr[-3000:]
    if fail:
        assert p.returncode == 1 and "background save" in p.stderr and "No space left" in p.stderr, p.stderr
        assert not (tmp_path / "ck" / "latest").exists()
    else:
        assert p.returncode == 0, p.stderr[-3000:]
        assert (tmp_path / "ck" / "latest").read_text() == "x" and verify(tmp_path / "ck").ok


def test_sigkill_during_background_write_keeps_latest(tmp_path: Path) -> None:
    """A forked child saves b asynchronously (each write stretched) and is SIGKILLed at a random moment of
    the background write: ``latest`` names a, which verifies and loads; a new save of b then succeeds."""
    from _kill import fork, wait

    eng, _ = R.train(0, 1, _cfg(), 2)
    eng.save_checkpoint(str(tmp_path / "base"), tag="a")
    eng.wait_for_checkpoint()
    R.train(0, 1, _cfg(), 1, first=2, engine_=eng)
    rng = random.Random(16)

    def child(sd: Path) -> int:
        os.environ[DELAY] = "0.3"
        eng.save_checkpoint(str(sd), tag="b")
        (sd / "returned").write_text("")
        eng.wait_for_checkpoint()
        return 0

    for trial in range(3):
        sd = tmp_path / f"t{trial}"
        shutil.copytree(tmp_path / "base", sd)
        pid = fork(child, sd)
        while not (sd / "returned").exists():
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.25))
        os.kill(pid, 9)
        assert wait(pid, 30) == -9
        assert (sd / "latest").read_text() == "a" and not (sd / "b").exists() and verify(sd).ok
        fresh, _ = R.train(0, 1, _cfg(), 0)
        assert Path(fresh.load_checkpoint(str(sd))[0]).parent == sd / "a" and fresh.global_steps == 2
        fresh.destroy()
        eng.save_checkpoint(str(sd), tag="b")  # the killed save's staging folder is replaced
        eng.wait_for_checkpoint()
        assert (sd / "latest").read_text() == "b" and verify(sd).ok
    eng.destroy()


# ---- world 2 ---------------------------------------------------------------------------------------------
def _world2(rank: int, world: int, out: str) -> dict[str, Any]:
    from engine.checkpoint.async_save import SideGroup

    res: dict[str, Any] = {}
    for stage in (2, 3):
        d = Path(out) / f"s{stage}"
        eng, _ = R.train(rank, world, _cfg(stage), 2)
        assert isinstance(eng.checkpointer.group, SideGroup)
        _sync_save(eng, d / "sync", "t")
        eng.save_checkpoint(str(d / "async"), tag="t")
        R.train(rank, world, _cfg(stage), 1, first=2, engine_=eng)  # collectives while the writer agrees
        eng.wait_for_checkpoint()
        same = _rank_bytes(d / "sync", "t", rank) == _rank_bytes(d / "async", "t", rank)
        real = W.write_rank_views
        if rank == 1:  # a failure on rank 1 only
            W.write_rank_views = _boom  # type: ignore[assignment]
        eng.save_checkpoint(str(d / "async"), tag="bad")
        try:
            eng.wait_for_checkpoint()
            failure = "none"
        except CheckpointSaveError as e:
            failure = "own" if isinstance(e.__cause__, OSError) else f"peer: {e}"
        W.write_rank_views = real  # type: ignore[assignment]
        res[f"snapshot{stage}"] = _snapshot_failure(eng, rank, d / "async")
        eng.save_checkpoint(str(d / "async"), tag="good")
        eng.wait_for_checkpoint()
        latest = (d / "async" / "latest").read_text()
        eng.destroy()
        res[f"s{stage}"] = {"same": same, "failure": failure, "latest": latest}
    return res


def _snapshot_failure(eng: Any, rank: int, d: Path) -> str:
    """Rank 1's snapshot fails: it raises at once; rank 0's save fails in the background, naming rank 1."""
    from engine.checkpoint.host import HostStaging

    real = HostStaging.put
    if rank == 1:
        HostStaging.put = _boom  # type: ignore[method-assign]
    try:
        eng.save_checkpoint(str(d), tag="snap")
        eng.wait_for_checkpoint()
        return "none"
    except OSError:
        return "own, at once"
    except CheckpointSaveError as e:
        return f"peer: {e}"
    finally:
        HostStaging.put = real  # type: ignore[method-assign]


@pytest.mark.dist
def test_world2_side_group_same_files_and_shared_failure(tmp_path: Path) -> None:
    from _dist import run

    results = run(_world2, 2, str(tmp_path))
    for stage in (2, 3):
        r0, r1 = results[0][f"s{stage}"], results[1][f"s{stage}"]
        assert r0["same"] and r1["same"]
        assert r1["failure"] == "own" and r0["failure"].startswith("peer") and "rank 1" in r0["failure"]
        s0, s1 = results[0][f"snapshot{stage}"], results[1][f"snapshot{stage}"]
        assert s1 == "own, at once" and s0.startswith("peer") and "rank 1" in s0, (s0, s1)
        assert r0["latest"] == r1["latest"] == "good"
        assert not (tmp_path / f"s{stage}" / "async" / "bad").exists()
        assert not (tmp_path / f"s{stage}" / "async" / "snap").exists()
        assert verify(tmp_path / f"s{stage}" / "async").ok and verify(tmp_path / f"s{stage}" / "sync").ok


def _big_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(24)])  # 100.7M params


def _remove_after_all(rank: int, *folders: Path) -> None:
    """Once every rank is done with ``folders``, rank 0 removes them (the disk a CI run has is limited)."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        for f in folders:
            shutil.rmtree(f)
    dist.barrier()


def _timing(rank: int, world: int, out: str) -> dict[str, Any]:
    import engine

    res: dict[str, Any] = {}
    for stage in (2, 3):
        model = _big_model()
        cfg = {"train_batch_size": 2 * world, "zero_optimization": {"stage": stage},
               "checkpoint": {"writer": {"decoupled": True}}}  # fmt: skip
        eng, *_ = engine.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
        loss = eng(torch.randn(2, 2048)).pow(2).mean()
        eng.backward(loss)
        eng.step()
        d = Path(out) / f"s{stage}"
        sync, blocked = [], []
        blocks = None
        for i in range(2):
            t0 = time.perf_counter()
            _sync_save(eng, d, f"s{i}")
            sync.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            eng.save_checkpoint(str(d), tag=f"a{i}")
            blocked.append(time.perf_counter() - t0)
            eng.wait_for_checkpoint()
            ids = [id(b) for b in eng.checkpointer.staging._blocks]
            assert blocks is None or ids == blocks, "the snapshot memory was reallocated"
            blocks = ids
            if i == 0:  # the warm-up pair (1.2 GB each at world 2) is not kept beside the measured one
                _remove_after_all(rank, d / "s0", d / "a0")
        same = _rank_bytes(d, "s1", rank) == _rank_bytes(d, "a1", rank)
        res[f"s{stage}"] = {"sync": min(sync), "blocked": min(blocked), "same": same,
                            "bytes": eng.checkpoint_stats["write"]["bytes"]}  # fmt: skip
        eng.destroy()
        _remove_after_all(rank, d)
    return res


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.serial  # a ratio of two timings: no other test's load meanwhile
def test_world2_100m_save_call_blocks_at_most_035_of_sync(tmp_path: Path) -> None:
    from _dist import run

    results = run(_timing, 2, str(tmp_path))
    for stage in (2, 3):
        for r in results:
            s = r[f"s{stage}"]
            assert s["same"] and s["bytes"] > 550e6, s
            assert s["blocked"] <= 0.35 * s["sync"], (stage, s)
    print({f"rank{i}": r for i, r in enumerate(results)})


def _save_then_leave(rank: int, world: int, out: str) -> str:
    """Start a slowed background save and return at once: ``_dist`` then calls
    ``dist.destroy_process_group()``, as scripts end, while the save is still writing."""
    eng, _ = R.train(rank, world, _cfg(3), 2)
    os.environ[DELAY] = "0.2"
    eng.save_checkpoint(out, tag="last")
    return "returned"


@pytest.mark.dist
def test_destroy_process_group_finishes_the_save_in_flight(tmp_path: Path) -> None:
    """A script's last act, ``destroy_process_group()``, lands while its last checkpoint is still being
    written in the background: the save finishes first (its side group is among the groups destroyed), so
    ``latest`` names it and it verifies; without that the save fails and the checkpoint is lost."""
    from _dist import run

    assert run(_save_then_leave, 2, str(tmp_path / "ck")) == ["returned", "returned"]
    assert (tmp_path / "ck" / "latest").read_text() == "last" and verify(tmp_path / "ck").ok
