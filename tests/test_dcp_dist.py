"""``zckpt reshard --to dcp`` loaded by real FSDP2 (``fully_shard`` on gloo ranks) through torchtitan's way:
``dcp.load`` of ``{<model keys>, "optimizer": <flattened optimizer state dict>}`` then
``set_model_state_dict`` / ``set_optimizer_state_dict``.

Oracles, none of them zckpt's own output:
- DeepSpeed ZeRO-2/3 fixtures (``fixtures/ds/s2_*``, ``s3_*``) written at world 2, loaded at world 3: every
  trainable param equals DeepSpeed's fp32 master, frozen params / buffers / Adam moments equal the live
  engine's (``ref_fp32.safetensors``) bit for bit, ``step`` is the applied step count; the next step's loss
  and weights equal a single-process plain-PyTorch AdamW step from those states (fp32, within 1e-5).
- DCP fixtures resharded by zckpt to another world size, resumed as the fixture generator resumed the
  original (same world, same fresh init, same batch): loss and weights equal the fixture's resume oracle
  (``resume.loss``, ``ref_next_step.safetensors``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run
from safetensors.torch import load_file, save_file

import zckpt

pytestmark = pytest.mark.dist
REPO = Path(__file__).resolve().parents[1]
DS = REPO / "fixtures" / "ds"
DCP = REPO / "fixtures" / "dcp"
DS_CASES = sorted(p.name for p in DS.glob("s[23]_*") if (p / "case.json").is_file())
ROWS, SEED = 6, 4242  # the next step's global batch: 6 rows, 2 per rank at world 3
# DCP fixture -> world it is resharded to (the resume runs at the fixture's own resume world)
RESHARD_W3 = {"fsdp2_w2": 4, "torchtitan_w2": 1, "tp2d_w4": 2, "tp_w2": 5, "fsdp1_w2": 3, "accelerate_w2": 4,
              "model_only_w2": 1, "fsdp2_mp_w2": 3, "perfile_w2": 2}  # fmt: skip
RESHARD_W2 = {"fsdp2_bf16_w3": 2, "hsdp_w4": 3, "fsdp2_w3": 1, "fsdp2_w1": 4}


HELDOUT = os.environ.get("ZCKPT_DCP_HELDOUT")


def _case_dir(case: str) -> Path:
    """A committed fixture, or a held-out case (``make_dcp_heldout.py DIR``, ``ZCKPT_DCP_HELDOUT=DIR``)."""
    return Path(HELDOUT) / case if HELDOUT and case.startswith("h_") else DCP / case


def _mdf() -> Any:
    sys.path.insert(0, str(REPO / "fixtures"))
    import make_dcp_fixtures

    return make_dcp_fixtures


def _batch(vocab: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, vocab, (ROWS, seq), generator=g), torch.randint(
        0, vocab, (ROWS, seq), generator=g
    )


def _groups(model: torch.nn.Module, info: dict[str, Any]) -> list[dict[str, Any]]:
    gof = info["param_group_of"]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    n_groups = max(gof.values()) + 1
    return [
        {
            "params": [p for n, p in named if gof[n] == g],
            "weight_decay": 0.1 if n_groups > 1 and g == 0 else 0.0,
        }
        for g in range(n_groups)
    ]


def _plain_next_step(case: str, dcp_dir: Path, out: Path) -> None:
    """DeepSpeed's states (ref_fp32) in a plain toy + torch AdamW (options as the checkpoint records them):
    one step on the whole batch; loss and weights saved for the ranks to compare with."""
    mdf, info = _mdf(), json.loads((DS / case / "case.json").read_text())
    ref = load_file(str(DS / case / "ref_fp32.safetensors"))
    model = mdf.build_toy(mdf.TOY_DEFAULT)
    sd = {k: ref[info["tied"].get(k, k)] for k in model.state_dict()}
    sd = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}
    model.load_state_dict(sd)
    ck = zckpt.open(dcp_dir)
    opt = torch.optim.AdamW(_groups(model, info))
    for g, pg in zip(opt.param_groups, ck.meta.state.optimizer.groups, strict=True):  # type: ignore[union-attr]
        g.update({k: tuple(v) if k == "betas" else v for k, v in pg.options.items()})
    names = {id(p): n for n, p in model.named_parameters()}
    for g in opt.param_groups:
        for p in g["params"]:
            n = names[id(p)]
            step = ck.read(f"{n}:step", torch.float32).reshape(())
            moments = {k: ref[f"{n}:{k}"].clone() for k in ("exp_avg", "exp_avg_sq")}
            opt.state[p] = {"step": step, **moments}
    ids, tgt = _batch(mdf.TOY_DEFAULT["vocab"], mdf.TOY_DEFAULT["seq"])
    loss = model(ids, tgt)
    loss.backward()
    opt.step()
    weights = {
        k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "head.weight"
    }
    save_file(weights, str(out / f"{case}.next.safetensors"))
    (out / f"{case}.loss").write_text(repr(loss.item()))


def _load_tt(model: torch.nn.Module, opt: Any, path: str, with_optim: bool) -> None:
    """torchtitan's CheckpointManager.load for model + optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    msd = get_model_state_dict(model)
    states: dict[str, Any] = dict(msd)
    if with_optim:
        states["optimizer"] = _mdf().TTOptimizers(model, opt)
    dcp.load(states, checkpoint_id=path)
    set_model_state_dict(model, {k: states[k] for k in msd})


def _full(model: torch.nn.Module, opt: Any = None) -> tuple[dict[str, Any], Any]:
    return _mdf()._full_state(model, opt)


def _ds_rank(rank: int, world: int, case: str, root: Path) -> dict[str, Any]:
    import torch.distributed as dist

    mdf, info = _mdf(), json.loads((DS / case / "case.json").read_text())
    spec = mdf.case(case, world, resume_world=world, batch=ROWS)
    torch.manual_seed(777)  # a fresh init unlike DeepSpeed's: the load must overwrite everything
    model, _, _, _ = mdf.parallelize(mdf.build_toy(mdf.TOY_DEFAULT), spec, "fsdp2", world, rank)
    opt = torch.optim.AdamW(_groups(model, info), lr=1e-3, betas=(0.5, 0.5), eps=1e-5)
    _load_tt(model, opt, str(root / case), True)
    msd, osd = _full(model, opt)
    bad: list[str] = []
    if rank == 0:
        ref = load_file(str(DS / case / "ref_fp32.safetensors"))
        for k, want in ref.items():
            name, _, st = k.partition(":")
            got = osd["state"][name][st] if st else msd[k]
            if not torch.equal(got.to(want.dtype), want) or (
                not st and not torch.equal(got, want.to(got.dtype))
            ):
                bad.append(k)
        steps = {float(s["step"]) for s in osd["state"].values()}
        if steps != {float(info["global_steps"] - info["skipped_steps"])}:
            bad.append(f"step {steps}")
    ids, tgt = _batch(mdf.TOY_DEFAULT["vocab"], mdf.TOY_DEFAULT["seq"])
    n = ROWS // world
    local = model(ids[rank * n : (rank + 1) * n], tgt[rank * n : (rank + 1) * n])
    local.backward()
    opt.step()
    t = local.detach().clone()
    dist.all_reduce(t)
    loss = float(t) / world
    nsd, _ = _full(model)
    out: dict[str, Any] = {"bad": bad}
    if rank == 0:
        want = load_file(str(root / f"{case}.next.safetensors"))
        out["loss_diff"] = abs(loss - float((root / f"{case}.loss").read_text()))
        out["weight_diff"] = max(
            (nsd[k] - v).abs().max().item() for k, v in want.items() if v.is_floating_point()
        )
    return out


def _prepare_ds(tmp_path: Path, cases: list[str]) -> None:
    assert cases and all((DS / c / "case.json").is_file() for c in cases), "DeepSpeed fixtures missing"
    for case in cases:
        zckpt.reshard(DS / case, tmp_path / case, world=2, to="dcp", progress=False)
        _plain_next_step(case, tmp_path / case, tmp_path)


def _check_ds(got: dict[str, Any]) -> None:
    for case, r in got.items():
        print(f"{case}: loss diff {r['loss_diff']:.3g}, weight diff {r['weight_diff']:.3g}")
        assert r["bad"] == [], (case, r["bad"])
        assert r["loss_diff"] <= 1e-5 and r["weight_diff"] <= 1e-5, (case, r)


# ---- DCP fixtures resharded by zckpt resume like the originals --------------------------------------
def _resume_rank(rank: int, world: int, case: str, path: Path) -> dict[str, Any]:
    mdf = _mdf()
    info = json.loads((_case_dir(case) / "case.json").read_text())
    bf16 = "bfloat16" in info["dtypes"]["params_and_optimizer_state"]
    mp = "bf16" if info["dtypes"]["mixed_precision"] else None
    opt = info["optimizer"]
    warmup = int(opt["scheduler"].split("warmup=")[1].split(")")[0])
    kw = {"seed": info["seed"], "steps": info["steps"], "mp": mp, "dtype": "bf16" if bf16 else None,
          "toy": info["toy_dims"], "batch": info["batch"]["global_rows"], "lr": opt["lr"],
          "warmup": warmup}  # fmt: skip
    spec = mdf.case(case, info["world"], resume_world=world, **kw)
    torch.manual_seed(spec["seed"] + 777)  # the generator's resume init (attempt 0)
    model, dp_rank, dp_size, _ = mdf.parallelize(mdf.build_model(spec), spec, "fsdp2", world, rank)
    opt, sched = mdf.make_optim(model, spec)
    with_optim = info["layout"] not in ("model_only", "hf")
    _load_tt(model, opt, str(path), with_optim)
    loss = mdf.train_step(model, opt, sched, spec, spec["steps"], dp_rank, dp_size, world)
    nsd, _ = _full(model)
    if rank != 0:
        return {}
    want = load_file(str(_case_dir(case) / "ref_next_step.safetensors"))
    return {
        "loss_diff": abs(loss - info["resume"]["loss"]),
        "weight_diff": max((nsd[k].float() - v.float()).abs().max().item() for k, v in want.items()),
    }


def _ranks(rank: int, world: int, root: str, ds: list[str], dcp: list[str]) -> dict[str, Any]:
    """One spawn: the DeepSpeed conversions ``ds`` and the resharded DCP fixtures ``dcp``."""
    r = Path(root)
    return {
        "ds": {c: _ds_rank(rank, world, c, r) for c in ds},
        "dcp": {c: _resume_rank(rank, world, c, r / c) for c in dcp},
    }


def _prepare_dcp(tmp_path: Path, plan: dict[str, int], world: int) -> None:
    for case, w in plan.items():
        info = json.loads((_case_dir(case) / "case.json").read_text())
        assert info["resume"]["world"] == world
        src = _case_dir(case) / info["dcp_dirs"][0]
        assert zckpt.reshard(src, tmp_path / case, world=w, to="dcp", progress=False).world == w


def _check_dcp(got: dict[str, Any]) -> None:
    for case, r in got.items():
        print(f"{case}: loss diff {r['loss_diff']:.3g}, weight diff {r['weight_diff']:.3g}")
        assert r["loss_diff"] <= 1e-6 and r["weight_diff"] <= 1e-6, (case, r)


@pytest.mark.slow
def test_deepspeed_and_resharded_dcp_load_into_fsdp2(tmp_path: Path) -> None:
    """The quick version (one spawn at world 3): a DeepSpeed ZeRO-3 bf16 fixture with sub-groups and two
    param groups; torchtitan's own layout and a 2-D (FSDP x TP) mesh, resharded to other world sizes."""
    ds, plan = ["s3_bf16_w3_sub_g2"], {"torchtitan_w2": 1, "tp2d_w4": 2}
    _prepare_ds(tmp_path, ds)
    _prepare_dcp(tmp_path, plan, 3)
    got = run(_ranks, 3, str(tmp_path), ds, list(plan))[0]
    _check_ds(got["ds"])
    _check_dcp(got["dcp"])


@pytest.mark.slow
def test_every_deepspeed_zero23_fixture_loads_into_fsdp2(tmp_path: Path) -> None:
    _prepare_ds(tmp_path, DS_CASES)
    _check_ds(run(_ranks, 3, str(tmp_path), DS_CASES, [])[0]["ds"])


@pytest.mark.slow
@pytest.mark.parametrize("world,plan", [(3, RESHARD_W3), (2, RESHARD_W2)], ids=["world3", "world2"])
def test_resharded_dcp_fixtures_resume_like_the_originals(
    tmp_path: Path, world: int, plan: dict[str, int]
) -> None:
    _prepare_dcp(tmp_path, plan, world)
    _check_dcp(run(_ranks, world, str(tmp_path), [], list(plan))[0]["dcp"])


@pytest.mark.slow
@pytest.mark.heldout(
    "ZCKPT_DCP_HELDOUT"
)  # the folder fixtures/make_dcp_heldout.py wrote; deselected without it
def test_heldout_dcp_resharded_resume_like_the_originals(tmp_path: Path) -> None:
    """Every held-out case with a resume oracle (not model-only HF), resharded to world 1 or 2, resumed by the
    generator's recipe at its resume world; one spawn per resume world."""
    by_world: dict[int, dict[str, int]] = {}
    for d in sorted(Path(str(HELDOUT)).glob("h_*/case.json")):
        info = json.loads(d.read_text())
        if info.get("resume") and info["layout"] != "hf":
            w = 1 if info["world"] != 1 else 2
            by_world.setdefault(info["resume"]["world"], {})[d.parent.name] = w
    assert by_world
    for world, plan in sorted(by_world.items()):
        _prepare_dcp(tmp_path / str(world), plan, world)
        _check_dcp(run(_ranks, world, str(tmp_path / str(world)), [], list(plan))[0]["dcp"])


# ---- reshard --to dcp split over processes ----------------------------------------------------------
def _split(rank: int, world: int, root: str) -> dict[str, Any]:
    src = DCP / "torchtitan_w2" / "checkpoint"
    res = zckpt.reshard(src, Path(root) / "dist", world=5, to="dcp", progress=False, distributed=True)
    return {"files": res.files}


def test_reshard_to_dcp_split_over_processes(tmp_path: Path) -> None:
    """Three processes write a world-5 DCP checkpoint (rank files 0,3 / 1,4 / 2): every ``.distcp`` file is
    byte-identical to the one-process output and the published folder reads back the same."""
    src = DCP / "torchtitan_w2" / "checkpoint"
    zckpt.reshard(src, tmp_path / "one", world=5, to="dcp", progress=False)
    got = run(_split, 3, str(tmp_path))
    one, dist = tmp_path / "one", tmp_path / "dist"
    assert all(g["files"] == got[0]["files"] for g in got)
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in dist.iterdir()) and not any(
        ".zckpt-" in p.name for p in tmp_path.iterdir()
    )
    for n in names:  # .metadata too: its save_id is derived from the content, not drawn at random
        assert (one / n).read_bytes() == (dist / n).read_bytes(), n
    a, b = zckpt.open(one), zckpt.open(dist)
    assert set(a.entries) == set(b.entries) and all(a.read(k).equal(b.read(k)) for k in a.entries)
    assert a.meta.extra["values"] == b.meta.extra["values"] and zckpt.verify(dist).ok
