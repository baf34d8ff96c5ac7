"""Megatron-Core ``torch_dist`` checkpoints (fixtures/megatron: real megatron-core 0.16.1 saves made on CPU by
Megatron-LM's own training loop) read against the independent references mlm_train.py gathered from the live
model and optimizer: unstacked TP1/PP1 names, model dtype and fp32 masters bit for bit, Adam moments bit for
bit, from every layout (TP, PP, TP x PP, the distributed optimizer's dp_reshardable flat buckets and its
fully_reshardable state, model-only)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import zckpt
from tests._fixtures import fixture
from zckpt.cli.app import app
from zckpt.errors import CorruptCheckpoint, UnsafePickle
from zckpt.formats import detect
from zckpt.formats.megatron.read import open_megatron

CASES = [
    "tp1_fp32_llama", "tp2_bf16_llama", "pp2_fp32_llama", "tp2pp2_bf16_llama", "tp2dp2_bf16_distopt",
    "dp2_bf16_distopt_buckets",
    "dp2_bf16_distopt_full", "tp1_bf16_modelonly", "tp2_fp32_untied", "tp2_fp32_gpt2",
]  # fmt: skip
WITH_OPTIM = [c for c in CASES if "modelonly" not in c]


def _ref(case: str, name: str) -> dict:
    return torch.load(fixture("megatron", case, "ref", name), weights_only=True)


@pytest.mark.parametrize("case", CASES)
def test_model_dtype_equals_gathered_state_dict(case: str) -> None:
    ref = _ref(case, "model_state_dict.pt")
    with zckpt.open(fixture("megatron", case, "ckpt")) as ck:
        assert ck.meta.format == "megatron"
        assert list(ck) == list(ref)  # GPTModel.state_dict() names and order
        for k, v in ref.items():
            got = ck.read(k, v.dtype)
            assert got.shape == v.shape
            assert torch.equal(got.view(torch.uint8), v.view(torch.uint8)), k


@pytest.mark.parametrize("case", WITH_OPTIM)
def test_fp32_masters_and_moments_bit_exact(case: str) -> None:
    ref32 = _ref(case, "model_state_dict_fp32.pt")
    opt = _ref(case, "optimizer_state_fp32.pt")["state"]
    with zckpt.open(fixture("megatron", case, "ckpt")) as ck:
        for k, v in ref32.items():
            e = ck.entry(k)
            assert e.role.value == "param"
            assert torch.equal(ck.read(k, torch.float32), v), k
        want = {f"{k}:{s}": t for k, st in opt.items() for s, t in st.items()}
        assert sorted(ck.optim_keys()) == sorted(want)
        for key, t in want.items():
            assert torch.equal(ck.read(key), t), key


def test_model_only_has_model_dtype_and_no_state() -> None:
    ck = zckpt.open(fixture("megatron", "tp1_bf16_modelonly", "ckpt"))
    assert ck.optim_keys() == []
    assert {e.dtype.torch for e in ck.model_entries()} == {torch.bfloat16}
    assert ck.meta.precision == "bf16"


def test_flat_bucket_layout_matches_ddp_buffers() -> None:
    """The decoded dp_reshardable layout is Megatron's own DDP buffer layout (ref_info.json's oracle): each
    parameter's local shard starts where the live buffer had it."""
    info = json.loads(fixture("megatron", "tp2dp2_bf16_distopt", "ref", "ref_info.json").read_text())
    from zckpt.formats.megatron import flat

    ck, op = open_megatron(fixture("megatron", "tp2dp2_bf16_distopt", "ckpt"))
    names = [e.name for e in ck.model_entries()]
    for lay in info["ddp_buffer_layout"]:
        (buf,) = lay["buffers"]
        order = list(reversed(flat.order(names, op.config, op.parallel, lay["pp_rank"])))
        assert [p["name"] for p in buf["params"]] == order
        pos = 0
        for p in buf["params"]:
            start = -(-pos // flat.ALIGN) * flat.ALIGN
            assert p["start"] == start
            n, _ = flat.runs(p["name"], ck.entry(p["name"]).shape, op.parallel.tp, lay["tp_rank"], True)
            assert p["end"] - p["start"] == n
            pos = p["end"]
        assert pos == buf["numel_unpadded"]


def test_save_folder_iteration_folder_and_tag() -> None:
    save = fixture("megatron", "tp2_bf16_llama", "ckpt")
    assert detect(save).name == "megatron"
    assert detect(save / "iter_0000003").name == "megatron"
    for p, tag in ((save, None), (save / "iter_0000003", None), (save, "3"), (save, "iter_0000003")):
        with zckpt.open(p, tag=tag) as ck:
            assert ck.meta.tag == "iter_0000003"
            assert ck.meta.state.counters.global_steps == 3


def test_release_folder(tmp_path: Path) -> None:
    src = fixture("megatron", "tp1_fp32_llama", "ckpt")
    shutil.copytree(src / "iter_0000003", tmp_path / "release")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    with zckpt.open(tmp_path) as ck:
        assert ck.meta.tag == "release"
        assert len(ck) == 14


def test_trim_vocab_cuts_padded_rows() -> None:
    ref = _ref("tp2_fp32_untied", "model_state_dict.pt")
    ck, op = open_megatron(fixture("megatron", "tp2_fp32_untied", "ckpt"), trim_vocab=True)
    assert op.config.vocab_size == 203 and op.config.padded_vocab_size == 208
    for k in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert torch.equal(ck.read(k), ref[k][:203])
        assert torch.equal(
            ck.read(f"{k}:exp_avg"),
            _ref("tp2_fp32_untied", "optimizer_state_fp32.pt")["state"][k]["exp_avg"][:203],
        )


def test_inspect_shows_config_layout_and_roles() -> None:
    r = CliRunner().invoke(
        app, ["inspect", str(fixture("megatron", "tp2dp2_bf16_distopt", "ckpt")), "--json"]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["values"]["parallel"] == "TP 2 x PP 1 x DP 2 (world 4)"
    assert doc["values"]["optimizer"] == "distributed (dp_reshardable)"
    assert doc["values"]["model.num_query_groups"] == "2" and doc["values"]["model.activation"] == "swiglu"
    assert set(doc["by_role"]) == {"param", "optim"}  # layer norms are parameters, nothing "frozen"
    assert doc["frozen"] == [] and doc["precision"] == "bf16" and doc["step"] == 3
    ck, op = open_megatron(fixture("megatron", "tp2dp2_bf16_distopt", "ckpt"))
    assert ck.meta.extra["parallel"]["tensor"] == 2 and ck.meta.extra["parallel"]["data"] == 2
    assert ck.meta.extra["optimizer_sharding"] == "dp_reshardable"
    assert ck.meta.state.config is not None and ck.meta.state.config["num_query_groups"] == 2


@pytest.mark.parametrize("case", ["tp2pp2_bf16_llama", "tp2dp2_bf16_distopt"])
def test_verify_clean(case: str) -> None:
    r = CliRunner().invoke(app, ["verify", str(fixture("megatron", case, "ckpt"))])
    assert r.exit_code == 0, r.output


def test_verify_finds_flipped_byte(tmp_path: Path) -> None:
    dst = tmp_path / "ckpt"
    shutil.copytree(fixture("megatron", "tp2_bf16_llama", "ckpt"), dst)
    f = sorted((dst / "iter_0000003").glob("*.distcp"))[0]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    r = CliRunner().invoke(app, ["verify", str(dst)])
    assert r.exit_code != 0
    assert f.name in r.output


def test_master_chunk_pointed_at_another_items_bytes_is_refused(tmp_path: Path) -> None:
    """Fuzz seed 442, case 9: an fp32 master chunk's ``storage_data`` entry re-pointed at another master's
    bytes (same file, valid CRCs). ``consolidate`` wrote the other tensor's values under this name, exit 0;
    ``verify`` saw the gap left behind. The Megatron open now checks that no two items share bytes, as the
    DCP open does, read or not."""
    from tests.fuzz import pickles

    dst = tmp_path / "ckpt"
    shutil.copytree(fixture("megatron", "tp2pp2_bf16_llama", "ckpt"), dst)
    meta = dst / "iter_0000003" / ".metadata"
    md = pickles.load_opaque(meta.read_bytes())
    sd = md.state["storage_data"]
    masters = [k for k in sd if k.state["fqn"].startswith("optimizer.state.fp32_param.")]
    a = masters[0]
    b = next(k for k in masters if k.state["fqn"] != a.state["fqn"]
             and sd[k].state["relative_path"] == sd[a].state["relative_path"])  # fmt: skip
    sd[a].state["offset"], sd[a].state["length"] = sd[b].state["offset"], sd[b].state["length"]
    meta.write_bytes(pickles.dump_opaque(md))
    r = CliRunner().invoke(app, ["consolidate", str(dst), str(tmp_path / "o.safetensors"), "--no-progress"])
    assert r.exit_code == 2 and "overlap at bytes" in r.output and ".distcp" in r.output, r.output
    assert not (tmp_path / "o.safetensors").exists()
    with pytest.raises(CorruptCheckpoint, match="overlap"):
        zckpt.open(dst)


def test_common_pt_code_refused(tmp_path: Path) -> None:
    """A common.pt that asks for a global outside the allowlist is refused before anything runs."""
    dst = tmp_path / "ckpt"
    shutil.copytree(fixture("megatron", "tp1_fp32_llama", "ckpt"), dst)
    import os

    torch.save({"args": os.system}, dst / "iter_0000003" / "common.pt")
    with pytest.raises(UnsafePickle):
        zckpt.open(dst)


def test_latest_garbage_is_one_clear_error(tmp_path: Path) -> None:
    dst = tmp_path / "ckpt"
    shutil.copytree(fixture("megatron", "tp1_fp32_llama", "ckpt"), dst)
    (dst / "latest_checkpointed_iteration.txt").write_text("three\n")
    with pytest.raises(CorruptCheckpoint, match="not an iteration number"):
        zckpt.open(dst)


@pytest.mark.parametrize(
    ("arg", "value"), [("num_query_groups", 1), ("swiglu", False), ("ffn_hidden_size", 80)]
)
def test_args_that_disagree_with_the_tensors_are_refused(tmp_path: Path, arg: str, value: object) -> None:
    """A common.pt whose args describe another model is refused (it would split QKV, [gate; up] or the flat
    buckets wrongly), naming the tensor and both shapes."""
    from tests.fuzz import pickles

    dst = tmp_path / "ckpt"
    shutil.copytree(fixture("megatron", "tp2dp2_bf16_distopt", "ckpt"), dst)
    f = dst / "iter_0000003" / "common.pt"
    obj = pickles.load_opaque(pickles.read_pickle(f))
    obj["args"].state[arg] = value
    pickles.rewrite_records(f, {"data.pkl": pickles.dump_opaque(obj)})
    with pytest.raises(CorruptCheckpoint, match="but common.pt's args give"):
        zckpt.open(dst)
    r = CliRunner().invoke(app, ["consolidate", str(dst), str(tmp_path / "hf")])
    assert r.exit_code != 0 and "common.pt" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "hf").exists()


def test_verify_reports_stray_file_and_missing_common(tmp_path: Path) -> None:
    dst = tmp_path / "ckpt"
    shutil.copytree(fixture("megatron", "tp1_fp32_llama", "ckpt"), dst)
    it = dst / "iter_0000003"
    (it / "__7_0.distcp").write_bytes(b"left over")
    r = CliRunner().invoke(app, ["verify", str(dst)])
    assert r.exit_code != 0 and "__7_0.distcp" in r.output and "not named by .metadata" in r.output
    (it / "__7_0.distcp").unlink()
    (it / "common.pt").unlink()
    r = CliRunner().invoke(app, ["verify", str(dst)])
    assert r.exit_code != 0 and "common.pt" in r.output and "Traceback" not in r.output


def test_no_megatron_import_anywhere_in_zckpt() -> None:
    """zckpt reads Megatron's files without Megatron: no module imports it (by source text)."""
    root = Path(zckpt.__file__).parent
    offenders = [
        str(p)
        for p in root.rglob("*.py")
        if any(
            line.lstrip().startswith(("import megatron", "from megatron"))
            for line in p.read_text().splitlines()
        )
    ]
    assert offenders == []


def test_reshard_to_dcp_keeps_masters_and_moments(tmp_path: Path) -> None:
    """``reshard --to dcp`` (for FSDP2/torchtitan): the fp32 masters and Adam moments of the dp_reshardable
    flat buckets, under the unstacked names, equal the gathered references."""
    src = fixture("megatron", "tp2dp2_bf16_distopt", "ckpt")
    r = CliRunner().invoke(app, ["reshard", str(src), str(tmp_path / "dcp"), "--to", "dcp", "--world", "2"])
    assert r.exit_code == 0, r.output
    ref32 = _ref("tp2dp2_bf16_distopt", "model_state_dict_fp32.pt")
    opt = _ref("tp2dp2_bf16_distopt", "optimizer_state_fp32.pt")["state"]
    with zckpt.open(tmp_path / "dcp") as ck:
        assert ck.meta.format == "dcp"
        for k, v in ref32.items():
            assert torch.equal(ck.read(k, torch.float32), v), k
            for s, t in opt[k].items():
                assert torch.equal(ck.read(f"{k}:{s}"), t), (k, s)


@pytest.mark.parametrize("given", ["ckpt", "ckpt/iter_0000003", "ckpt/iter_0000003/mp_rank_01",
                                   "ckpt/iter_0000003/mp_rank_00/model_optim_rng.pt"])  # fmt: skip
def test_legacy_torch_format_is_refused_naming_it(given: str, tmp_path: Path) -> None:
    """A real Megatron-LM ``--ckpt-format torch`` save (TP2): whichever of its folders or files is given,
    every command refuses it as the legacy format with the way to convert it, even with ``--trust-pickle``
    (a rank's file alone holds half of each split tensor), and writes nothing."""
    path = fixture("megatron", "legacy_tp2_bf16_modelonly", given)
    for args in (["inspect", path], ["consolidate", path, tmp_path / "o"], ["verify", path],
                 ["consolidate", path, tmp_path / "o.safetensors", "--trust-pickle"]):  # fmt: skip
        r = CliRunner().invoke(app, [str(a) for a in args])
        assert r.exit_code not in (0, None) and "Traceback" not in r.output, (args, r.output)
        text = r.stderr if args[0] != "verify" else r.output
        assert "legacy 'torch' format" in text and "--ckpt-convert-format torch_dist" in text, (args, text)
    assert not list(tmp_path.iterdir())
