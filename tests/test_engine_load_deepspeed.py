"""The engine's ``load_checkpoint`` on real DeepSpeed ZeRO-1/2/3 checkpoints (``fixtures/ds``), directly, at
world sizes other than the one they were saved at, and into other stages and precisions.

Oracles (none of them the loader's own output):
- DeepSpeed's gathered fp32 masters and Adam moments (``ref_fp32.safetensors``, written by the live DeepSpeed
  engine): every rank's master / ``exp_avg`` / ``exp_avg_sq`` chunk must equal the matching slice bit for bit,
  padding zero; Adam's ``step`` must be the number of applied steps (``global_steps - skipped_steps``);
- ``case.json`` (what the generator recorded): step counters, client_state; DeepSpeed's WarmupLR semantics
  (stepped once per applied step from -1) for the scheduler;
- a single-process plain-PyTorch continuation (the fixture's toy model, fp32, torch AdamW whose state is
  DeepSpeed's reference moments, ``clip_grad_norm_``, DeepSpeed's WarmupLR formula) over the same global
  batch: the engine's next losses must follow it within 1e-6 relative (fp32 engines).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _fixtures import fixture
from safetensors.torch import load_file

from zckpt.model import TensorEntry

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "fixtures" / "ds"
GLOBAL_BATCH, MORE_STEPS = 4, 2

# (fixture, engine stage at world 1, engine stage at world 2, engine precision): ZeRO-1 world 3, ZeRO-2
# world 2 with two param groups, ZeRO-3 world 3 with sub-groups (fp32, bf16); engine stages differ on purpose.
CASES = [
    ("s1_fp32_w3_offopt", 1, 3, "fp32"),
    ("s2_fp32_w2_g2", 3, 2, "fp32"),
    ("s3_fp32_w3_offall_sub_g2", 2, 3, "fp32"),
    ("s3_bf16_w3_sub_g2", 3, 3, "bf16"),
]
for _c, *_ in CASES:
    fixture("ds", _c, "case.json")


def _mf() -> Any:
    sys.path.insert(0, str(REPO / "fixtures"))
    import make_fixtures

    return make_fixtures


def _info(case: str) -> dict[str, Any]:
    info: dict[str, Any] = json.loads((FIX / case / "case.json").read_text())
    return info


def _spec(case: str, stage: int, precision: str, world: int) -> dict[str, Any]:
    info = _info(case)
    return dict(_mf().case(case, stage, precision, world, groups=info["groups"], batch=GLOBAL_BATCH // world))


def _batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + k)
    toy = _mf().TOY_DEFAULT
    x = torch.randint(0, toy["vocab"], (GLOBAL_BATCH, toy["seq"]), generator=g)
    y = torch.randint(0, toy["vocab"], (GLOBAL_BATCH, toy["seq"]), generator=g)
    return x, y


def _warmup_lr(it: int, spec: dict[str, Any]) -> float:
    """DeepSpeed WarmupLR, default ``log`` warm-up, at scheduler iteration ``it``."""
    p = _mf().ds_config(spec)["scheduler"]["params"]
    lo, hi, n = p["warmup_min_lr"], p["warmup_max_lr"], p["warmup_num_steps"]
    gamma = math.log(it + 1) / math.log(n) if it < n else 1.0
    return float(lo + (hi - lo) * gamma)


def _engine(case: str, stage: int, precision: str, world: int) -> Any:
    import engine

    mf, spec = _mf(), _spec(case, stage, precision, world)
    torch.manual_seed(99)  # different initial values than DeepSpeed's run: the load must overwrite them all
    model = mf.build_toy(spec["toy"])
    groups, _ = mf.param_groups(model, spec)
    opt = torch.optim.AdamW(groups, lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8)
    eng, _, _, _ = engine.initialize(model=model, optimizer=opt, config=mf.ds_config(spec))
    return eng


def ds_return(tag_dir: Path, stage: int, rank: int) -> tuple[str, dict[str, Any]]:
    """What DeepSpeed 0.19.8's ``load_checkpoint`` returns for this fixture (the oracle): the model-states
    file's path and its top-level keys less those a default load consumes
    (``DeepSpeedEngine._load_checkpoint``), read with ``weights_only`` from the file DeepSpeed wrote."""
    name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    top = torch.load(tag_dir / name, map_location="cpu", weights_only=True)
    consumed = {"module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler"}
    consumed |= {"random_ltd", "lr_scheduler", "optimizer"}
    return str(tag_dir / name), {k: v for k, v in top.items() if k not in consumed}


def _shapes(v: Any) -> Any:
    """name -> shape (param_shapes' groups merged: a stage-3 source orders them by its sub-groups)."""
    if isinstance(v, list):
        return {k: x for g in v for k, x in _shapes(g).items()}
    return None if v is None else {k: tuple(x) for k, x in v.items()}


def _check_loaded(eng: Any, case: str, path: str | None, client: Any) -> list[str]:
    """Everything restored, against DeepSpeed's references; the list of what is wrong (empty: all good)."""
    import engine

    info = _info(case)
    ref = load_file(str(FIX / case / "ref_fp32.safetensors"))
    bad: list[str] = []
    want_path, want_client = ds_return(FIX / case / info["tag"], info["stage"], eng.comm.rank % info["world"])
    if path != want_path:
        bad.append(f"path {path}")
    if client is None or list(client) != list(want_client):
        got_keys = None if client is None else list(client)
        bad.append(f"client_state keys {got_keys}, DeepSpeed's {list(want_client)}")
    elif {k: client[k] for k in info["client_state"]} != info["client_state"]:
        bad.append(f"client_state {client}")
    else:
        for k in ("global_samples", "ds_config", "ds_version", "shared_params", "buffer_names"):
            if k in want_client and client[k] != want_client[k]:
                bad.append(f"client_state[{k!r}] {client[k]!r}, DeepSpeed's {want_client[k]!r}")
        for k in ("param_shapes", "frozen_param_shapes"):
            if k in want_client and _shapes(client[k]) != _shapes(want_client[k]):
                bad.append(f"client_state[{k!r}] {client[k]!r}, DeepSpeed's {want_client[k]!r}")
    applied = info["global_steps"] - info["skipped_steps"]
    if (eng.global_steps, eng.skipped_steps) != (info["global_steps"], info["skipped_steps"]):
        bad.append(f"counters {eng.global_steps} {eng.skipped_steps}")
    if (
        eng.global_samples
        != info["global_steps"] * info["world"] * info["ds_config"]["train_micro_batch_size_per_gpu"]
    ):
        bad.append(f"global_samples {eng.global_samples}")
    if eng.lr_scheduler.last_batch_iteration != applied - 1:
        bad.append(f"scheduler at {eng.lr_scheduler.last_batch_iteration}")
    inner = eng.optimizer.optimizer
    for s in eng.states:
        if not s.trainable:
            continue
        for key, got in [(s.name, s.master)] + [
            (f"{s.name}:{k}", inner.state[s.master][k]) for k in ("exp_avg", "exp_avg_sq")
        ]:
            want = ref[key].reshape(-1)[s.start : s.start + s.valid]
            if got.dtype != torch.float32 or not torch.equal(got[: s.valid].cpu(), want):
                bad.append(f"{key} chunk differs")
            if got[s.valid :].count_nonzero():
                bad.append(f"{key} padding not zero")
        step = inner.state[s.master]["step"]
        if not (isinstance(step, torch.Tensor) and step.dtype == torch.float32 and step.item() == applied):
            bad.append(f"{s.name}:step {step!r}")
    if eng.get_lr() != [pytest.approx(_warmup_lr(applied - 1, _spec(case, 1, "fp32", 1)))] * len(
        inner.param_groups
    ):
        bad.append(f"lr {eng.get_lr()}")
    with engine.zero.GatheredParameters(list(eng.module.parameters())):
        sd = {k: v.detach().float().cpu().clone() for k, v in eng.module.state_dict().items()}
    for k, t in ref.items():
        if ":" in k:
            continue
        exact = eng.dtype == torch.float32 or t.dtype == eng.dtype
        if exact and not torch.equal(sd[k], t.float()):
            bad.append(f"model {k} differs")
    if not torch.equal(sd["head.weight"], sd["emb.weight"]):
        bad.append("tied head.weight is not emb.weight")
    return bad


def _continue(eng: Any, rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    applied = eng.global_steps - eng.skipped_steps
    mb = GLOBAL_BATCH // world
    losses = []
    for k in range(applied, applied + MORE_STEPS):
        x, y = (t[rank * mb : (rank + 1) * mb].to(eng.device) for t in _batch(k))
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        total = loss.detach().float()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _reference(case: str) -> list[float]:
    """Plain PyTorch from DeepSpeed's fp32 masters and moments: the fixture's toy model, torch AdamW, the
    fixture's clipping and WarmupLR, over the same global batches."""
    mf, info = _mf(), _info(case)
    spec = _spec(case, 1, "fp32", 1)
    ref = load_file(str(FIX / case / "ref_fp32.safetensors"))
    model = mf.build_toy(spec["toy"])
    with torch.no_grad():
        for n, t in model.state_dict().items():
            if n not in _info(case)["tied"]:
                t.copy_(ref[n].float())
    groups, _ = mf.param_groups(model, spec)
    opt = torch.optim.AdamW(groups, lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8)
    applied = info["global_steps"] - info["skipped_steps"]
    for n, p in model.named_parameters():
        if p.requires_grad:
            opt.state[p] = {
                "step": torch.tensor(float(applied)),
                "exp_avg": ref[f"{n}:exp_avg"].clone(),
                "exp_avg_sq": ref[f"{n}:exp_avg_sq"].clone(),
            }
    params = [p for p in model.parameters() if p.requires_grad]
    clip = mf.ds_config(spec)["gradient_clipping"]
    losses = []
    for k in range(applied, applied + MORE_STEPS):
        for g in opt.param_groups:
            g["lr"] = _warmup_lr(k - 1, spec)  # optimizer step k runs at the rate of scheduler iteration k-1
        loss = model(*_batch(k))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _assert_losses(got: list[float], want: list[float], precision: str, what: str) -> None:
    tol = 1e-6 if precision == "fp32" else 5e-3  # bf16: measured ~7e-4
    assert len(got) == len(want) == MORE_STEPS, what
    for x, y in zip(got, want, strict=True):
        assert abs(x - y) <= tol * abs(y), (what, got, want)


# ---- world 1 (in process) -------------------------------------------------------------------------
@pytest.mark.parametrize("case,stage", [(c, s1) for c, s1, _, _ in CASES])
def test_world1_loads_deepspeed_and_continues_like_plain_pytorch(case: str, stage: int) -> None:
    """Any DeepSpeed stage/world/precision into an fp32 engine at world 1: exact state, then 1e-6 losses."""
    eng = _engine(case, stage, "fp32", 1)
    path, client = eng.load_checkpoint(str(FIX / case))
    assert _check_loaded(eng, case, path, client) == []
    _assert_losses(_continue(eng, 0, 1), _reference(case), "fp32", case)


# ---- world 2 (one spawn for every case) -----------------------------------------------------------
def _reads_only_own_chunks(eng: Any, case: str, rank: int, world: int) -> list[str]:
    """Load with the byte-reading entry points recorded (``ReadPlan.add``, where the engine's load records its
    ranged reads, and zckpt's readers): partitioned tensors are read only over this rank's
    chunk ``[start, start + valid)``; whole tensors only for what every rank needs (scalars, buffers, and
    frozen params when the engine does not shard them)."""
    from engine.checkpoint.reads import ReadPlan
    from zckpt.partition import chunk_range
    from zckpt.stream import spans

    ranged: list[tuple[str, int, int, int]] = []
    whole: list[tuple[str, str, int]] = []
    real_range, real_whole, real_add = spans.read_range, spans.read_entry, ReadPlan.add

    def rec_add(self: ReadPlan, entry: TensorEntry, lo: int, hi: int, out: torch.Tensor) -> None:
        ranged.append((entry.key, entry.numel, lo, hi))
        real_add(self, entry, lo, hi, out)

    def rec_range(
        entry: TensorEntry,
        lo: int,
        hi: int,
        dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ranged.append((entry.key, entry.numel, lo, hi))
        return real_range(entry, lo, hi, dtype, out)

    def rec_whole(e: TensorEntry, dtype: torch.dtype | None = None) -> torch.Tensor:
        whole.append((e.key, e.role.value, e.numel))
        return real_whole(e, dtype)

    spans.read_range, spans.read_entry, ReadPlan.add = rec_range, rec_whole, rec_add  # type: ignore[method-assign]
    try:
        eng.load_checkpoint(str(FIX / case))
    finally:
        spans.read_range, spans.read_entry, ReadPlan.add = real_range, real_whole, real_add  # type: ignore[method-assign]
    bad = []
    for key, n, lo, hi in ranged:
        start, valid = chunk_range(n, world, rank)
        if (lo, hi) != (start, start + valid):
            bad.append(f"{key}: read [{lo}, {hi}), own chunk [{start}, {start + valid})")
    allowed = {"buffer"} | (set() if eng.stage == 3 else {"frozen"})
    bad += [f"{key}: read whole" for key, role, n in whole if n > 1 and role not in allowed]
    if len(ranged) < 3 * sum(s.trainable and s.valid > 0 for s in eng.states):  # master, exp_avg, exp_avg_sq
        bad.append(f"only {len(ranged)} ranged reads")
    return bad


def _world2(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case, _, stage, precision in CASES:
        eng = _engine(case, stage, precision, world)
        reads = _reads_only_own_chunks(eng, case, rank, world)
        eng = _engine(case, stage, precision, world)
        path, client = eng.load_checkpoint(str(FIX / case))
        bad = _check_loaded(eng, case, path, client) + reads
        out[case] = {"bad": bad, "losses": _continue(eng, rank, world)}
    return out


@pytest.mark.dist
def test_world2_loads_deepspeed_each_rank_its_partition() -> None:
    """DeepSpeed checkpoints saved at world 3 and 2 loaded by a world-2 engine (stages 2/3, fp32 and bf16):
    every rank reads only its own chunks, they equal DeepSpeed's references, and the continuation follows
    plain PyTorch."""
    from tests._dist import run

    results = run(_world2, 2)
    for case, _, _, precision in CASES:
        want = _reference(case)
        for r, res in enumerate(results):
            assert res[case]["bad"] == [], (case, r)
            assert res[case]["losses"] == results[0][case]["losses"], (case, r)
        _assert_losses(results[0][case]["losses"], want, precision, case)


# ---- errors and options ---------------------------------------------------------------------------
def _toy_engine(case: str, edit: Any = None, toy: dict[str, int] | None = None) -> Any:
    import engine

    mf, spec = _mf(), _spec(case, 3, "fp32", 1)
    model = mf.build_toy(toy or spec["toy"])
    if edit is not None:
        edit(model)
    groups, _ = mf.param_groups(model, spec)
    opt = torch.optim.AdamW(groups, lr=spec["lr"])
    return engine.initialize(model=model, optimizer=opt, config=mf.ds_config(spec))[0]


def test_strict_names_and_shapes() -> None:
    from engine.checkpoint import CheckpointMismatch

    case = "s2_fp32_w2_g2"
    src = str(FIX / case)

    def extra(m: torch.nn.Module) -> None:
        m.bonus = torch.nn.Parameter(torch.zeros(3))

    with pytest.raises(CheckpointMismatch, match=r"missing in the checkpoint: bonus"):
        _toy_engine(case, extra).load_checkpoint(src)

    def drop(m: torch.nn.Module) -> None:
        del m.pos

    with pytest.raises(CheckpointMismatch, match=r"not in the model: pos\.weight"):
        _toy_engine(case, drop).load_checkpoint(src)
    toy = {**_mf().TOY_DEFAULT, "hidden": 12}
    with pytest.raises(
        CheckpointMismatch, match=r"shape mismatch for fc1\.weight \(checkpoint \[11, 7\], model \[12, 7\]\)"
    ):
        _toy_engine(case, toy=toy).load_checkpoint(src)


def test_optimizer_groups_must_match_unless_not_loaded() -> None:
    import engine
    from engine.checkpoint import CheckpointMismatch

    case = "s2_fp32_w2_g2"  # two param groups in the checkpoint
    mf, spec = _mf(), _spec(case, 2, "fp32", 1)
    model = mf.build_toy(spec["toy"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec["lr"])
    eng = engine.initialize(model=model, optimizer=opt, config=mf.ds_config(spec))[0]
    with pytest.raises(CheckpointMismatch, match="2 optimizer param groups, the optimizer 1"):
        eng.load_checkpoint(str(FIX / case))
    _, client = eng.load_checkpoint(str(FIX / case), load_optimizer_states=False)
    assert {k: client[k] for k in ("note", "step")} == {"note": "hello", "step": 3} and eng.global_steps == 3
    # DeepSpeed returns the model states' ``optimizer`` (None under ZeRO) when it did not load it
    assert "optimizer" in client and client["optimizer"] is None
    ref = load_file(str(FIX / case / "ref_fp32.safetensors"))
    s = next(s for s in eng.states if s.name == "fc1.weight")
    assert s.master is not None and torch.equal(s.master, ref["fc1.weight"].reshape(-1))
    assert not eng.optimizer.optimizer.state


def test_nothing_to_load_and_explicit_tag(tmp_path: Path) -> None:
    case = "s3_fp32_w2"
    eng = _toy_engine(case)
    assert eng.load_checkpoint(str(tmp_path)) == (None, None)
    path, client = eng.load_checkpoint(str(FIX / case), tag="global_step3")
    want_path, want_client = ds_return(FIX / case / "global_step3", 3, 0)
    assert path == want_path and list(client) == list(want_client)
    assert {k: client[k] for k in ("note", "step")} == {"note": "hello", "step": 3}
    assert eng.load_checkpoint(str(FIX / case), tag="global_step9") == (None, None)
