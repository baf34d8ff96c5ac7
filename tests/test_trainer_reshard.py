"""reshard of HF Trainer ``checkpoint-N`` folders (``zckpt.ops.trainer_files``): a complete ``checkpoint-N``
for the new world.

Inputs: the real Trainer + DeepSpeed fixtures ``fixtures/trainer/<case>/checkpoint-3`` (see its README).
Oracles: the source files themselves (sha256 of every side file, of each old rank's RNG file; the source's
tensors through zckpt's reader, bit for bit), the source's ``trainer_state.json`` with only
``train_batch_size`` changed, the one-process output for the torchrun path, and ``oracle.json``'s resume
losses for the real Trainer (``fixtures/trainer_resume.py`` in the dev venv, marked ``deepspeed`` + ``slow``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from _fixtures import fixture

import zckpt
from zckpt.codecs.pickle_safe import TensorRef
from zckpt.codecs.torchzip import load_archive
from zckpt.errors import CorruptCheckpoint, WriteFailed
from zckpt.formats.deepspeed.archive import Archive
from zckpt.ops import trainer_files
from zckpt.ops.reshard import reshard
from zckpt.storage import fileio

REPO = Path(__file__).resolve().parents[1]
FIX = fixture("trainer")  # a missing fixture folder is an error at collection, never a skip
DS_PYTHON = REPO / ".venv-ds" / "bin" / "python"
TAG = "global_step3"

# (case, new world, per-device batch written to trainer_state.json)
CASES = [
    ("trainer_z2_w2", 1, 4),
    ("trainer_z2_w1", 2, 1),
    ("trainer_z3off_w2", 1, 4),
    ("trainer_z3off_w2", 3, 2),
]


def _src(case: str) -> Path:
    return FIX / case / "checkpoint-3"


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _rng_name(rank: int, world: int) -> str:
    return "rng_state.pth" if world == 1 else f"rng_state_{rank}.pth"


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _same_tensors(a: zckpt.Checkpoint, b: zckpt.Checkpoint) -> None:
    """Every entry (masters, optimizer states, frozen params, buffers) bit-identical, same state."""
    assert set(a.entries) == set(b.entries)
    for k, e in a.entries.items():
        f = b.entries[k]
        assert (e.role, e.shape, e.dtype, e.pytype) == (f.role, f.shape, f.dtype, f.pytype), k
        assert torch.equal(a.read(k), b.read(k)), k
    assert dict(a.meta.tied) == dict(b.meta.tied) and a.meta.step == b.meta.step
    sa, sb = a.meta.state, b.meta.state
    assert (sa.optimizer, sa.scheduler, sa.counters) == (sb.optimizer, sb.scheduler, sb.counters)


@pytest.mark.parametrize(("case", "world", "per_device"), CASES, ids=[f"{c}-to{w}" for c, w, _ in CASES])
def test_trainer_folder_resharded_complete(case: str, world: int, per_device: int, tmp_path: Path) -> None:
    src, out = _src(case), tmp_path / "checkpoint-3"
    old = json.loads((FIX / case / "oracle.json").read_text())["world"]
    res = reshard(src, out, world=world, progress=False)
    rng_src = {_rng_name(r, old) for r in range(old)}
    rng_dst = {_rng_name(r, world) for r in range(world)}
    side = {p.name for p in src.iterdir() if p.is_file()} - rng_src - {"latest", "trainer_state.json"}
    top = {p.name for p in out.iterdir()}
    assert top == side | rng_dst | {"latest", "trainer_state.json", TAG}
    assert (out / "latest").read_text().strip() == TAG
    for (
        n
    ) in side:  # config, tokenizer, generation config, model.safetensors, scheduler.pt, training_args.bin..
        assert _sha(out / n) == _sha(src / n), n
        assert (out / n).stat().st_mode & 0o777 == (src / n).stat().st_mode & 0o777, n
    for r in range(world):  # new rank r takes old rank r % old's RNG file, byte for byte
        assert _sha(out / _rng_name(r, world)) == _sha(src / _rng_name(r % old, old)), r
    state, before = (
        json.loads((out / "trainer_state.json").read_text()),
        json.loads((src / "trainer_state.json").read_text()),
    )
    assert state == {**before, "train_batch_size": per_device}
    text = (
        (src / "trainer_state.json")
        .read_text()
        .replace('"train_batch_size": 2,', f'"train_batch_size": {per_device},')
    )
    assert (out / "trainer_state.json").read_text() == text  # only that value's digits changed
    written = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert set(res.files) == {
        n for n in written if not n.endswith((".sha256", ".sha256.json", ".crc32.json"))
    } - {"latest"}
    notes = "\n".join(res.notes)
    assert f"new rank r takes old rank r % {old}'s file" in notes
    if per_device != 2:
        assert f"trainer_state.json train_batch_size rewritten 2 -> {per_device}" in notes
        assert f"per_device_train_batch_size={per_device}" in notes
    else:
        assert "global batch 4 (2 per device x 2 ranks x grad accum 1) cannot be kept at 3 ranks" in notes
    # one note on the batch: the DeepSpeed writer's ds_config note said the same a second time (issue 25)
    assert len([n for n in res.notes if "batch" in n]) == 1
    a, b = zckpt.open(src), zckpt.open(out)
    try:
        assert b.meta.world_size == world and b.meta.stage == a.meta.stage
        _same_tensors(a, b)
    finally:
        a.close()
        b.close()


def _types(o: Any, path: str = "") -> dict[str, str]:
    """Python type of every value of a pickled object, by path (tensors: dtype and rank)."""
    if isinstance(o, TensorRef):
        return {path: f"tensor{len(o.shape)}d:{o.dtype}"}
    out = {path: type(o).__name__}
    if isinstance(o, dict):
        for k, v in o.items():
            out.update(_types(v, f"{path}.{k}"))
    elif isinstance(o, (list, tuple)):
        for i, v in enumerate(o):
            out.update(_types(v, f"{path}[{i}]"))
    return out


def _inner(obj: dict[str, Any]) -> dict[str, Any]:
    osd = obj["optimizer_state_dict"]
    inner: dict[str, Any] = osd.get("base_optimizer_state") or osd["optimizer_state_dict"]
    return inner


@pytest.mark.parametrize(("case", "world"), [(c, w) for c, w, _ in CASES])
def test_optimizer_values_keep_python_types(case: str, world: int, tmp_path: Path) -> None:
    """Every optimizer value keeps its Python type: the fixtures' tensor ``step`` and hyper-parameters, and
    the same files edited by hand to hold what other optimizers save (``step`` as a Python int or float in
    the state, an int ``step`` in the param groups as DeepSpeed's fused/CPU Adam keep it, a tuple ``eps``
    as Adafactor's, a float64 tensor ``lr``)."""
    src = _src(case)
    res = reshard(src, tmp_path / "plain", world=world, progress=False)
    for f in sorted((src / TAG).glob("*optim_states.pt")):
        got = tmp_path / "plain" / TAG / f.name.replace("_rank_1_", "_rank_0_")
        assert _types(_inner(load_archive(str(f))[1])) == _types(_inner(load_archive(str(got))[1]))
    edited = tmp_path / "edited"
    shutil.copytree(src, edited, ignore=shutil.ignore_patterns("*optim_states.pt"))
    for f in sorted((src / TAG).glob("*optim_states.pt")):
        obj = load_archive(str(f))[1]
        inner = _inner(obj)
        for k, st in inner["state"].items():
            st["step"] = 3 if k == 0 else 3.0
        for g in inner["param_groups"]:
            g.update(step=3, eps=(1e-30, 1e-3), lr=torch.tensor(0.005, dtype=torch.float64))
        a = Archive()
        a.save(edited / TAG / f.name, a.convert(obj))
    res = reshard(edited, tmp_path / "out", world=world, progress=False)
    assert res.world == world
    for f in sorted((tmp_path / "out" / TAG).glob("*optim_states.pt")):
        inner = _inner(load_archive(str(f))[1])
        assert {k: type(st["step"]) for k, st in inner["state"].items()} == {0: int, 1: float}
        assert [st["step"] for st in inner["state"].values()] == [3, 3.0]
        for g in inner["param_groups"]:
            assert type(g["step"]) is int and g["step"] == 3
            assert type(g["eps"]) is tuple and g["eps"] == (1e-30, 1e-3)
            assert type(g["betas"]) is tuple
            lr = g["lr"]
            assert isinstance(lr, TensorRef) and lr.shape == () and lr.dtype == torch.float64
            val = torch.empty(1, dtype=torch.float64)
            fileio.read_into(lr.file, lr.byte_offset, val)
            assert val.item() == 0.005


def test_cli_prints_the_notes(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from zckpt.cli.app import app

    args = ["reshard", str(_src("trainer_z2_w2")), str(tmp_path / "o"), "--world", "1", "--no-progress"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.stdout
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("note: ")]
    assert any("rng_state_0.pth -> rng_state.pth" in ln for ln in lines)
    assert any("per_device_train_batch_size=4" in ln for ln in lines)
    # the global batch is stated once (it was printed twice: the Trainer's note and ds_config's)
    assert len([ln for ln in lines if "keeps the global batch 4" in ln]) == 1
    assert not any(ln.startswith("note: ds_config:") for ln in lines)


def test_odd_trainer_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sub-folders and sidecars of rewritten files are left out with a note; a damaged trainer_state.json,
    a broken link and a failed copy are one error each and publish nothing."""
    src = tmp_path / "checkpoint-3"
    shutil.copytree(_src("trainer_z2_w2"), src)
    (src / "runs").mkdir()
    (src / "runs" / "events").write_bytes(b"x")
    (src / "rng_state_0.pth.sha256").write_text("0" * 64 + "  rng_state_0.pth\n")
    (src / "README.md").write_text("kept\n")
    res = reshard(src, tmp_path / "o", world=1, progress=False)
    assert "HF Trainer folder: not copied: runs/, rng_state_0.pth.sha256" in res.notes
    assert (tmp_path / "o" / "README.md").read_text() == "kept\n"
    assert not (tmp_path / "o" / "runs").exists() and not (tmp_path / "o" / "rng_state_0.pth.sha256").exists()

    (src / "dangling").symlink_to(src / "nowhere")
    with pytest.raises(CorruptCheckpoint, match=r"dangling: not a regular file"):
        reshard(src, tmp_path / "o2", world=1, progress=False)
    (src / "dangling").unlink()
    good = (src / "trainer_state.json").read_bytes()
    (src / "trainer_state.json").write_text("[1, 2")
    with pytest.raises(CorruptCheckpoint, match=r"trainer_state.json: not a JSON object"):
        reshard(src, tmp_path / "o2", world=1, progress=False)
    (src / "trainer_state.json").write_bytes(good)

    doc = json.loads(good)  # a train_batch_size that is no batch size: said, the file copied as it is
    bad = json.dumps({**doc, "train_batch_size": "abc"}).encode()
    (src / "trainer_state.json").write_bytes(bad)
    res = reshard(src, tmp_path / "o3", world=4, progress=False)
    assert any("train_batch_size 'abc' is not a positive integer" in n for n in res.notes), res.notes
    assert (tmp_path / "o3" / "trainer_state.json").read_bytes() == bad
    (src / "trainer_state.json").write_bytes(good)

    real = trainer_files._copy
    calls: list[str] = []

    def full(a: Path, b: Path) -> int:
        calls.append(a.name)
        if len(calls) == 3:
            raise OSError(28, "No space left on device", str(b))
        return real(a, b)

    monkeypatch.setattr(trainer_files, "_copy", full)
    with pytest.raises(WriteFailed, match="No space left"):
        reshard(src, tmp_path / "o2", world=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "o", "o3"]  # no staging, no o2


def test_plain_deepspeed_folder_gets_no_side_files(tmp_path: Path) -> None:
    src = REPO / "fixtures" / "ds" / "s2_fp32_w2_g2"
    res = reshard(src, tmp_path / "o", world=1, progress=False)
    assert {p.name for p in (tmp_path / "o").iterdir()} == {"latest", res.tag}
    assert not any(n.startswith("HF Trainer") for n in res.notes)


# ---- torchrun path --------------------------------------------------------------------------------------
DIST = [("trainer_z2_w1", 2), ("trainer_z3off_w2", 3), ("trainer_z2_w2", 1)]


def _dist_procs(rank: int, world: int, root: str) -> dict[str, Any]:
    seen = {}
    for case, w in DIST:
        out = Path(root) / "dist" / f"{case}-{w}"
        res = reshard(_src(case), out, world=w, progress=False, distributed=True)
        seen[f"{case}-{w}"] = {"files": res.files, "notes": res.notes}
    return seen


@pytest.mark.dist
def test_distributed_trainer_reshard_matches_single_process(tmp_path: Path) -> None:
    from _dist import run

    want = {}
    for case, w in DIST:
        res = reshard(
            _src(case), tmp_path / "ref" / f"{case}-{w}", world=w, progress=False, distributed=False
        )
        want[f"{case}-{w}"] = {"files": res.files, "notes": res.notes}
    results = run(_dist_procs, 2, str(tmp_path))
    for name in want:
        got, exp = _tree(tmp_path / "dist" / name), _tree(tmp_path / "ref" / name)
        assert sorted(got) == sorted(exp) and got == exp, name  # side files, rng files, state: byte for byte
        assert all(r[name] == want[name] for r in results), name
    assert sorted(p.name for p in (tmp_path / "dist").iterdir()) == sorted(want)  # no staging folder left


# ---- the real Trainer resumes the output ------------------------------------------------------------------
RESUME = [  # (case, new world, abs tolerance vs the same-world resume, step 4 bitwise)
    ("trainer_z2_w2", 1, 1e-6, True),
    ("trainer_z2_w1", 2, 1e-6, False),  # 1 -> 2: the cross-rank loss mean rounds differently from step 4 on
    ("trainer_z3off_w2", 1, 2e-4, True),  # bf16 ZeRO-3 offload
]


_LIVE: dict[tuple[str, int, bool], dict[str, float]] = {}


def _ds_resume_losses(case: str, world: int, universal: bool, tmp: Path) -> dict[str, float]:
    """Losses of steps 4-6 resuming the source checkpoint with real DeepSpeed on this machine, the way
    ``fixtures/make_trainer_fixtures.py`` made ``oracle.json`` (``universal``: through ``ds_to_universal``
    and ``load_universal``). Bit-for-bit comparisons need the oracle from the same CPU: another CPU's
    kernels round fp32 reductions differently (stored oracles agree with this machine's within 1e-6)."""
    key = (case, world, universal)
    if key not in _LIVE:
        out = tmp / f"live-{case}-{world}-{int(universal)}.json"
        code = (
            "import sys; from pathlib import Path; sys.path.insert(0, 'fixtures'); "
            "import make_trainer_fixtures as M; "
            f"M.resume(M.case_by_name({case!r}), Path({str(_src(case))!r}), {world}, Path({str(out)!r}), "
            f"universal={universal})"
        )
        env = dict(os.environ, OMP_NUM_THREADS="1", DS_BUILD_OPS="0")
        p = subprocess.run([str(DS_PYTHON), "-c", code], capture_output=True, text=True, timeout=900,
                           cwd=REPO, env=env)  # fmt: skip
        res = json.loads(out.read_text()) if out.exists() else {}
        assert p.returncode == 0 and res.get("ok"), (p.stderr[-3000:], res.get("error"))
        _LIVE[key] = {str(r["step"]): r["loss"] for r in res["rows"]}
    return _LIVE[key]


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.parametrize(("case", "world", "tol", "step4"), RESUME, ids=[f"{c}-to{w}" for c, w, *_ in RESUME])
def test_trainer_resumes_resharded_checkpoint(
    case: str, world: int, tol: float, step4: bool, tmp_path: Path
) -> None:
    """``Trainer.train(resume_from_checkpoint=...)`` on the resharded folder at the new world, global batch
    kept (per-device batch = the one the note names): the losses of steps 4-6 equal the un-resharded resume
    within ``tol`` (``oracle.json``'s ``resume_same_world``, and the same resume run here) and DeepSpeed's own
    universal-checkpoint resume at that world bit for bit (run here: ``oracle.json``'s
    ``resume_other_world_universal`` came from another CPU, so it is held to ``tol``)."""
    oracle_file = FIX / case / "oracle.json"
    oracle = json.loads(oracle_file.read_text())
    res = reshard(_src(case), tmp_path / "checkpoint-3", world=world, progress=False)
    per_device = oracle["global_batch"] // (world * oracle["grad_accum"])
    if per_device != oracle["per_device_batch"]:
        assert any(f"per_device_train_batch_size={per_device}" in n for n in res.notes)
    out = tmp_path / "resume.json"
    cmd = [
        str(DS_PYTHON),
        str(REPO / "fixtures" / "trainer_resume.py"),
        str(tmp_path / "checkpoint-3"),
        str(out),
    ]
    cmd += [
        "--world",
        str(world),
        "--per-device-batch",
        str(per_device),
        "--case",
        case,
        "--oracle",
        str(oracle_file),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    got = json.loads(out.read_text()) if out.exists() else {}
    assert p.returncode == 0 and got.get("complete"), (p.stdout[-2000:], p.stderr[-4000:], got.get("error"))
    losses, stored = got["losses"], oracle["resume_same_world"]["losses"]
    same = _ds_resume_losses(case, oracle["world"], False, tmp_path)
    assert sorted(losses) == sorted(stored) == sorted(same) == ["4", "5", "6"]
    for k in same:
        assert max(abs(losses[k] - same[k]), abs(losses[k] - stored[k])) <= tol, (k, losses, same, stored)
    assert not step4 or losses["4"] == same["4"]
    other = oracle["resume_other_world_universal"]
    assert other["world"] == world and all(abs(losses[k] - other["losses"][k]) <= tol for k in losses)
    assert losses == _ds_resume_losses(case, world, True, tmp_path)
    assert not any("do not match" in n or "Didn't find an RNG file" in n for n in got["log_notes"])
