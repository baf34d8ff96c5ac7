"""GPT-2-style models (LayerNorm, GeLU, learned absolute positions, biases) as ``GPTBigCodeForCausalLM``.

GPTBigCode is GPT-2 with ``nn.Linear`` weights (``[out, in]``, as Megatron's) and, without multi-query
attention, the fused QKV laid out per head as ``[q, k, v]``: Megatron's layout with one query group per head.
With a single query group (multi-query), both are ``[all q; k; v]``. So every tensor maps whole:

| Megatron (unstacked)                                   | Hugging Face                                   |
|--------------------------------------------------------|------------------------------------------------|
| ``embedding.word_embeddings.weight``                   | ``transformer.wte.weight``                     |
| ``embedding.position_embeddings.weight``               | ``transformer.wpe.weight``                     |
| ``decoder.layers.{i}.input_layernorm.*``               | ``transformer.h.{i}.ln_1.*``                   |
| ``decoder.layers.{i}.self_attention.linear_qkv.*``     | ``transformer.h.{i}.attn.c_attn.*``            |
| ``decoder.layers.{i}.self_attention.linear_proj.*``    | ``transformer.h.{i}.attn.c_proj.*``            |
| ``decoder.layers.{i}.pre_mlp_layernorm.*``             | ``transformer.h.{i}.ln_2.*``                   |
| ``decoder.layers.{i}.mlp.linear_fc1.*``                | ``transformer.h.{i}.mlp.c_fc.*``               |
| ``decoder.layers.{i}.mlp.linear_fc2.*``                | ``transformer.h.{i}.mlp.c_proj.*``             |
| ``decoder.final_layernorm.*``                          | ``transformer.ln_f.*``                         |
| ``output_layer.weight`` (tied: the embeddings)         | ``lm_head.weight``                             |
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zckpt.checkpoint import Checkpoint
from zckpt.formats.megatron.hf.family import HfExport, common_refusal, rebuild
from zckpt.model import TensorEntry

FAMILY = "gpt2-style (GPTBigCode)"
_LAYER = {
    "input_layernorm": "ln_1",
    "self_attention.linear_qkv": "attn.c_attn",
    "self_attention.linear_proj": "attn.c_proj",
    "pre_mlp_layernorm": "ln_2",
    "mlp.linear_fc1": "mlp.c_fc",
    "mlp.linear_fc2": "mlp.c_proj",
}


def unsupported(cfg: Mapping[str, Any]) -> str | None:
    why = common_refusal(cfg)
    if why is not None:
        return why
    if cfg.get("normalization") != "LayerNorm":
        return f"normalization {cfg.get('normalization')} (needs LayerNorm)"
    if cfg.get("activation") not in ("gelu", "gelu_new"):
        return f"activation {cfg.get('activation')} (needs gelu)"
    if cfg.get("position_embedding_type") != "learned_absolute":
        return f"position embedding {cfg.get('position_embedding_type')} (needs learned_absolute)"
    if not cfg.get("add_bias_linear"):
        return "no linear biases (GPTBigCode has them)"
    groups, heads = cfg.get("num_query_groups"), cfg.get("num_attention_heads")
    if groups not in (1, heads):
        return f"{groups} query groups of {heads} heads (needs one per head, or one)"
    if cfg.get("kv_channels", 0) * (heads or 0) != cfg.get("hidden_size"):
        return "kv_channels x heads != hidden_size"
    return None


def export(ckpt: Checkpoint, cfg: Mapping[str, Any]) -> HfExport:
    def same(src: str, name: str) -> TensorEntry:
        e = ckpt.entry(src)
        return TensorEntry(name, e.shape, e.dtype, e.role, e.pieces)

    out = [same("embedding.word_embeddings.weight", "transformer.wte.weight")]
    out.append(same("embedding.position_embeddings.weight", "transformer.wpe.weight"))
    for i in range(cfg["num_layers"]):
        for m, h in _LAYER.items():
            for s in ("weight", "bias"):
                src = f"decoder.layers.{i}.{m}.{s}"
                if src in ckpt.entries:
                    out.append(same(src, f"transformer.h.{i}.{h}.{s}"))
    out += [same(f"decoder.final_layernorm.{s}", f"transformer.ln_f.{s}") for s in ("weight", "bias")]
    tied: dict[str, str] = {}
    if "output_layer.weight" in ckpt.entries:
        out.append(same("output_layer.weight", "lm_head.weight"))
    else:
        tied = {"lm_head.weight": "transformer.wte.weight"}
    config = {
        "architectures": ["GPTBigCodeForCausalLM"],
        "model_type": "gpt_bigcode",
        "vocab_size": ckpt.entry("embedding.word_embeddings.weight").shape[0],
        "n_positions": cfg["max_position_embeddings"],
        "n_embd": cfg["hidden_size"],
        "n_layer": cfg["num_layers"],
        "n_head": cfg["num_attention_heads"],
        "n_inner": cfg["ffn_hidden_size"],
        "activation_function": "gelu_pytorch_tanh" if cfg["activation"] == "gelu_new" else "gelu",
        "layer_norm_epsilon": cfg["norm_epsilon"],
        "multi_query": cfg["num_query_groups"] == 1 and cfg["num_attention_heads"] > 1,
        "scale_attn_weights": True,
        "attention_softmax_in_fp32": True,
        "scale_attention_softmax_in_fp32": True,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "tie_word_embeddings": bool(tied),
        "bos_token_id": None,  # GPTBigCode's defaults (50256) lie outside a small vocab; args name none
        "eos_token_id": None,
    }  # fmt: skip
    return HfExport(rebuild(ckpt, out, tied), config)
