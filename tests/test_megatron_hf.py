"""Megatron -> Hugging Face: ``zckpt consolidate iter_dir/ hf-model/`` on the real fixtures, loaded by
transformers 5.x, logits against Megatron's own logits recorded at save time
(fixtures/megatron/*/ref/logits.pt, mlm_logits.py); the Megatron-named output (a file) bit for bit against
the gathered references."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers  # required: a missing transformers fails the tests, never skips them
from safetensors.torch import load_file
from typer.testing import CliRunner

import zckpt
from tests._fixtures import fixture
from zckpt.cli.app import app
from zckpt.errors import Unsupported
from zckpt.formats.megatron import hf
from zckpt.formats.megatron.read import open_megatron

CASES = [
    "tp1_fp32_llama", "tp2_bf16_llama", "pp2_fp32_llama", "tp2pp2_bf16_llama", "tp2dp2_bf16_distopt",
    "dp2_bf16_distopt_buckets", "dp2_bf16_distopt_full", "tp1_bf16_modelonly", "tp2_fp32_untied",
    "tp2_fp32_gpt2",
]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_hf_export_loads_and_matches_megatron_logits(case: str, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    r = CliRunner().invoke(
        app, ["consolidate", str(fixture("megatron", case, "ckpt", "iter_0000003")), str(out)]
    )
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "config.json").read_text())
    ref = torch.load(fixture("megatron", case, "ref", "logits.pt"), weights_only=True)
    m, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype="auto")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert m.dtype == ref["logits"].dtype
    assert cfg["tie_word_embeddings"] == ("untied" not in case)
    m.eval()
    with torch.no_grad():
        got = m(ref["tokens"]).logits.float()
    want = ref["logits"].float()
    assert got.shape == want.shape
    err = (got - want).abs().max().item() / want.abs().max().item()
    if ref["logits"].dtype == torch.float32:
        assert err <= 1e-5
    else:  # bf16 compute in two implementations: within bf16 rounding (2^-8 relative), twice
        assert err <= 2**-7


@pytest.mark.parametrize("case", ["tp2dp2_bf16_distopt", "tp2_bf16_llama"])
def test_megatron_names_file_auto_and_fp32(case: str, tmp_path: Path) -> None:
    src = fixture("megatron", case, "ckpt")
    ref = torch.load(fixture("megatron", case, "ref", "model_state_dict.pt"), weights_only=True)
    ref32 = torch.load(fixture("megatron", case, "ref", "model_state_dict_fp32.pt"), weights_only=True)
    zckpt.consolidate(src, tmp_path / "m.safetensors", progress=False)
    zckpt.consolidate(src, tmp_path / "m32.safetensors", dtype="fp32", progress=False)
    got, got32 = load_file(tmp_path / "m.safetensors"), load_file(tmp_path / "m32.safetensors")
    assert sorted(got) == sorted(ref) == sorted(got32)
    for k in ref:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k
        assert torch.equal(got32[k], ref32[k]), k


def test_other_architecture_refused_with_reasons() -> None:
    ck, _ = open_megatron(fixture("megatron", "tp1_fp32_llama", "ckpt"))
    cfg = dict(ck.meta.state.config or {}, qk_layernorm=True)
    odd = zckpt.Checkpoint(
        dataclasses.replace(ck.meta, state=dataclasses.replace(ck.meta.state, config=cfg)),
        list(ck.entries.values()),
    )
    with pytest.raises(Unsupported, match="llama: QK layer norms.*GPTBigCode.*QK layer norms"):
        hf.export(odd)
    cfg = dict(ck.meta.state.config or {}, normalization="LayerNorm")
    odd = zckpt.Checkpoint(
        dataclasses.replace(ck.meta, state=dataclasses.replace(ck.meta.state, config=cfg)),
        list(ck.entries.values()),
    )
    with pytest.raises(Unsupported, match=r"normalization LayerNorm \(needs RMSNorm\)"):
        hf.export(odd)


def test_qkv_split_per_query_group_by_hand() -> None:
    """q/k/v against a hand-made split of the gathered fused QKV (GQA 4 heads / 2 groups, kv 8)."""
    ck, op = open_megatron(fixture("megatron", "tp2_bf16_llama", "ckpt"))
    out = hf.export(ck)
    ref = torch.load(
        fixture("megatron", "tp2_bf16_llama", "ref", "model_state_dict_fp32.pt"), weights_only=True
    )
    qkv = ref["decoder.layers.1.self_attention.linear_qkv.weight"].view(
        2, 4, 8, 32
    )  # groups, [q q k v], d, h
    q, k, v = qkv[:, :2].reshape(-1, 32), qkv[:, 2].reshape(-1, 32), qkv[:, 3].reshape(-1, 32)
    hfc = out.checkpoint
    assert torch.equal(hfc.read("model.layers.1.self_attn.q_proj.weight"), q)
    assert torch.equal(hfc.read("model.layers.1.self_attn.k_proj.weight"), k)
    assert torch.equal(hfc.read("model.layers.1.self_attn.v_proj.weight"), v)
    fc1 = ref["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(hfc.read("model.layers.0.mlp.gate_proj.weight"), fc1[:64])
    assert torch.equal(hfc.read("model.layers.0.mlp.up_proj.weight"), fc1[64:])
    assert hfc.meta.tied == {"lm_head.weight": "model.embed_tokens.weight"}


def test_diff_megatron_against_its_hf_export(tmp_path: Path) -> None:
    """``zckpt diff`` of a Megatron checkpoint and its HF export compares under HF names: equal for the fp32
    masters' export; a changed tensor in the export is found under its HF name."""
    src = fixture("megatron", "tp2dp2_bf16_distopt", "ckpt")
    zckpt.consolidate(src, tmp_path / "hf", dtype="fp32", progress=False)
    assert zckpt.diff(src, tmp_path / "hf", progress=False).equal
    assert zckpt.diff(tmp_path / "hf", src, progress=False).equal
    w = load_file(tmp_path / "hf" / "model.safetensors")
    w["model.layers.1.self_attn.v_proj.weight"][3, 5] += 1.0
    from safetensors.torch import save_file

    save_file(w, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    for side in (tmp_path / "hf").glob("model.safetensors.*.json"):  # the edit is ours, not damage
        side.unlink()
    r = zckpt.diff(src, tmp_path / "hf", progress=False)
    assert not r.equal
    changed = [t for t in r.tensors if t.differs]
    assert [t.key for t in changed] == ["model.layers.1.self_attn.v_proj.weight"] and changed[0].changed == 1


def test_hf_export_with_the_true_vocab(tmp_path: Path) -> None:
    """``trim_vocab``: the export's vocab is args.vocab_size (203, not the padded 208); its logits are
    Megatron's first 203."""
    ck, _ = open_megatron(fixture("megatron", "tp2_fp32_untied", "ckpt"), trim_vocab=True)
    with ck:
        zckpt.consolidate(ck, tmp_path / "hf", progress=False)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 203
    ref = torch.load(fixture("megatron", "tp2_fp32_untied", "ref", "logits.pt"), weights_only=True)
    m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto").eval()
    with torch.no_grad():
        got = m(ref["tokens"]).logits
    want = ref["logits"][..., :203]
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
