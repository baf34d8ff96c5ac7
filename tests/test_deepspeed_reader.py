"""DeepSpeed reader: hand-built ZeRO layouts from known tensors, real DeepSpeed fixtures, error cases.

Oracles: (1) full tensors chosen here, partitioned by an independent builder (written from the format
doc, not from the reader) and saved with torch.save under DeepSpeed's class names; (2) the fp32 masters
and Adam moments DeepSpeed gathered during training (``ref_fp32.safetensors``) and zero_to_fp32's output.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import shutil
import sys
import types
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from _fixtures import ds_cases

from zckpt.errors import ShardMismatch, UnknownFormat, ZckptError
from zckpt.formats import deepspeed as ds
from zckpt.model import Role
from zckpt.storage import fileio

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ds"


# ---- builder: DeepSpeed-layout files from known tensors -----------------------------------------------
class ZeroStageEnum(int, enum.Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class LossScaler:
    def __init__(self) -> None:
        self.cur_scale = 1.0
        self.dynamic = False


@dataclasses.dataclass
class fragment_address:  # noqa: N801
    numel: int
    start: int


_FAKE = {
    "deepspeed.runtime.zero.config": ZeroStageEnum,
    "deepspeed.runtime.fp16.loss_scaler": LossScaler,
    "deepspeed.utils.tensor_fragment": fragment_address,
}


@pytest.fixture
def fake_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let torch.save pickle the test classes under DeepSpeed's global names (test process only)."""
    for mod in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.zero", "deepspeed.runtime.fp16",
                "deepspeed.utils"):  # fmt: skip
        monkeypatch.setitem(sys.modules, mod, types.ModuleType(mod))
    for mod, cls in _FAKE.items():
        m = types.ModuleType(mod)
        setattr(m, cls.__name__, cls)
        monkeypatch.setitem(sys.modules, mod, m)
        monkeypatch.setattr(cls, "__module__", mod)


def _tensors(spec: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in spec.items()}


GROUPS: list[dict[str, tuple[int, ...]]] = [{"a": (7,), "b": (11,), "c": (13,)}, {"s": (1,), "d": (3, 5)}]
FROZEN: dict[str, tuple[int, ...]] = {"f.weight": (5,), "f.bias": (1,)}
TIED = {"alias.weight": "b"}
BUFFERS = {"ids": torch.arange(7, dtype=torch.int64), "scale": torch.linspace(0, 1, 3)}
GARBAGE = 12345.0  # written where padding lives; must never show up in a read tensor


def _module(params, frozen, dtype16, zero3, ws):
    mod = OrderedDict()
    for n, t in params.items():
        mod[n] = torch.empty(0, dtype=dtype16) if zero3 else t.to(dtype16)
    for n, t in frozen.items():
        mod[n] = torch.empty(0, dtype=dtype16) if zero3 else t.to(dtype16)
    for alias, owner in TIED.items():
        mod[alias] = mod[owner]
    mod.update(BUFFERS)
    return mod


def _common(tmp, stage, ws, params, frozen, dtype16, group_shapes, tag="global_step5"):
    td = tmp / tag
    td.mkdir(parents=True)
    (tmp / "latest").write_text(tag)
    return td, {
        "buffer_names": list(BUFFERS), "optimizer": None,
        "param_shapes": [OrderedDict((n, torch.Size(params[n].shape)) for n in g) for g in group_shapes],
        "shared_params": dict(TIED), "lr_scheduler": {"last_batch_iteration": 4}, "skipped_steps": 0,
        "global_steps": 5, "global_samples": 40, "dp_world_size": ws, "mp_world_size": 1,
        "ds_config": {"zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW"}},
        "ds_version": "0.19.8", "note": "client",
    }  # fmt: skip


def build_zero12(tmp: Path, stage: int, ws: int, *, bf16_optimizer: bool = False) -> dict[str, torch.Tensor]:
    """ZeRO-1/2 files (§4.1): per group, flat = cat(params), padded to a multiple of 2*ws, split evenly;
    fp32 partitions saved without their padding (BF16_Optimizer: with it, filled with garbage)."""
    params = _tensors({k: v for g in GROUPS for k, v in g.items()}, 1)
    moments = {n: t * 0.5 + 1 for n, t in params.items()}
    frozen = _tensors(FROZEN, 2)
    td, m = _common(tmp, stage, ws, params, frozen, torch.bfloat16, GROUPS)
    m["module"] = _module(params, frozen, torch.bfloat16, False, ws)
    m["frozen_param_shapes"] = OrderedDict((n, t.shape) for n, t in frozen.items()) if stage == 2 else None
    m["frozen_param_fragments"] = {n: t.bfloat16() for n, t in frozen.items()} if stage == 2 else None
    torch.save(m, td / "mp_rank_00_model_states.pt")
    for r in range(ws):
        fp32, pads, state, maps = [], [], {}, []
        for gi, g in enumerate(GROUPS):
            flat = torch.cat([params[n].reshape(-1) for n in g])
            mflat = torch.cat([moments[n].reshape(-1) for n in g])
            n_g = flat.numel()
            part = math.ceil(n_g / (2 * ws)) * 2 * ws // ws
            padded = torch.full((part * ws,), GARBAGE)
            padded[:n_g] = flat
            mpad = torch.zeros(part * ws)
            mpad[:n_g] = mflat
            lo, hi = r * part, (r + 1) * part
            pad = hi - max(lo, min(hi, n_g))
            fp32.append(padded[lo:hi].clone() if bf16_optimizer else padded[lo : hi - pad].clone())
            pads.append(pad)
            maps.append(OrderedDict())  # param_slice_mappings: each param's piece in this partition
            start = 0
            for n in g:
                a, b = max(start, lo), min(start + params[n].numel(), hi)
                if b > a:
                    maps[-1][n] = fragment_address(numel=b - a, start=a - lo)
                start += params[n].numel()
            state[gi] = {
                "step": torch.tensor(5.0),
                "exp_avg": mpad[lo:hi].clone(),
                "exp_avg_sq": mpad[lo:hi] ** 2,
            }
        osd = {
            "loss_scaler": LossScaler(), "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0,
            "base_optimizer_state": {"state": state, "param_groups": [
                {"lr": 0.1, "betas": (0.9, 0.95), "weight_decay": 0.0, "params": [gi]}
                for gi in range(len(GROUPS))]},
            "single_partition_of_fp32_groups": fp32, "zero_stage": ZeroStageEnum(stage),
            "group_paddings": pads, "partition_count": [ws] * len(GROUPS), "ds_version": "0.19.8",
            "param_slice_mappings": maps, "param_alignment_paddings": [[0] * len(g) for g in GROUPS],
        }  # fmt: skip
        if bf16_optimizer:
            for k in ("loss_scaler", "dynamic_loss_scale", "overflow", "zero_stage"):
                del osd[k]
            for k in ("param_alignment_paddings",):
                del osd[k]
        torch.save({"optimizer_state_dict": osd, "ds_config": m["ds_config"], "ds_version": "0.19.8"},
                   td / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")  # fmt: skip
    return {**params, **frozen, **BUFFERS, **{f"{n}:exp_avg": t for n, t in moments.items()},
            **{f"{n}:exp_avg_sq": t**2 for n, t in moments.items()}}  # fmt: skip


def build_zero3(tmp: Path, ws: int) -> dict[str, torch.Tensor]:
    """ZeRO-3 files (§4.2): each param split alone in ceil(n/ws) chunks (garbage padding); a sub-group's
    rank-r flat tensor = its params' rank-r chunks; frozen params likewise in 16-bit model files."""
    params = _tensors({k: v for g in GROUPS for k, v in g.items()}, 3)
    moments = {n: t - 2 for n, t in params.items()}
    frozen = _tensors(FROZEN, 4)

    def chunk(t: torch.Tensor, r: int, fill: float) -> torch.Tensor:
        c = math.ceil(t.numel() / ws)
        padded = torch.full((c * ws,), fill, dtype=t.dtype)
        padded[: t.numel()] = t.reshape(-1)
        return padded[r * c : (r + 1) * c]

    td, m0 = _common(tmp, 3, ws, params, frozen, torch.float16, GROUPS)
    for r in range(ws):
        m = dict(m0, shared_params=dict(TIED) if r == 0 else {})
        m["module"] = _module(params, frozen, torch.float16, True, ws)
        m["frozen_param_shapes"] = OrderedDict((n, t.shape) for n, t in frozen.items())
        m["frozen_param_fragments"] = {n: chunk(t.half(), r, GARBAGE).clone() for n, t in frozen.items()}
        torch.save(m, td / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        flats = [torch.cat([chunk(params[n], r, GARBAGE) for n in g]) for g in GROUPS]
        state = {s: {"step": torch.tensor(5.0), "exp_avg": torch.cat([chunk(moments[n], r, 0.0) for n in g])}
                 for s, g in enumerate(GROUPS)}  # fmt: skip
        osd = {
            "zero_stage": ZeroStageEnum(3), "loss_scaler": LossScaler(), "dynamic_loss_scale": False,
            "overflow": False, "partition_count": ws, "fp32_flat_groups": flats,
            "optimizer_state_dict": {"state": state, "param_groups": [
                {"lr": 0.1, "momentum": 0.9, "params": [0]}, {"lr": 0.2, "momentum": 0.9, "params": [1]}]},
        }  # fmt: skip
        torch.save({"optimizer_state_dict": osd}, td / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    return {**params, **frozen, **BUFFERS, **{f"{n}:exp_avg": t for n, t in moments.items()}}


def _check_against(ck, want: dict[str, torch.Tensor], frozen_dtype: torch.dtype) -> None:
    for name, t in want.items():
        e = ck.entry(name)
        if name in FROZEN:
            assert e.role is Role.FROZEN and e.dtype == frozen_dtype, name
            assert torch.equal(ck[name], t.to(frozen_dtype)), name
        elif name in BUFFERS:
            assert e.role is Role.BUFFER and torch.equal(ck[name], t) and ck[name].dtype == t.dtype, name
        else:
            assert e.dtype == torch.float32 and e.role is (Role.OPTIM if ":" in name else Role.PARAM), name
            assert torch.equal(ck.read(name), t), name
    assert torch.equal(ck["alias.weight"], want["b"])
    params = [k for k, e in ck.entries.items() if e.role is Role.PARAM]
    assert sorted(params) == sorted(n for g in GROUPS for n in g)
    assert ck.meta.tied == TIED and ck.meta.step == 5 and ck.meta.tag == "global_step5"
    assert ck.meta.state.client_state == {"note": "client"}
    json.dumps(ck.meta.to_json())


@pytest.mark.parametrize("stage,ws,bf16_opt", [(1, 2, False), (2, 3, False), (1, 3, True), (2, 1, False)])
def test_zero12_handmade(tmp_path, fake_deepspeed, stage, ws, bf16_opt):
    want = build_zero12(tmp_path, stage, ws, bf16_optimizer=bf16_opt)
    ck = ds.read(tmp_path)
    m = ck.meta
    assert (m.stage, m.world_size, m.precision, m.extra["bf16_optimizer"]) == (stage, ws, "bf16", bf16_opt)
    _check_against(ck, want, torch.bfloat16)
    step = ck.entry("c:step")
    assert step.shape == () and ck.read("c:step").item() == 5.0
    assert m.optimizer is not None and m.optimizer.kind == "AdamW"
    assert m.optimizer.groups[1].params == ("s", "d")
    assert set(m.optimizer.state_names) == {"step", "exp_avg", "exp_avg_sq"}
    g0 = m.extra["param_groups"][0]
    assert g0["params"] == ["a", "b", "c"] and g0["numel"] == 31 and g0["partition_size"] * ws >= 31
    # b = flat [7, 18) straddles the rank boundary (16 for ws=2, 12 for ws=3)
    assert [p.rank for p in ck.entry("b").pieces] == ([0] if ws == 1 else [0, 1])


@pytest.mark.parametrize("ws", [2, 3])
def test_zero3_handmade(tmp_path, fake_deepspeed, ws):
    want = build_zero3(tmp_path, ws)
    ck = ds.read(tmp_path / "global_step5")  # the tag folder itself is accepted
    assert (ck.meta.stage, ck.meta.world_size, ck.meta.precision) == (3, ws, "fp16")
    assert ck.meta.save_dir == str(tmp_path) and ck.meta.path == str(tmp_path / "global_step5")
    _check_against(ck, want, torch.float16)
    assert ck.meta.optimizer is not None and ck.meta.optimizer.kind == "AdamW"  # from ds_config
    assert ck.meta.extra["sub_groups"][1]["params"] == ["s", "d"]
    e = ck.entry("a")  # 7 over ws ranks: chunks of ceil(7/ws), padding on the last
    assert [p.numel for p in e.pieces] == ([4, 3] if ws == 2 else [3, 3, 1])
    assert e.pieces[-1].padding == (1 if ws == 2 else 2)


# ---- metadata only: no tensor bytes read; weights never touch optimizer-state bytes --------------------
def test_read_touches_no_tensor_bytes(tmp_path, fake_deepspeed, monkeypatch):
    """Opening reads pickles and headers only; the one exception is each optimizer file's 0-d ``step``
    (a few bytes per rank file), compared across ranks to catch a rank file of another save."""
    build_zero12(tmp_path, 2, 3)
    fileio.close_files()

    real_read = fileio.read_into

    def scalars_only(path, offset, out):
        if out.numel() != 1:
            raise AssertionError(f"read {out.numel()} tensor elements while reading metadata")
        return real_read(path, offset, out)

    with monkeypatch.context() as mp:
        mp.setattr(fileio, "read_into", scalars_only)
        ck = ds.read(tmp_path)
    sizes = {f: Path(f).stat().st_size for f in ck.meta.files}
    for e in ck.entries.values():
        for p in e.pieces:
            assert p.value is not None or 0 <= p.byte_offset <= p.byte_offset + p.nbytes <= sizes[p.file]
    _weights_skip_optimizer_bytes(ck, monkeypatch)


def _weights_skip_optimizer_bytes(ck, monkeypatch) -> None:
    optim = [(p.file, p.byte_offset, p.byte_offset + p.nbytes) for k in ck.optim_keys()
             for p in ck.entries[k].pieces if p.file and p.numel]  # fmt: skip
    seen = []  # every byte range read: (file, first byte, end)
    real = fileio.read_into

    def spy(path, offset, out, *rest):
        seen.append((path, offset, offset + out.numel() * out.element_size()))
        return real(path, offset, out, *rest)

    monkeypatch.setattr(fileio, "read_into", spy)
    for k in ck:
        ck[k]
    assert seen
    for file, lo, hi in seen:
        assert not any(f == file and lo < b and a < hi for f, a, b in optim), (file, lo, hi)


# ---- error cases: one line, typed, naming the file -----------------------------------------------------
def _one_line(err: ZckptError, needle: str) -> None:
    assert "\n" not in str(err) and needle in str(err), str(err)


def test_missing_rank_file(tmp_path, fake_deepspeed):
    build_zero12(tmp_path, 1, 3)
    (tmp_path / "global_step5" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ShardMismatch) as ei:
        ds.read(tmp_path)
    _one_line(ei.value, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")


def test_extra_stale_rank_file(tmp_path, fake_deepspeed):
    build_zero3(tmp_path, 2)
    td = tmp_path / "global_step5"
    shutil.copy(
        td / "zero_pp_rank_1_mp_rank_00_optim_states.pt", td / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    )
    with pytest.raises(ShardMismatch) as ei:
        ds.read(tmp_path)
    _one_line(ei.value, "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    assert "stale" in (ei.value.hint or "")


def test_stale_rank_file_from_other_run(tmp_path, fake_deepspeed):
    build_zero12(tmp_path / "a", 1, 2)
    build_zero12(tmp_path / "b", 1, 3)
    name = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(tmp_path / "b" / "global_step5" / name, tmp_path / "a" / "global_step5" / name)
    with pytest.raises(ShardMismatch) as ei:
        ds.read(tmp_path / "a")
    _one_line(ei.value, name)


def test_consumed_mismatch(tmp_path, fake_deepspeed):
    build_zero12(tmp_path / "a", 1, 2)
    with pytest.MonkeyPatch.context() as mp:  # a model file whose group 1 has an extra param
        mp.setitem(GROUPS[1], "e", (2,))
        build_zero12(tmp_path / "b", 1, 2)
    shutil.copy(tmp_path / "b/global_step5/mp_rank_00_model_states.pt", tmp_path / "a/global_step5")
    with pytest.raises(ShardMismatch) as ei:
        ds.read(tmp_path / "a")
    _one_line(ei.value, "mp_rank_00_model_states.pt")  # the file that differs is named, beside the optim file
    assert "group 1 holds 16 fp32 elements" in str(ei.value) and "need 18" in str(ei.value), ei.value
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in str(ei.value), ei.value


def test_group_count_mismatch_names_both_files(tmp_path, fake_deepspeed):
    build_zero12(tmp_path / "a", 1, 2)
    with pytest.MonkeyPatch.context() as mp:  # a model file whose param_shapes list a third group
        mp.setattr(sys.modules[__name__], "GROUPS", [*GROUPS, {"x": (4,)}])
        build_zero12(tmp_path / "b", 1, 2)
    shutil.copy(tmp_path / "b/global_step5/mp_rank_00_model_states.pt", tmp_path / "a/global_step5")
    with pytest.raises(ShardMismatch) as ei:
        ds.read(tmp_path / "a")
    _one_line(ei.value, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    msg = str(ei.value)
    assert "2 flat fp32 tensors" in msg and "mp_rank_00_model_states.pt lists 3 groups" in msg, msg


def test_empty_dir_and_wrong_level(tmp_path, fake_deepspeed):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnknownFormat) as ei:
        ds.read(tmp_path / "empty")
    _one_line(ei.value, "empty")
    assert not ds.detect(tmp_path / "empty")
    build_zero12(tmp_path / "runs" / "checkpoint-5", 1, 2)
    with pytest.raises(UnknownFormat) as ei:  # the tag folder's parent's parent
        ds.read(tmp_path / "runs")
    _one_line(ei.value, "checkpoint-5")
    assert ds.detect(tmp_path / "runs" / "checkpoint-5") and ds.detect(
        tmp_path / "runs/checkpoint-5/global_step5"
    )


def test_tags(tmp_path, fake_deepspeed):
    build_zero12(tmp_path, 1, 2)
    shutil.copytree(tmp_path / "global_step5", tmp_path / "global_step10")
    assert ds.read(tmp_path).meta.tag == "global_step5"  # from `latest`
    assert ds.read(tmp_path, tag="global_step10").meta.tag == "global_step10"
    (tmp_path / "latest").unlink()
    with pytest.raises(UnknownFormat, match="global_step5, global_step10") as ei:
        ds.read(tmp_path)
    assert "--tag" in (ei.value.hint or "")
    with pytest.raises(UnknownFormat, match="nope"):
        ds.read(tmp_path, tag="nope")


# ---- real DeepSpeed fixtures ------------------------------------------------------------------------
CASES = ds_cases()


@pytest.mark.parametrize("case", CASES)
def test_real_fixture(case, monkeypatch):
    from safetensors.torch import load_file

    d = FIXTURES / case
    info = json.loads((d / "case.json").read_text())
    ref = load_file(str(d / "ref_fp32.safetensors"))
    ck = ds.read(d)
    m = ck.meta
    want16 = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[info["dtype"]]
    assert (m.stage, m.world_size, m.tag, m.step) == (
        info["stage"],
        info["world"],
        info["tag"],
        info["global_steps"],
    )
    assert m.precision == info["dtype"] and m.tied == info["tied"]
    assert m.state.client_state["note"] == "hello"
    json.dumps(m.to_json())
    if info["stage"] > 0:
        assert m.extra["bf16_optimizer"] == info["bf16_optimizer"]
    if info["stage"] == 0:  # fp32 masters named by value (zckpt.formats.deepspeed.zero0)
        assert m.extra["zero0_note"].startswith("fp32 masters mapped to names by value"), m.extra[
            "zero0_note"
        ]
    for k, t in ref.items():
        name = k.split(":")[0]
        if ":" in k:  # Adam moments gathered by DeepSpeed
            assert ck.entry(k).role is Role.OPTIM and torch.equal(ck.read(k), t), k
        elif name in info["buffers"]:  # buffers keep their own dtype (int64 stays int64)
            assert ck.entry(k).role is Role.BUFFER and ck[k].dtype == t.dtype and torch.equal(ck[k], t), k
        elif name in info["frozen"]:  # frozen: 16-bit in DS files, ref in training dtype
            assert (
                ck.entry(k).role is Role.FROZEN and ck[k].dtype == t.dtype == want16 and torch.equal(ck[k], t)
            ), k
        else:  # trainable: fp32 masters, bit-exact
            assert (
                ck.entry(k).role is Role.PARAM and ck[k].dtype == torch.float32 and torch.equal(ck[k], t)
            ), k
    for alias, owner in info["tied"].items():
        assert alias in ck and torch.equal(ck[alias], ck[owner])
    z2f = d / "ref_zero_to_fp32" / "pytorch_model.bin"
    if z2f.exists():  # zero_to_fp32 writes every float as fp32 (frozen upcast) and keeps int buffers
        theirs = torch.load(z2f, weights_only=True, map_location="cpu")
        dropped = set(ck) - set(theirs)  # zero_to_fp32 drops ZeRO-1 frozen params (DeepSpeed #5439)
        assert set(theirs) <= set(ck) and dropped == (set(info["frozen"]) if info["stage"] == 1 else set())
        for k, t in theirs.items():
            assert torch.equal(ck.read(k, t.dtype), t), k
    _weights_skip_optimizer_bytes(ck, monkeypatch)
