"""Llama family (``LlamaForCausalLM``; ``Qwen2ForCausalLM`` for QKV bias only): RMSNorm, SwiGLU, RoPE, GQA.

| Megatron (unstacked)                                   | Hugging Face                                  |
|--------------------------------------------------------|-----------------------------------------------|
| ``embedding.word_embeddings.weight``                   | ``model.embed_tokens.weight``                 |
| ``decoder.layers.{i}.input_layernorm.weight``          | ``model.layers.{i}.input_layernorm.weight``   |
| ``decoder.layers.{i}.self_attention.linear_qkv.*``     | ``...self_attn.{q,k,v}_proj.*`` (per group)   |
| ``decoder.layers.{i}.self_attention.linear_proj.*``    | ``...self_attn.o_proj.*``                     |
| ``decoder.layers.{i}.pre_mlp_layernorm.weight``        | ``...post_attention_layernorm.weight``        |
| ``decoder.layers.{i}.mlp.linear_fc1.*``                | ``...mlp.gate_proj.*`` / ``...mlp.up_proj.*`` |
| ``decoder.layers.{i}.mlp.linear_fc2.*``                | ``...mlp.down_proj.*``                        |
| ``decoder.final_layernorm.weight``                     | ``model.norm.weight``                         |
| ``output_layer.weight`` (tied: the embeddings)         | ``lm_head.weight``                            |

QKV rows are ``[q (heads/groups x kv), k (kv), v (kv)]`` per query group; HF wants all q rows, then k, then v.
Megatron's RoPE (not interleaved) is HF's ``rotate_half``: no permutation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zckpt.checkpoint import Checkpoint
from zckpt.formats.megatron.carve import rows
from zckpt.formats.megatron.hf.family import HfExport, common_refusal, rebuild
from zckpt.model import TensorEntry

FAMILY = "llama"


def unsupported(cfg: Mapping[str, Any]) -> str | None:
    why = common_refusal(cfg)
    if why is not None:
        return why
    if cfg.get("normalization") != "RMSNorm":
        return f"normalization {cfg.get('normalization')} (needs RMSNorm)"
    if cfg.get("activation") != "swiglu":
        return f"activation {cfg.get('activation')} (needs swiglu)"
    if cfg.get("position_embedding_type") != "rope":
        return f"position embedding {cfg.get('position_embedding_type')} (needs rope)"
    if cfg.get("rotary_percent", 1.0) != 1.0:
        return f"rotary_percent {cfg.get('rotary_percent')} (needs 1.0)"
    return None


def qkv_ranges(cfg: Mapping[str, Any]) -> tuple[list[tuple[int, int]], ...]:
    """Row ranges of q, k and v in Megatron's fused QKV (per query group)."""
    groups, d = cfg["num_query_groups"], cfg["kv_channels"]
    per = cfg["num_attention_heads"] // groups
    block = (per + 2) * d
    q = [(g * block, g * block + per * d) for g in range(groups)]
    k = [(g * block + per * d, g * block + (per + 1) * d) for g in range(groups)]
    v = [(g * block + (per + 1) * d, (g + 1) * block) for g in range(groups)]
    return q, k, v


def _part(e: TensorEntry, name: str, ranges: list[tuple[int, int]]) -> TensorEntry:
    row = 1 if len(e.shape) == 1 else e.shape[1]
    n = sum(b - a for a, b in ranges)
    return TensorEntry(name, (n, *e.shape[1:]), e.dtype, e.role, rows(e.pieces, row, ranges))


def _same(e: TensorEntry, name: str) -> TensorEntry:
    return TensorEntry(name, e.shape, e.dtype, e.role, e.pieces)


def export(ckpt: Checkpoint, cfg: Mapping[str, Any]) -> HfExport:
    q, k, v = qkv_ranges(cfg)
    ffn = cfg["ffn_hidden_size"]
    out: list[TensorEntry] = []
    emb = ckpt.entry("embedding.word_embeddings.weight")
    out.append(_same(emb, "model.embed_tokens.weight"))
    for i in range(cfg["num_layers"]):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out.append(_same(ckpt.entry(m + "input_layernorm.weight"), h + "input_layernorm.weight"))
        for s in ("weight", "bias"):
            qkv = m + f"self_attention.linear_qkv.{s}"
            if qkv in ckpt.entries:
                e = ckpt.entry(qkv)
                out += [_part(e, h + f"self_attn.{p}_proj.{s}", r) for p, r in (("q", q), ("k", k), ("v", v))]
            if m + f"self_attention.linear_proj.{s}" in ckpt.entries:
                out.append(
                    _same(ckpt.entry(m + f"self_attention.linear_proj.{s}"), h + f"self_attn.o_proj.{s}")
                )
        out.append(_same(ckpt.entry(m + "pre_mlp_layernorm.weight"), h + "post_attention_layernorm.weight"))
        for s in ("weight", "bias"):
            if m + f"mlp.linear_fc1.{s}" in ckpt.entries:
                e = ckpt.entry(m + f"mlp.linear_fc1.{s}")
                out += [
                    _part(e, h + f"mlp.gate_proj.{s}", [(0, ffn)]),
                    _part(e, h + f"mlp.up_proj.{s}", [(ffn, 2 * ffn)]),
                ]
            if m + f"mlp.linear_fc2.{s}" in ckpt.entries:
                out.append(_same(ckpt.entry(m + f"mlp.linear_fc2.{s}"), h + f"mlp.down_proj.{s}"))
    out.append(_same(ckpt.entry("decoder.final_layernorm.weight"), "model.norm.weight"))
    tied: dict[str, str] = {}
    if "output_layer.weight" in ckpt.entries:
        out.append(_same(ckpt.entry("output_layer.weight"), "lm_head.weight"))
    else:
        tied = {"lm_head.weight": "model.embed_tokens.weight"}
    bias_linear = bool(cfg.get("add_bias_linear"))
    qwen2 = bool(cfg.get("add_qkv_bias")) and not bias_linear
    config: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": emb.shape[0],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": ffn,
        "num_hidden_layers": cfg["num_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_query_groups"],
        "head_dim": cfg["kv_channels"],
        "hidden_act": "silu",
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rms_norm_eps": cfg["norm_epsilon"],
        "rope_theta": cfg["rotary_base"],
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg["rotary_base"]},
        "tie_word_embeddings": bool(tied),
        "attention_dropout": 0.0,
    }
    if not qwen2:
        config |= {"attention_bias": bias_linear, "mlp_bias": bias_linear}
    return HfExport(rebuild(ckpt, out, tied), config)
