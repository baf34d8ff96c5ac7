"""zckpt.ops.reshard: checkpoint-level round trips and layouts checked against DeepSpeed's own files.

Oracles: DeepSpeed's gathered fp32 masters and Adam moments (``ref_fp32.safetensors`` of each fixture, written
by the live engine), DeepSpeed's own per-rank metadata (an identity reshard must reproduce
``param_slice_mappings``, ``group_paddings``, partition lengths and sub-groups exactly), hand-computed chunks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _fixtures import ds_cases
from safetensors.torch import load_file

import zckpt
from zckpt.codecs.pickle_safe import TensorRef
from zckpt.codecs.torchzip import load_refs
from zckpt.errors import OutputExists, Unsupported
from zckpt.formats.deepspeed.layout import adjust_batch, zero3_sub_groups, zero12_layout
from zckpt.model import Role
from zckpt.ops.reshard import default_dst, reshard
from zckpt.state import RankRng
from zckpt.stream.flat import read_partition, read_range

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "fixtures" / "ds"


CASES = ds_cases(stages=(1, 2, 3), bf16_optimizer=False)
BF16_OPT_CASES = ds_cases(stages=(1, 2, 3), bf16_optimizer=True)


def _same_state(a: zckpt.Checkpoint, b: zckpt.Checkpoint) -> None:
    """The training states agree: optimizer, scheduler, loss scaler, counters, client state (by value)."""
    sa, sb = a.meta.state, b.meta.state
    assert sa.optimizer == sb.optimizer
    assert (sa.scheduler, sa.loss_scaler, sa.counters) == (sb.scheduler, sb.loss_scaler, sb.counters)
    assert _values(a, sa.client_state) == _values(b, sb.client_state)


def _values(ck: zckpt.Checkpoint, o: object) -> object:
    if isinstance(o, zckpt.TensorEntry):
        return ck.read(o).tolist()
    if isinstance(o, dict):
        return {k: _values(ck, v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_values(ck, v) for v in o]
    return o


def _assert_same(a: zckpt.Checkpoint, b: zckpt.Checkpoint, clip_grad: bool = True) -> None:
    assert set(a.entries) == set(b.entries)
    for k, e in a.entries.items():
        f = b.entries[k]
        assert (e.role, e.shape, e.dtype) == (f.role, f.shape, f.dtype), k
        x, y = a.read(k), b.read(k)
        assert torch.equal(x, y), k
    assert dict(a.meta.tied) == dict(b.meta.tied)
    assert a.meta.step == b.meta.step
    _same_state(a, b)
    clip = [c.meta.state.private("deepspeed").get("clip_grad") for c in (a, b)]
    assert clip[0] == clip[1] or not clip_grad


def _rng(ck: zckpt.Checkpoint, r: RankRng) -> tuple[object, object, dict[str, list[int]]]:
    return r.python, r.numpy, {k: ck.read(e).tolist() for k, e in r.torch.items()}


def _other_world(w: int) -> int:
    return {1: 3, 2: 3, 3: 2}.get(w, 2)


@pytest.mark.parametrize("case", CASES)
def test_deepspeed_roundtrip_every_fixture(case: str, tmp_path: Path) -> None:
    """DS -> DS at another world size and back: every entry (params, frozen, buffers, every optimizer
    state) bit-identical; resharded values equal DeepSpeed's own gathered masters and moments."""
    src = FIX / case
    info = json.loads((src / "case.json").read_text())
    w = _other_world(info["world"])
    r1 = reshard(src, tmp_path / "a", world=w, progress=False)
    assert r1.world == w and r1.stage == info["stage"]
    a, b = zckpt.open(src), zckpt.open(tmp_path / "a")
    assert b.meta.world_size == w and b.meta.stage == info["stage"]
    _assert_same(a, b)
    ref = load_file(str(src / "ref_fp32.safetensors"))
    for k, t in ref.items():
        if ":" in k or b.entry(k).role is Role.PARAM:
            assert torch.equal(b.read(k, torch.float32), t.float()), k
    reshard(tmp_path / "a", tmp_path / "b", world=info["world"], progress=False)
    _assert_same(a, zckpt.open(tmp_path / "b"))
    # DeepSpeed -> native (the engine resumes a DeepSpeed run) -> DeepSpeed again
    n = reshard(src, tmp_path / "n", world=w, to="native", progress=False)
    assert n.dst_format == "native" and n.stage == info["stage"]
    c = zckpt.open(tmp_path / "n")
    assert (
        c.meta.world_size == w and set(c.entries) == set(a.entries) and dict(c.meta.tied) == dict(a.meta.tied)
    )
    for k in a.entries:
        assert torch.equal(a.read(k), c.read(k)), k
    assert c.meta.state.client_state == info["client_state"] and c.meta.step == info["global_steps"]
    reshard(tmp_path / "n", tmp_path / "d", world=info["world"], to="deepspeed", progress=False)
    d = zckpt.open(tmp_path / "d")
    for k in a.entries:
        assert torch.equal(a.read(k), d.read(k)), k


@pytest.mark.parametrize("case", BF16_OPT_CASES)
def test_bf16_optimizer_to_native_and_refused_as_deepspeed(case: str, tmp_path: Path) -> None:
    src = FIX / case
    reshard(src, tmp_path / "n", world=3 if "_w2" in case else 2, to="native", progress=False)
    a, c = zckpt.open(src), zckpt.open(tmp_path / "n")
    assert set(c.entries) == set(a.entries)
    for k in a.entries:
        assert torch.equal(a.read(k), c.read(k)), k
    with pytest.raises(Unsupported, match="BF16_Optimizer"):
        reshard(src, tmp_path / "d", world=2, progress=False)
    assert not (tmp_path / "d").exists() and not list(tmp_path.glob(".d.*"))


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.startswith(("s1_fp16_w3", "s2_bf16_w3", "s3_fp16_w3"))]
)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_stage_change(case: str, stage: int, tmp_path: Path) -> None:
    src = FIX / case
    res = reshard(src, tmp_path / "o", world=2, stage=stage, progress=False)
    b = zckpt.open(tmp_path / "o")
    assert b.meta.stage == stage == res.stage and b.meta.world_size == 2
    a = zckpt.open(src)
    _assert_same(a, b, clip_grad=3 not in (stage, a.meta.stage))  # ZeRO-3 files keep no clip_grad


def _tensors(o: object, path: str = "") -> dict[str, TensorRef]:
    out: dict[str, TensorRef] = {}
    if isinstance(o, TensorRef):
        out[path] = o
    elif isinstance(o, dict):
        for k, v in o.items():
            out.update(_tensors(v, f"{path}/{k}"))
    elif isinstance(o, (list, tuple)):
        for i, v in enumerate(o):
            out.update(_tensors(v, f"{path}/{i}"))
    return out


def _strip(o: object) -> object:
    """Structure without tensors and with stand-ins as dicts (comparable)."""
    if isinstance(o, TensorRef):
        return ("tensor", tuple(o.shape), o.dtype)
    if isinstance(o, dict):
        return {k: _strip(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_strip(v) for v in o]
    if hasattr(o, "__dict__") and not isinstance(o, type):
        return (type(o).__name__, _strip(dict(vars(o))))
    return o


@pytest.mark.parametrize("case", [c for c in CASES if "_w1" not in c])
def test_identity_reshard_reproduces_deepspeed_files(case: str, tmp_path: Path) -> None:
    """Same world size: every file we write has DeepSpeed's structure, metadata and tensor shapes, and the
    same tensor values outside DeepSpeed's uninitialised padding."""
    src = FIX / case
    info = json.loads((src / "case.json").read_text())
    reshard(src, tmp_path / "o", world=info["world"], progress=False)
    td_src, td_out = src / info["tag"], tmp_path / "o" / info["tag"]
    names = sorted(p.name for p in td_src.glob("*.pt"))
    assert names == sorted(p.name for p in td_out.glob("*.pt"))
    for n in names:
        x, y = load_refs(str(td_src / n)), load_refs(str(td_out / n))
        sx, sy = _strip(x), _strip(y)
        assert sx == sy, n
        tx, ty = _tensors(x), _tensors(y)
        for k, rx in tx.items():
            vx, vy = rx.load(), ty[k].load()
            if info["stage"] == 3 and ("fp32_flat_groups" in k or "frozen_param_fragments" in k):
                continue  # padding holds uninitialised memory in DeepSpeed's files; values are checked above
            assert torch.equal(vx, vy), (n, k)


def test_zero12_layout_hand_computed() -> None:
    # 3 params (5, 1, 7) = 13 elements at world 3: align 6 -> 18, slices of 6
    lay = zero12_layout([5, 1, 7], 3)
    assert [r.partition_size for r in lay] == [6, 6, 6]
    assert [r.valid for r in lay] == [6, 6, 1]
    assert lay[0].runs == ((0, 0, 0, 5), (1, 0, 5, 1))
    assert lay[1].runs == ((2, 0, 0, 6),)
    assert lay[2].runs == ((2, 6, 0, 1),)
    # world larger than the group: trailing ranks hold only padding
    lay = zero12_layout([1], 4)
    assert [r.valid for r in lay] == [1, 0, 0, 0] and all(r.partition_size == 2 for r in lay)


def test_zero3_sub_groups_rule() -> None:
    # DeepSpeed cuts when the running sum of partition sizes reaches sub_group_size
    assert zero3_sub_groups([91, 35, 77, 77], 3, None) == [[0, 1, 2, 3]]
    assert zero3_sub_groups([91, 35, 77, 77], 3, 40) == [[0, 1], [2, 3]]
    assert zero3_sub_groups([91, 35, 77, 77], 1, 40) == [[0], [1, 2], [3]]  # 35 < 40: joins the next
    assert zero3_sub_groups([], 2, 10) == []


def test_adjust_batch_policy() -> None:
    cfg, note = adjust_batch({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 2, 3)
    assert cfg["train_micro_batch_size_per_gpu"] == 2  # global 12 kept; the change is a note
    assert note == (
        "ds_config: train_micro_batch_size_per_gpu 3 -> 2 keeps the global batch 12 "
        "(2 x gradient_accumulation_steps 2 x world 3)"
    )
    cfg, note = adjust_batch({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 6}, 2, 5)
    assert cfg == {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 6} and note
    cfg, note = adjust_batch({"train_batch_size": 24}, 4, 8)
    assert cfg == {"train_batch_size": 24} and note is None  # DeepSpeed derives micro = 24 / 8


def test_read_partition_any_layout(tmp_path: Path) -> None:
    from tests._handmade import make_ckpt

    t = torch.arange(23, dtype=torch.float32).reshape(23)
    ck = make_ckpt(tmp_path, {"w": t}, world=3)
    e = ck.entry("w")
    for world in range(1, 9):
        c = -(-23 // world)
        parts = [read_partition(e, world, r) for r in range(world)]
        assert all(p.numel() == c for p in parts)
        flat = torch.cat(parts)
        assert torch.equal(flat[:23], t) and not flat[23:].any()
    assert torch.equal(read_range(e, 5, 17, torch.float64), t[5:17].double())


@pytest.mark.slow
def test_cli_bare_form_writes_sibling(tmp_path: Path) -> None:
    case = next(c for c in CASES if c.startswith("s3_"))
    import shutil

    run_dir = tmp_path / "ckpt"
    shutil.copytree(FIX / case, run_dir)
    before = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    code = "from zckpt.cli.app import main; main()"
    p = subprocess.run(
        [sys.executable, "-c", code, "reshard", "--world", "5", "--no-progress"],
        cwd=run_dir,
        env=env,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    out = default_dst(run_dir, 5)
    assert out == tmp_path / "ckpt-world5" and (out / "latest").is_file()
    assert zckpt.open(out).meta.world_size == 5
    assert sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before
    with pytest.raises(OutputExists):
        reshard(run_dir, run_dir / "inside", world=2, progress=False)
    with pytest.raises(OutputExists):
        reshard(run_dir, out, world=2, progress=False)
    # from inside a tag folder: the output is the save folder's sibling, keeping the tag; nothing lands
    # in the save folder beside the other tags
    tag = (run_dir / "latest").read_text().strip()
    p = subprocess.run(
        [sys.executable, "-c", code, "reshard", "--world", "3", "--no-progress"],
        cwd=run_dir / tag,
        env=env,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    out3 = tmp_path / "ckpt-world3"
    assert (out3 / "latest").read_text().strip() == tag and zckpt.open(out3).meta.world_size == 3
    assert sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before


# ---- the engine: native checkpoints --------------------------------------------------------------
ENGINE_STEPS, SAVE_AT = 6, 3


def _engine_save_and_continue(rank: int, world: int, root: str) -> dict[str, object]:
    from tests._engine_ref import config, train

    out: dict[str, object] = {}
    for stage in (1, 2, 3):
        cfg = config(stage)
        eng, first = train(rank, world, cfg, SAVE_AT)
        eng.save_checkpoint(f"{root}/s{stage}", client_state={"world": world, "t": torch.arange(3)})
        _, rest = train(rank, world, cfg, ENGINE_STEPS - SAVE_AT, first=SAVE_AT, engine_=eng)
        out[f"s{stage}"] = first + rest
    return out


def _engine_resume(rank: int, world: int, root: str) -> dict[str, object]:
    from tests._engine_ref import config, make_model, train

    out: dict[str, object] = {}
    for stage in (1, 2, 3):
        cfg = config(stage)
        eng, _ = train(rank, world, cfg, 0, model=make_model(seed=11))
        _, client = eng.load_checkpoint(f"{root}/s{stage}-w{world}")
        assert client is not None
        _, rest = train(rank, world, cfg, ENGINE_STEPS - SAVE_AT, first=SAVE_AT, engine_=eng)
        out[f"s{stage}"] = {
            "rest": rest,
            "client": {"world": client["world"], "t": client["t"].tolist()},
            "steps": eng.global_steps,
        }
    return out


@pytest.mark.dist
def test_engine_world2_reshard_offline_to_3_resumes_like_uninterrupted(tmp_path: Path) -> None:
    """Train at world 2, save, ``zckpt reshard`` to 3 (and back to 2: bit-identical), resume at world 3:
    fp32 losses follow the uninterrupted world-2 run (same global batch) within 1e-5 relative."""
    from tests._dist import run

    root = str(tmp_path)
    full = run(_engine_save_and_continue, 2, root)[0]
    for stage in (1, 2, 3):
        src = tmp_path / f"s{stage}"
        res = reshard(src, tmp_path / f"s{stage}-w3", world=3, progress=False)
        assert res.src_format == res.dst_format == "native" and res.stage == stage
        back = reshard(tmp_path / f"s{stage}-w3", tmp_path / f"s{stage}-back", world=2, progress=False)
        a, b, c = (
            zckpt.open(src),
            zckpt.open(tmp_path / f"s{stage}-w3"),
            zckpt.open(tmp_path / f"s{stage}-back"),
        )
        assert b.meta.world_size == 3 and c.meta.world_size == 2 and back.world == 2
        for other in (b, c):
            assert set(other.entries) == set(a.entries)
            for k in a.entries:
                assert torch.equal(a.read(k), other.read(k)), (stage, k)
            assert dict(other.meta.tied) == dict(a.meta.tied)
            _same_state(a, other)
        # RNG: new rank r takes old rank r % old_world
        assert [_rng(b, r) for r in b.meta.state.rng] == [_rng(a, a.meta.state.rng[r % 2]) for r in range(3)]
    resumed = run(_engine_resume, 3, root)[0]
    for stage in (1, 2, 3):
        got = resumed[f"s{stage}"]
        assert got["client"] == {"world": 2, "t": [0, 1, 2]} and got["steps"] == ENGINE_STEPS
        want = full[f"s{stage}"][SAVE_AT:]
        for x, y in zip(got["rest"], want, strict=True):
            assert abs(x - y) <= 1e-5 * abs(y), (stage, got["rest"], want)


@pytest.mark.parametrize(
    "case", [c for c in ("s3_fp32_w2", "s2_fp32_w3_offopt", "s1_fp32_w3_offopt") if c in CASES]
)
def test_engine_resumes_deepspeed_run_resharded_to_native(case: str, tmp_path: Path) -> None:
    """DeepSpeed -> native at world 1: the engine's load_checkpoint restores DeepSpeed's masters, moments,
    step counters, scheduler and client state exactly (oracle: DeepSpeed's own gathered values)."""
    sys.path.insert(0, str(REPO / "fixtures"))
    import make_fixtures as mf

    import engine

    src = FIX / case
    info = json.loads((src / "case.json").read_text())
    reshard(src, tmp_path / "n", world=1, to="native", progress=False)
    spec = mf.case(case, info["stage"], "fp32", 1, groups=info["groups"], batch=2)
    torch.manual_seed(99)
    model = mf.build_toy(spec["toy"])
    groups, _ = mf.param_groups(model, spec)
    opt = torch.optim.AdamW(groups, lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8)
    eng, _, _, _ = engine.initialize(model=model, optimizer=opt, config=mf.ds_config(spec))
    _, client = eng.load_checkpoint(str(tmp_path / "n"))
    assert {k: client[k] for k in info["client_state"]} == info["client_state"]
    assert eng.global_steps == info["global_steps"]
    ref = load_file(str(src / "ref_fp32.safetensors"))
    inner = eng.optimizer.optimizer
    for s in eng.states:
        if s.trainable:
            assert torch.equal(s.master[: ref[s.name].numel()], ref[s.name].reshape(-1)), s.name
            for k in ("exp_avg", "exp_avg_sq"):
                got = inner.state[s.master][k]
                assert torch.equal(got[: ref[s.name].numel()], ref[f"{s.name}:{k}"].reshape(-1)), (s.name, k)
    with engine.zero.GatheredParameters(list(eng.module.parameters())):
        sd = eng.module.state_dict()
        for k, t in ref.items():
            if ":" not in k:
                assert torch.equal(sd[k].float(), t.float()), k
    assert eng.get_lr() == pytest.approx([spec["lr"]] * len(groups))


def test_native_manifest_refuses_a_tensor_valued_option() -> None:
    """A param-group option that is a tensor (a DCP item can hold one) is one clear refusal, not a
    ``TypeError`` from the JSON encoder (fuzz seed 41, case 37, before the overlap check caught it)."""
    from types import SimpleNamespace

    from zckpt.formats.native.write import optimizer_json
    from zckpt.model import Piece, TensorEntry
    from zckpt.state import OptimizerState, ParamGroup

    lr = TensorEntry(
        "client/lr", (), torch.float32, Role.BUFFER, (Piece("x.distcp", 0, torch.float32, 0, 1),)
    )
    plain = ParamGroup(("a",), {"lr": 0.1, "betas": [0.9, 0.99]})
    state = SimpleNamespace(optimizer=OptimizerState("torch", (plain, ParamGroup(("b",), {"lr": lr})), ()))
    with pytest.raises(Unsupported, match=r"param group 1's option 'lr' is a tensor \[\]"):
        optimizer_json(state)  # type: ignore[arg-type]
    ok = SimpleNamespace(optimizer=OptimizerState("torch", (plain,), ()))
    assert optimizer_json(ok) == {  # type: ignore[arg-type]
        "kind": "torch",
        "param_groups": [{"lr": 0.1, "betas": [0.9, 0.99], "params": ["a"]}],
        "state_names": [],
    }


@pytest.mark.parametrize("to", ["deepspeed", "native", "dcp"])
def test_progress_bar_ends_at_its_total(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, to: str) -> None:
    """Issue 40.4: the bar's total was an estimate of the bytes and the real files overshot it (``1.11GB
    [00:01]``, no percentage). It now counts rank units, known before writing, ends at exactly 100 %, and the
    bytes beside it are the rank files' real sizes."""
    import io
    import re

    import zckpt.ops.reshard as reshard_mod
    from zckpt.ops import progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    bars: list[object] = []
    screen = Terminal()

    def shown(total: int, desc: str, **kw: object) -> object:  # the real bar, drawn to a string
        bars.append(progress.bar(total, desc, **kw))  # type: ignore[arg-type]
        return bars[-1]

    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.setattr(reshard_mod, "progress_bar", shown)
    res = reshard(FIX / "s1_bf16_w2", tmp_path / "out", world=3, to=to)
    (b,) = bars
    assert b.total == 3 and b.n == b.total, (b.total, b.n)  # type: ignore[attr-defined]
    last = str(b)  # what the bar shows once every unit is written
    assert "100%" in last and "3/3" in last, last
    unit_file = re.compile(
        r"(optim_states\.pt|zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt|\.distcp|rank_\d+\.safetensors)$"
    )
    rank_files = sum((tmp_path / "out" / f).stat().st_size for f in res.files if unit_file.search(f))
    assert f"{progress.sized(rank_files)} written" in last, (last, res.files)


@pytest.mark.parametrize("to", ["deepspeed", "native"])
def test_tag_from_a_dcp_source_is_its_step(tmp_path: Path, to: str) -> None:
    """Issue 40.8: a DCP folder has no tag, and reshard named the output tag ``reshard`` though the source
    records step 3 (its fixture's ``case.json``: 3 steps). The tag is DeepSpeed's name for that step."""
    src = REPO / "fixtures" / "dcp" / "fsdp2_w2"
    steps = json.loads((src / "case.json").read_text())["steps"]
    res = reshard(src / "checkpoint", tmp_path / "out", world=3, to=to, progress=False)
    assert res.tag == f"global_step{steps}"
    assert (tmp_path / "out" / "latest").read_text().strip() == f"global_step{steps}"
    with zckpt.open(tmp_path / "out") as ck:
        assert (ck.meta.tag, ck.meta.step) == (f"global_step{steps}", steps)
