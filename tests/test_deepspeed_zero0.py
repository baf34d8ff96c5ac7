"""ZeRO-0 DeepSpeed files: fp32 masters named by value, and the fallbacks when that is not unique.

Oracle: hand-made fp32 masters and Adam moments saved with torch.save in DeepSpeed's ZeRO-0 layout
(``module`` 16-bit = master cast; ``optimizer`` = FP16_UnfusedOptimizer state dict); the reader must give
back exactly the tensors chosen here, under the right names.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from zckpt.formats import deepspeed as ds
from zckpt.formats import native
from zckpt.model import Role

LOW = torch.bfloat16


def _save(
    root: Path,
    model: list[tuple[str, torch.Tensor, int | None]],  # (name, fp32 value, param group or None = frozen)
    *,
    fp32_override: dict[str, torch.Tensor] | None = None,
) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    """A ZeRO-0 save; returns (save dir, {name: {"fp32"/"exp_avg"/"exp_avg_sq": tensor}})."""
    module: OrderedDict[str, torch.Tensor] = OrderedDict()
    module["buf"] = torch.arange(3)
    groups: list[list[str]] = [[], []]
    truth: dict[str, dict[str, torch.Tensor]] = {}
    for name, v, g in model:
        module[name] = v.to(LOW)
        if g is not None:
            groups[g].append(name)
    groups = [g for g in groups if g]
    fp32_groups, pgs, state = [], [], {}
    idx = 0
    for g, names in enumerate(groups):
        fp32_groups.append([])
        pgs.append({"lr": 0.1 * (g + 1), "weight_decay": 0.0, "params": []})
        for name in names:
            v = dict((n, t) for n, t, _ in model)[name]
            master = (fp32_override or {}).get(name, v).clone()
            m1, m2 = torch.full_like(v, 0.5 + idx), torch.full_like(v, 2.0 + idx)
            fp32_groups[g].append(master)
            state[idx] = {"step": torch.tensor(3.0), "exp_avg": m1, "exp_avg_sq": m2}
            pgs[g]["params"].append(idx)
            truth[name] = {"fp32": master, "exp_avg": m1, "exp_avg_sq": m2}
            idx += 1
    sd = {
        "module": module,
        "buffer_names": ["buf"],
        "optimizer": {
            "dynamic_loss_scale": True,
            "cur_scale": 64.0,
            "cur_iter": 3,
            "optimizer_state_dict": {"state": state, "param_groups": pgs},
            "fp32_groups": fp32_groups,
        },
        "global_steps": 3,
        "dp_world_size": 2,
        "mp_world_size": 1,
    }
    td = root / "global_step3"
    td.mkdir(parents=True)
    torch.save(sd, td / "mp_rank_00_model_states.pt")
    (root / "latest").write_text("global_step3")
    return root, truth


def _vals(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def test_masters_named_by_value_with_interleaved_groups_and_frozen(tmp_path: Path) -> None:
    same = _vals(9, 4)  # two trainable params with identical values, groups, masters, states: harmless tie
    model = [
        ("a", _vals(1, 4), 0),
        ("f", _vals(2, 4), None),  # frozen, same shape as its neighbours
        ("b", _vals(3, 4), 1),
        ("c", _vals(4, 2, 2), 0),
        ("d", same, 0),
        ("e", same.clone(), 0),
        ("g", _vals(5, 4), 1),
    ]
    d, truth = _save(tmp_path, model)
    # make e's moments equal d's so the tie cannot matter
    sd = torch.load(d / "global_step3" / "mp_rank_00_model_states.pt", weights_only=True)
    st = sd["optimizer"]["optimizer_state_dict"]["state"]
    st[3] = {k: v.clone() for k, v in st[2].items()}
    torch.save(sd, d / "global_step3" / "mp_rank_00_model_states.pt")
    truth["e"].update({k: st[2][k] for k in ("exp_avg", "exp_avg_sq")})
    ck = ds.read(d)
    assert ck.meta.extra["zero0_note"].startswith(
        "fp32 masters mapped to names by value (6 trainable, 1 frozen)"
    )
    for name, t in truth.items():
        assert ck.entry(name).role is Role.PARAM and ck[name].dtype == torch.float32
        assert torch.equal(ck[name], t["fp32"]), name
        for s in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ck.read(f"{name}:{s}"), t[s]), (name, s)
        assert ck.read(f"{name}:step").item() == 3.0
    assert ck.entry("f").role is Role.FROZEN and torch.equal(ck["f"], model[1][1].to(LOW))
    assert ck.entry("buf").role is Role.BUFFER
    groups = ck.meta.optimizer.groups  # type: ignore[union-attr]
    assert [g.params for g in groups] == [("a", "c", "d", "e"), ("b", "g")]
    assert ck.meta.precision == "bf16" and ck.meta.stage == 0


def _assert_fallback(ck, model, why: str) -> None:
    note = ck.meta.extra["zero0_note"]
    assert note.startswith("fp32 masters not mapped to names") and why in note, note
    for name, v, _ in model:
        assert ck.entry(name).role is Role.PARAM and torch.equal(ck[name], v.to(LOW)), name
    assert not list(ck.optim_keys())


def test_frozen_equal_to_trainable_falls_back(tmp_path: Path) -> None:
    v = _vals(1, 4)
    model = [("f", v.clone(), None), ("a", v, 0), ("b", _vals(2, 3), 0)]
    d, _ = _save(tmp_path, model)
    _assert_fallback(ds.read(d), model, "hold identical 16-bit values; which one is trainable is ambiguous")


def test_unmatched_master_falls_back(tmp_path: Path) -> None:
    model = [("a", _vals(1, 4), 0), ("b", _vals(2, 4), 0)]
    d, _ = _save(tmp_path, model, fp32_override={"b": _vals(3, 4)})  # a stale master: no 16-bit twin
    _assert_fallback(ds.read(d), model, "fp32_groups[0][1] (shape [4]) matches no 16-bit module param")


def test_equal_16bit_but_different_masters_falls_back(tmp_path: Path) -> None:
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    model = [("a", v, 0), ("b", v.clone(), 0)]
    nudged = v + 2.0**-20  # below bf16 resolution: same 16-bit value, different fp32 bits
    assert torch.equal(nudged.to(LOW), v.to(LOW)) and not torch.equal(nudged, v)
    d, _ = _save(tmp_path, model, fp32_override={"b": nudged})
    _assert_fallback(ds.read(d), model, "different fp32 masters")


def test_equal_16bit_in_different_groups_falls_back(tmp_path: Path) -> None:
    v = _vals(1, 4)
    model = [("a", v, 0), ("b", v.clone(), 1)]
    d, _ = _save(tmp_path, model)
    _assert_fallback(ds.read(d), model, "param groups 0 and 1")


def _swap_in_fixture(tmp_path: Path, param: str, slot: int) -> Path:
    """A copy of the real DeepSpeed 0.19.8 ZeRO-0 bf16 fixture with module ``param`` and the ``exp_avg_sq``
    of torch optimizer state ``slot`` traded places (fuzz ``swap-tensors``)."""
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(Path(__file__).resolve().parents[1] / "fixtures" / "ds" / "s0_bf16_w2", d)
    f = d / "global_step3" / "mp_rank_00_model_states.pt"
    sd = torch.load(f, weights_only=False)  # the committed fixture: our own file
    st = sd["optimizer"]["optimizer_state_dict"]["state"][slot]
    sd["module"][param], st["exp_avg_sq"] = st["exp_avg_sq"], sd["module"][param]
    torch.save(sd, f)
    return d


def test_module_param_swapped_with_an_optimizer_state_is_refused(tmp_path: Path) -> None:
    """Fuzz seed 2 case 217 on the real DeepSpeed 0.19.8 ZeRO-0 bf16 save: the frozen ``frozen.weight`` and
    ``state[4].exp_avg_sq`` traded places. The module no longer matches its fp32 masters, so the reader
    falls back to the module weights, which now hold the moment; the state's shape (the frozen param's)
    is not its master's, and that is refused, naming the file."""
    from zckpt.errors import ShardMismatch

    d = _swap_in_fixture(tmp_path, "frozen.weight", 4)
    with pytest.raises(ShardMismatch, match=r"mp_rank_00_model_states\.pt: optimizer state 'exp_avg_sq' of "
                       r"fp32_groups\[0\]\[4\] has shape \[7, 7\], its fp32 master \[7\]"):  # fmt: skip
        ds.read(d)


def test_module_param_swapped_with_a_state_of_its_shape_is_refused(tmp_path: Path) -> None:
    """Fuzz seed 43 case 97 on the real DeepSpeed 0.19.8 ZeRO-0 bf16 save: ``norm.weight`` (bf16 [7]) and
    ``state[3].exp_avg_sq`` (fp32 [7], another param's moment of the same shape) traded places. The shapes
    all still agree, and the reader fell back to the module weights, so ``reshard --to native`` wrote the
    moment as ``norm.weight`` with exit 0. One state held in bf16 where every other param's is fp32 is
    refused, naming the file and both slots."""
    from zckpt.errors import ShardMismatch

    d = _swap_in_fixture(tmp_path, "norm.weight", 3)
    with pytest.raises(ShardMismatch, match=r"mp_rank_00_model_states\.pt: optimizer state 'exp_avg_sq' of "
                       r"fp32_groups\[0\]\[3\] is torch\.bfloat16, that of fp32_groups\[0\]\[1\] "
                       r"torch\.float32"):  # fmt: skip
        ds.read(d)


@pytest.mark.parametrize("to", ["deepspeed", "native", "dcp"])
def test_reshard_of_unnamed_masters_names_the_file_and_why(to: str, tmp_path: Path) -> None:
    """Masters the reader could not name (fuzz seed 13 case 123: a moment swapped with its master) leave
    the module weights and no optimizer: every reshard target refuses (``--to native`` used to write a run
    that resumes with fresh moments, exit 0), naming the model file and the reader's reason."""
    from zckpt import reshard
    from zckpt.errors import Unsupported

    model = [("a", _vals(1, 4), 0), ("b", _vals(2, 4), 0)]
    d, _ = _save(tmp_path / "in", model, fp32_override={"b": _vals(3, 4)})
    with pytest.raises(Unsupported) as e:
        reshard(d, tmp_path / "out", world=2, to=to, progress=False)
    msg = str(e.value)
    assert msg.startswith(str(d / "global_step3" / "mp_rank_00_model_states.pt") + ": "), msg
    assert "fp32_groups[0][1] (shape [4]) matches no 16-bit module param" in msg, msg
    assert not (tmp_path / "out").exists()


def test_reshard_of_a_zero0_file_without_optimizer_keeps_the_module_weights(tmp_path: Path) -> None:
    """A ZeRO-0 save with no optimizer (``save_checkpoint`` of a model-only engine) has nothing to lose: its
    reshard writes the 16-bit module weights at the new world size, read back equal."""
    from zckpt import reshard

    model = [("a", _vals(1, 4), 0), ("b", _vals(2, 3), 0)]
    d, _ = _save(tmp_path / "in", model)
    f = d / "global_step3" / "mp_rank_00_model_states.pt"
    sd = torch.load(f, weights_only=True)
    del sd["optimizer"]
    torch.save(sd, f)
    reshard(d, tmp_path / "out", world=2, to="native", progress=False)
    out = native.read(tmp_path / "out")
    for name, v, _ in model:
        assert torch.equal(out[name].to(LOW), v.to(LOW)), name
    assert out.meta.state.optimizer is None
