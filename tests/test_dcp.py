"""The DCP reader, verify and writer against real torch.distributed.checkpoint files (``fixtures/dcp``) and
torch's own oracles: ``ref_model.safetensors`` / ``ref_optim.safetensors`` / ``ref_param_groups.json``
(``get_model_state_dict`` / ``get_optimizer_state_dict`` with full_state_dict) and ``ref_torch_save*.pt``
(``dcp_to_torch_save``). Held-out cases (``fixtures/make_dcp_heldout.py DIR``) run the same checks when
``ZCKPT_DCP_HELDOUT=DIR`` is set. FSDP2 loading of what ``--to dcp`` writes: ``test_dcp_dist.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import zckpt
from zckpt.errors import KeyMappingError, UnsafePickle, Unsupported
from zckpt.formats.dcp.boxes import box_piece, tiling_problem
from zckpt.formats.dcp.metadata import Chunk
from zckpt.model import Role

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "fixtures" / "dcp"
CASES = [
    "fsdp2_w1", "fsdp2_w2", "fsdp2_w3", "fsdp2_w4", "fsdp2_mp_w2", "fsdp2_bf16_w3", "model_only_w2",
    "torchtitan_w2", "accelerate_w2", "fsdp1_w2", "threads_w2", "perfile_w2", "hsdp_w4", "tp_w2", "tp2d_w4",
    "stformat_w2", "hf_w2",
]  # fmt: skip
READABLE = CASES  # zstd_w2 is refused (test_zstd_is_refused_with_a_hint)
HELDOUT = os.environ.get("ZCKPT_DCP_HELDOUT")


def _info(case_dir: Path) -> dict[str, Any]:
    info: dict[str, Any] = json.loads((case_dir / "case.json").read_text())
    return info


def _dirs(case_dir: Path) -> list[Path]:
    return [case_dir / d for d in _info(case_dir)["dcp_dirs"]]


def _case_dirs() -> list[Path]:
    dirs = [FIX / c for c in READABLE]
    missing = [str(d) for d in dirs if not (d / "case.json").is_file()]
    assert not missing, f"DCP fixtures missing (regenerate with fixtures/make_dcp_fixtures.py): {missing}"
    if HELDOUT:
        dirs += sorted(p.parent for p in Path(HELDOUT).glob("*/case.json"))
    return dirs


ALL = _case_dirs()


def _ids(p: Path) -> str:
    return p.name


def test_every_committed_fixture_is_present() -> None:
    assert all((FIX / c / "case.json").is_file() for c in [*CASES, "zstd_w2"])


# ---- consolidate / optimizer states / param groups vs torch's oracles -------------------------------
@pytest.mark.parametrize("case_dir", ALL, ids=_ids)
def test_consolidate_is_bit_exact_to_torch_full_state_dict(case_dir: Path, tmp_path: Path) -> None:
    """consolidate -> safetensors equals get_model_state_dict(full_state_dict=True) bit for bit (every name,
    dtype kept); optimizer states equal get_optimizer_state_dict's; param groups equal, every key."""
    info = _info(case_dir)
    src = _dirs(case_dir)[0]
    out = tmp_path / "model.safetensors"
    res = zckpt.consolidate(src, out, progress=False)
    got = load_file(str(out))
    ref = load_file(str(case_dir / "ref_model.safetensors"))
    tied: dict[str, str] = dict(res.tied)
    dropped = set(info["tied"]) if info["layout"] == "hf" else set()
    assert set(got) | set(tied) == set(ref) - dropped
    for k, want in ref.items():
        if k in dropped:
            continue
        t = got[tied.get(k, k)]
        assert t.dtype == want.dtype and torch.equal(t, want), k
    with zckpt.open(src) as ck:
        if info["layout"] in ("model_only", "hf"):
            assert ck.optim_keys() == [] and ck.meta.state.optimizer is None
            return
        assert tied == info["tied"]  # the tied alias is detected (its chunks' CRCs equal the owner's)
        ropt = load_file(str(case_dir / "ref_optim.safetensors"))
        assert set(ck.optim_keys()) == set(ropt)
        for k, want in ropt.items():
            t = ck.read(k)
            assert t.dtype == want.dtype and torch.equal(t, want), k
        groups = [{**g.options, "params": list(g.params)} for g in ck.meta.state.optimizer.groups]
        assert groups == json.loads((case_dir / "ref_param_groups.json").read_text())
        roles = {e.name: e.role for e in ck.model_entries()}
        assert all(roles[n] is Role.FROZEN for n in info["frozen"])
        assert all(roles[n] is Role.BUFFER for n, b in info["buffers"].items() if b["persistent"])
        assert ck.meta.step == info["steps"] and ck.meta.world_size == info["world"]


@pytest.mark.parametrize("case_dir", [d for d in ALL if _info(d)["layout"] != "hf"], ids=_ids)
def test_diff_against_dcp_to_torch_save_is_clean(case_dir: Path) -> None:
    """``zckpt diff <dcp> <its dcp_to_torch_save .pt>``: equal, optimizer states included."""
    info = _info(case_dir)
    pts = [case_dir / f for f in info["oracles"]["ref_torch_save"]["files"]]
    if not pts:  # FileSystemWriter(serialization_format=SAFETENSORS): torch 2.13 cannot read it back
        assert "dcp_to_torch_save" in str(info["oracles"]["ref_torch_save"]["torch_limitations"])
        return
    dirs = _dirs(case_dir)
    if len(pts) == 1:
        if info["layout"] == "model_only":  # --include-optimizer would select nothing: an error (issue 25)
            with pytest.raises(KeyMappingError, match="neither A"):
                zckpt.diff(dirs[0], pts[0], include_optimizer=True, progress=False)
        has_optim = info["layout"] != "model_only"
        r = zckpt.diff(dirs[0], pts[0], include_optimizer=has_optim, progress=False)
        assert r.equal and r.optimizer_compared == has_optim, r.to_text()
        return
    # accelerate: one .pt per folder; the pair reads as one checkpoint, each .pt holds one half of it
    model = zckpt.diff(dirs[0], pts[0], progress=False)
    optim = zckpt.diff(dirs[1], pts[1], include_optimizer=True, progress=False)
    assert model.equal, model.to_text()
    assert optim.differing == 0 and not optim.only_in_b and optim.optimizer_compared
    assert set(optim.only_in_a) == set(zckpt.open(dirs[0]))


@pytest.mark.parametrize("case_dir", ALL, ids=_ids)
def test_model_only_open_is_the_full_opens_model(case_dir: Path) -> None:
    """What consolidate and diff open (``model_only``: the model chunks' archives, and what gives the step)
    has the full open's model entries, pieces, roles, ties, precision and step, and no optimizer state."""
    path = _dirs(case_dir)[0]
    with zckpt.open(path) as full, zckpt.open(path, model_only=True) as part:
        lazy = _info(case_dir)["layout"] != "hf"  # chunk archives located on a background thread
        assert all(e.deferred == lazy for e in part.model_entries())
        assert [repr(e).replace("DeferredEntry(", "TensorEntry(", 1) for e in part.model_entries()] == [
            repr(e) for e in full.model_entries()
        ]
        assert (part.meta.tied, part.meta.state.precision) == (full.meta.tied, full.meta.state.precision)
        assert part.meta.step == full.meta.step
        assert part.optim_keys() == [] and part.meta.state.optimizer is None
        for name in list(full)[:3]:
            assert torch.equal(part[name], full[name])


@pytest.mark.parametrize("case_dir", ALL, ids=_ids)
def test_verify_is_clean(case_dir: Path) -> None:
    for d in _dirs(case_dir):
        rep = zckpt.verify(d)
        assert rep.ok, rep.to_text()
        assert rep.checksums > 0 or _info(case_dir)["layout"] == "hf"


def test_zstd_is_refused_with_a_hint() -> None:
    with pytest.raises(Unsupported, match="compressed") as e:
        zckpt.open(FIX / "zstd_w2" / "checkpoint")
    assert "dcp_to_torch_save" in (e.value.hint or "")


# ---- layouts, values, folders -----------------------------------------------------------------------
def test_torchtitan_values_listed_and_pickles_only_loaded_when_trusted() -> None:
    d = FIX / "torchtitan_w2" / "checkpoint"
    r = zckpt.inspect(d)  # the step-N parent: the latest step folder is read
    assert r.tag == "step-3" and r.step == 3
    assert r.values["train_state.ntokens_seen"] == "90" and r.values["dataloader.world_size"] == "2"
    assert "not unpickled" in r.values["dataloader.dp_rank_0"]
    assert "not unpickled" in r.values["train_state.global_avg_losses"]
    with zckpt.open(d) as ck:
        st = ck.meta.state
        assert st.scheduler["last_epoch"] == 3 and st.scheduler["base_lrs"] == [0.01, 0.01]
        assert st.client_state["train_state"]["step"] == 3
        assert "dp_rank_0" not in st.client_state["dataloader"]
    trusted = zckpt.inspect(d, trust_pickle=True).values
    losses = _info(FIX / "torchtitan_w2")["losses"]
    assert trusted["train_state.global_avg_losses"] == repr(losses)
    assert trusted["dataloader.dp_rank_0"].startswith("{'_snapshot': {'_snapshot_step': 3")


def test_accelerate_pair_from_parent_or_either_folder() -> None:
    base = FIX / "accelerate_w2" / "checkpoints" / "checkpoint_0"
    keys = None
    for p in (base, base / "pytorch_model_fsdp_0", base / "optimizer_0"):
        with zckpt.open(p) as ck:
            assert ck.meta.path == str(base) and ck.meta.extra["layout"] == "accelerate"
            assert keys is None or set(ck.entries) == keys
            keys = set(ck.entries)
    assert keys is not None and any(":" in k for k in keys)


def test_cli_inspect_and_consolidate_bf16_hf_folder(tmp_path: Path) -> None:
    src = FIX / "fsdp2_w3" / "checkpoint"
    run = [sys.executable, "-m", "zckpt.cli.app"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([*run, "inspect", str(src)], capture_output=True, text=True, env=env)
    assert (
        p.returncode == 0 and "format      dcp" in p.stdout and "tied: head.weight -> emb.weight" in p.stdout
    )
    out = tmp_path / "hf"
    p = subprocess.run([*run, "consolidate", str(src), str(out), "--dtype", "bf16", "--format", "bin"],
                       capture_output=True, text=True, env=env)  # fmt: skip
    assert p.returncode == 0, p.stderr
    sd = torch.load(out / "pytorch_model.bin", weights_only=True)
    ref = load_file(str(FIX / "fsdp2_w3" / "ref_model.safetensors"))
    for k, v in ref.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert torch.equal(sd[k], want), k
    assert sd["head.weight"].data_ptr() == sd["emb.weight"].data_ptr()  # .bin: the tie is one storage


# ---- damage: one line, never a traceback; verify names the file --------------------------------------
def _copy(tmp: Path) -> Path:
    d = tmp / "ck"
    shutil.copytree(FIX / "fsdp2_w2" / "checkpoint", d)
    return d


def _kinds(d: Path) -> dict[str, str]:
    return {Path(p.file).name: p.kind for p in zckpt.verify(d).problems}


@pytest.mark.parametrize("small", [None, 0], ids=["as-is", "every-record-on-the-scan-threads"])
def test_verify_truncated_missing_flipped_stray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small: int | None
) -> None:
    """``small=0``: every record's CRC-32 is computed on the scan threads while later archives are parsed
    (``start_archive_check``), as the big records of a real-size checkpoint are."""
    if small is not None:
        from zckpt.codecs import torchzip

        monkeypatch.setattr(torchzip, "_SMALL_RECORD", small)
    d = _copy(tmp_path)
    os.truncate(d / "__1_0.distcp", (d / "__1_0.distcp").stat().st_size - 100)
    assert _kinds(d) == {"__1_0.distcp": "truncated"}
    shutil.copy(FIX / "fsdp2_w2" / "checkpoint" / "__1_0.distcp", d / "__1_0.distcp")
    (d / "__0_0.distcp").unlink()
    assert _kinds(d) == {"__0_0.distcp": "missing"}
    shutil.copy(FIX / "fsdp2_w2" / "checkpoint" / "__0_0.distcp", d / "__0_0.distcp")
    with zckpt.open(d) as ck:  # a byte inside emb.weight's first chunk
        at = ck.entries["emb.weight"].pieces[0].byte_offset + 17
    with open(d / "__0_0.distcp", "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    rep = zckpt.verify(d)
    assert [(Path(p.file).name, p.kind) for p in rep.problems] == [("__0_0.distcp", "corrupt")]
    assert "CRC-32" in rep.problems[0].message and "model.emb.weight" in rep.problems[0].message
    shutil.copy(FIX / "fsdp2_w2" / "checkpoint" / "__0_0.distcp", d / "__0_0.distcp")
    (d / "__7_0.distcp").write_bytes(b"stale")
    assert _kinds(d) == {"__7_0.distcp": "stale"}


def test_verify_report_is_one_line_per_damaged_file(tmp_path: Path) -> None:
    """Issue 24: two truncated rank files gave a 32-line report (20 items per file, then a count). Now one
    line per damaged file (its first problem and how many more) and the summary; --json lists every item
    and stays valid against docs/verify-json-schema.json."""
    from test_diff import validate

    d = _copy(tmp_path)
    os.truncate(d / "__0_0.distcp", 30000)
    os.truncate(d / "__1_0.distcp", 20000)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = [sys.executable, "-m", "zckpt.cli.app", "verify", str(d)]
    p = subprocess.run(run, capture_output=True, text=True, env=env)
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 3, p.stdout
    assert lines[0].startswith(f"{d / '__0_0.distcp'}: ") and "and 9 more problems" in lines[0], lines[0]
    assert lines[1].startswith(f"{d / '__1_0.distcp'}: ") and "ends past the end of the file" in lines[1]
    assert lines[2].endswith("57 problems in 2 files"), lines[2]
    js = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True, env=env).stdout)
    validate(js, json.loads((REPO / "docs" / "verify-json-schema.json").read_text()))
    assert len(js["problems"]) == 57 and {Path(q["file"]).name for q in js["problems"]} == {
        "__0_0.distcp",
        "__1_0.distcp",
    }
    assert all(q["kind"] == "truncated" for q in js["problems"])


def test_damaged_metadata_is_one_line(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    md = (d / ".metadata").read_bytes()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for data in (md[: len(md) // 2], md[:1] + bytes([md[1] ^ 0xFF]) + md[2:], b"\x80\x04" + b"\x00" * 50):
        (d / ".metadata").write_bytes(data)
        p = subprocess.run([sys.executable, "-m", "zckpt.cli.app", "inspect", str(d)],
                           capture_output=True, text=True, env=env)  # fmt: skip
        assert p.returncode == 2 and "Traceback" not in p.stderr and ".metadata" in p.stderr, p.stderr
    evil = pickle.dumps(os.system)  # a global outside the allowlist: refused before anything is called
    (d / ".metadata").write_bytes(evil)
    with pytest.raises(UnsafePickle, match="not on zckpt's allowlist"):
        zckpt.open(d)


# ---- boxes --------------------------------------------------------------------------------------------
def test_tiling_gaps_overlaps_and_replicas() -> None:
    C = Chunk
    shape = (7, 11)
    tp2d = [C((0, 0), (4, 6)), C((0, 6), (4, 5)), C((4, 0), (3, 6)), C((4, 6), (3, 5))]
    assert tiling_problem(shape, tp2d) is None
    assert tiling_problem(shape, [*tp2d, C((4, 0), (3, 6)), C((7, 0), (0, 11))]) is None  # replica, empty
    assert "gap" in str(tiling_problem(shape, tp2d[:3]))
    over = [C((0, 0), (4, 7)), C((0, 6), (4, 5)), C((4, 0), (3, 5)), C((4, 6), (3, 5))]
    assert "overlap" in str(tiling_problem(shape, over))
    assert "outside" in str(tiling_problem(shape, [C((5, 0), (3, 11))]))
    assert tiling_problem((), [C((), ())]) is None


def test_box_piece_runs_cover_the_box() -> None:
    shape = (4, 5, 6)
    box = Chunk((1, 2, 0), (2, 3, 6))  # rows 1-2, cols 2-4, all of the last dim: 2 x 18-element runs
    p = box_piece(shape, box, "f", 0, torch.float32, None)
    assert p is not None and p.grid == ((2, 30),) and p.run == 18
    full = torch.arange(120).reshape(shape)
    want = full[1:3, 2:5, :].reshape(-1).tolist()
    got = [i for a, _, n in p.runs() for i in range(a, a + n)]
    assert got == want


# ---- writer round trips (zckpt-level; FSDP2 loading is in test_dcp_dist.py) --------------------------
def _same(a: zckpt.Checkpoint, b: zckpt.Checkpoint) -> None:
    assert set(a.entries) == set(b.entries) and dict(a.meta.tied) == dict(b.meta.tied)
    for k, e in a.entries.items():
        f = b.entries[k]
        assert (e.role, e.shape) == (f.role, f.shape), k
        assert torch.equal(a.read(k, f.dtype), b.read(k)), k


def test_reshard_dcp_to_dcp_native_deepspeed(tmp_path: Path) -> None:
    src = FIX / "tp2d_w4" / "checkpoint"
    a = zckpt.open(src)
    r = zckpt.reshard(src, tmp_path / "d3", world=3, to="dcp", progress=False)
    assert r.dst_format == "dcp" and ".metadata" in r.files and "__2_0.distcp" in r.files
    b = zckpt.open(tmp_path / "d3")
    _same(a, b)
    assert b.meta.world_size == 3 and b.meta.state.optimizer == a.meta.state.optimizer
    assert zckpt.verify(tmp_path / "d3").ok
    for to in ("native", "deepspeed"):
        zckpt.reshard(src, tmp_path / to, world=2, to=to, progress=False)
        c = zckpt.open(tmp_path / to)
        _same(a, c)
        zckpt.reshard(tmp_path / to, tmp_path / f"{to}-dcp", world=1, to="dcp", progress=False)
        _same(a, zckpt.open(tmp_path / f"{to}-dcp"))


def test_torchtitan_values_survive_dcp_to_dcp(tmp_path: Path) -> None:
    src = FIX / "torchtitan_w2" / "checkpoint"
    r = zckpt.reshard(src, tmp_path / "o", world=3, to="dcp", progress=False)
    assert any("dataloader" in n for n in r.notes)
    a, b = zckpt.open(src), zckpt.open(tmp_path / "o")
    _same(a, b)
    assert b.meta.extra["values"] == a.meta.extra["values"]
    assert b.meta.state.scheduler == a.meta.state.scheduler
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(tmp_path / "o"), str(tmp_path / "o.pt"))
    mine = torch.load(tmp_path / "o.pt", weights_only=False)
    theirs = torch.load(FIX / "torchtitan_w2" / "ref_torch_save.pt", weights_only=False)
    assert mine["dataloader"] == theirs["dataloader"] and mine["lr_scheduler"] == theirs["lr_scheduler"]
    assert (
        mine["train_state"]["global_avg_losses"].getvalue()
        == theirs["train_state"]["global_avg_losses"].getvalue()
    )
    assert zckpt.diff(tmp_path / "o", tmp_path / "o.pt", include_optimizer=True, progress=False).equal


def test_deepspeed_to_dcp_reads_back(tmp_path: Path) -> None:
    src = REPO / "fixtures" / "ds" / "s3_bf16_w3_sub_g2"
    zckpt.reshard(src, tmp_path / "o", world=2, to="dcp", progress=False)
    a, b = zckpt.open(src), zckpt.open(tmp_path / "o")
    _same(a, b)
    assert b.meta.state.optimizer.groups == a.meta.state.optimizer.groups  # type: ignore[union-attr]
    assert b.meta.step == a.meta.step and b.meta.state.scheduler == a.meta.state.scheduler


@pytest.mark.parametrize("to", ["native", "deepspeed"])
def test_engine_resumes_from_dcp_converted(tmp_path: Path, to: str) -> None:
    """DCP -> native / DeepSpeed ZeRO-3 at world 1: the engine's ``load_checkpoint`` restores every fp32
    master and Adam moment of torch's full state dicts (``ref_model`` / ``ref_optim``) and the step."""
    sys.path.insert(0, str(REPO / "fixtures"))
    import make_fixtures as mf

    import engine

    case = FIX / "fsdp2_w2"
    zckpt.reshard(case / "checkpoint", tmp_path / "o", world=1, to=to, stage=3, progress=False)
    spec = dict(mf.case("dcp", 3, "fp32", 1, groups=2, batch=4))
    torch.manual_seed(99)  # not the run's init: the load must overwrite everything
    model = mf.build_toy(spec["toy"])
    groups, _ = mf.param_groups(model, spec)
    opt = torch.optim.AdamW(groups, lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8)
    eng, _, _, _ = engine.initialize(model=model, optimizer=opt, config=mf.ds_config(spec))
    path, _ = eng.load_checkpoint(str(tmp_path / "o"))
    assert path is not None and eng.global_steps == _info(case)["steps"]
    ref, ropt = load_file(str(case / "ref_model.safetensors")), load_file(str(case / "ref_optim.safetensors"))
    inner = eng.optimizer.optimizer
    for s in (s for s in eng.states if s.trainable):
        sl = slice(s.start, s.start + s.valid)
        assert torch.equal(s.master[: s.valid].cpu(), ref[s.name].reshape(-1)[sl]), s.name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(
                inner.state[s.master][k][: s.valid].cpu(), ropt[f"{s.name}:{k}"].reshape(-1)[sl]
            )


def test_client_tensors_and_old_style_step_round_trip(tmp_path: Path) -> None:
    """A single-process ``dcp.save`` with a tensor in the train state (torchtitan's older int32 ``step``) and
    an optimizer ``step`` saved as a Python number: read, written back by ``--to dcp``, read again."""
    import torch.distributed.checkpoint as dcp

    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    sd = {
        "model": {"w": w, "b": torch.ones(3)},
        "optim": {
            "state": {"w": {"step": 7, "exp_avg": w * 2}},
            "param_groups": [{"lr": 0.1, "params": ["w"]}],
        },
        "train_state": {"step": torch.tensor(7, dtype=torch.int32), "tokens": 99},
    }
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(sd, checkpoint_id=str(tmp_path / "a"))
    a = zckpt.open(tmp_path / "a")
    assert a.meta.step == 7 and a.entries["w:step"].pytype == "int" and a.read("w:exp_avg").equal(w * 2)
    assert a.meta.state.optimizer.groups[0].params == ("w",)  # type: ignore[union-attr]
    zckpt.reshard(tmp_path / "a", tmp_path / "b", world=2, to="dcp", progress=False)
    b = zckpt.open(tmp_path / "b")
    assert b.read("w").equal(w) and b.read("w:step").item() == 7.0 and b.read("w:step").dtype == torch.float32
    ts = b.meta.state.client_state["train_state"]
    assert b.read(ts["step"]).dtype == torch.int32 and b.read(ts["step"]).item() == 7 and ts["tokens"] == 99


def test_random_damage_is_always_one_zckpt_error(tmp_path: Path) -> None:
    """Bits flipped, bytes zeroed, files cut, in .metadata and in .distcp files of several layouts: open (and
    reading every tensor) and verify raise nothing but one-line ``ZckptError``s."""
    import random

    from zckpt.errors import ZckptError
    from zckpt.storage import fileio

    rng = random.Random(20261203)
    cases = [
        "fsdp2_w2/checkpoint",
        "torchtitan_w2/checkpoint/step-3",
        "tp2d_w4/checkpoint",
        "stformat_w2/checkpoint",
    ]
    for it in range(12):
        d = tmp_path / f"c{it}"
        shutil.copytree(FIX / cases[it % len(cases)], d)
        f = rng.choice(sorted(p for p in d.iterdir() if p.is_file()))
        data = bytearray(f.read_bytes())
        i = rng.randrange(len(data))
        if it % 3 == 0:
            data[i] ^= 1 << rng.randrange(8)
        elif it % 3 == 1:
            data = data[:i]
        else:
            data[i : i + 64] = bytes(len(data[i : i + 64]))
        f.write_bytes(bytes(data))
        try:
            with zckpt.open(d) as ck:
                for k in ck.entries:
                    ck.read(k)
        except ZckptError as e:
            assert "\n" not in str(e)
        zckpt.verify(d)  # never raises on a damaged checkpoint: it reports
        fileio.close_files()


def test_one_file_of_a_dcp_folder_is_refused_naming_the_folder() -> None:
    from zckpt.errors import KeyMappingError

    d = FIX / "fsdp2_w2" / "checkpoint"
    for f in (d / "__0_0.distcp", d / ".metadata"):  # a .distcp file ends like a torch zip of its last item
        with pytest.raises(KeyMappingError, match="one file of a DCP checkpoint") as e:
            zckpt.open(f)
        assert str(d) in (e.value.hint or "")


def test_reshard_to_dcp_summary_has_no_zero_stage(tmp_path: Path) -> None:
    """A DCP output has no ZeRO stage: the summary said "dcp ZeRO-3" (issue 25); ``--stage`` is refused."""
    from typer.testing import CliRunner

    from zckpt.cli.app import app

    src = FIX / "fsdp2_w2" / "checkpoint"
    r = CliRunner().invoke(app, ["reshard", str(src), str(tmp_path / "o"), "--world", "3", "--to", "dcp"])
    assert r.exit_code == 0, r.output
    assert f"-> {tmp_path / 'o'} (dcp, world 3): " in r.stdout and "ZeRO" not in r.stdout  # and no tag
    assert zckpt.reshard(src, tmp_path / "j", world=2, to="dcp", progress=False).stage is None
    with pytest.raises(ValueError, match="a DCP checkpoint has no ZeRO stage"):
        zckpt.reshard(src, tmp_path / "s", world=2, to="dcp", stage=2, progress=False)


def _respec(md: Any) -> tuple[list[Any], list[str], Any, list[Any]]:
    from zckpt.formats.dcp import pickler as pk

    tensors = [
        pk.TensorSpec(k, t.dtype, t.shape, tuple((c.offsets, c.sizes) for c in t.chunks))
        for k, t in md.tensors.items()
    ]
    stored = [pk.Stored(k, off, si.file, si.offset, si.length) for (k, off), si in md.storage.items()]
    return tensors, sorted(md.byte_keys), md.paths, stored


def test_metadata_c_pickler_writes_the_pure_picklers_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``.metadata`` is written by the C pickler with the stand-ins' GLOBALs renamed afterwards; the bytes
    must be exactly those of the pure-Python ``MetadataPickler`` (the oracle that real torch reads), for
    every real fixture, and a key that spells a stand-in's GLOBAL must fall back to the pure pickler."""
    import torch.distributed.checkpoint.metadata as real

    from zckpt.formats.dcp import metadata as md_mod
    from zckpt.formats.dcp import pickler as pk

    def both(*args: Any) -> tuple[bytes, bytes]:
        fast = pk.dumps(*args, digests=["0" * 64])
        with monkeypatch.context() as m:
            m.setattr(pk, "_c_dumps", lambda md: None)
            slow = pk.dumps(*args, digests=["0" * 64])
        return fast, slow

    folders = [f for case in ALL for f in _dirs(case) if (f / ".metadata").is_file()]
    assert len(folders) >= len(READABLE)
    for folder in folders:
        md = md_mod.load_metadata(folder)
        fast, slow = both(*_respec(md))
        assert fast == slow, folder
        back = md_mod.build("x", md_mod.parse_bytes(fast, "x"))
        assert (set(back.keys), back.tensors, back.storage) == (set(md.keys), md.tensors, md.storage), folder
    tensors, byte_keys, paths, stored = _respec(md_mod.load_metadata(_dirs(FIX / "fsdp2_w2")[0]))
    odd = "w.zckpt.formats.dcp.metadata\nMetadata\n"  # a key spelling a stand-in's own GLOBAL
    t0 = tensors[0]
    tensors[0] = pk.TensorSpec(odd, t0.dtype, t0.shape, t0.boxes)
    stored = [pk.Stored(odd, s.offsets, s.file, s.offset, s.length) if s.key == t0.key else s for s in stored]
    paths = {(odd if k == t0.key else k): ((odd,) if k == t0.key else v) for k, v in paths.items()}
    fast, slow = both(tensors, byte_keys, paths, stored)
    assert fast == slow
    loaded = pickle.loads(fast)  # real torch's classes
    assert isinstance(loaded, real.Metadata) and odd in loaded.state_dict_metadata


def test_tensor_lr_is_read_as_its_groups_option_and_reshard_refuses_it(tmp_path: Path) -> None:
    """``torch.optim.Adam(lr=torch.tensor(...))`` (what torch recommends with a compiled optimizer): DCP saves
    the ``lr`` as a tensor item under ``param_groups``. It opened as an ``IndexError`` before; now it is the
    group's option (inspect, consolidate, verify read the checkpoint) and reshard refuses it in one line."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from _safety import assert_one_line_error, cli
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(m.parameters(), lr=torch.tensor(0.003))
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    assert isinstance(osd["param_groups"][0]["lr"], torch.Tensor)
    ck = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: "assuming ... a single process"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ck))

    with zckpt.open(ck) as c:
        assert c.meta.state.optimizer is not None
        lr = c.meta.state.optimizer.groups[0].options["lr"]
        assert c.read(lr).item() == torch.tensor(0.003).item()
        assert c.meta.state.optimizer.groups[0].options["betas"] == [0.9, 0.999]
    out = tmp_path / "m.safetensors"
    zckpt.consolidate(ck, out, progress=False)
    got = load_file(out)
    assert set(got) == set(m.state_dict()) and all(torch.equal(got[k], v) for k, v in m.state_dict().items())
    assert zckpt.verify(ck).ok
    for to in ("native", "dcp", "deepspeed"):
        r = cli("reshard", ck, tmp_path / to, "--world", "2", "--to", to, "--no-progress")
        assert r.code == 2
        assert_one_line_error(r, "param group 0's option 'lr' is a tensor", str(ck))
        assert not (tmp_path / to).exists()
