"""The model and parallel layout a Megatron checkpoint was saved with, from ``common.pt``'s ``args``.

Megatron writes no model config of its own: the GPT model is rebuilt from the training arguments. Only the
arguments that decide tensor names, shapes and layouts are read; a missing one takes Megatron-LM's default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zckpt import dtypes
from zckpt.dtypes import DType
from zckpt.errors import CorruptCheckpoint


@dataclass(frozen=True)
class ModelConfig:
    """A Megatron GPT model's architecture (names as Megatron-LM's arguments)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int | None
    padded_vocab_size: int
    max_position_embeddings: int
    normalization: str
    norm_epsilon: float
    position_embedding_type: str
    rotary_base: float
    rotary_percent: float
    swiglu: bool
    add_bias_linear: bool
    add_qkv_bias: bool
    tied: bool
    qk_layernorm: bool
    activation: str
    """``swiglu``, ``gelu`` (tanh approximation when ``openai_gelu``: ``gelu_new``), ``squared_relu``..."""
    num_experts: int | None
    multi_latent_attention: bool
    zero_centered_gamma: bool
    post_layernorm_residual: bool
    params_dtype: DType


@dataclass(frozen=True)
class Parallel:
    """How the run was split when it saved."""

    tp: int
    pp: int
    dp: int
    world: int
    vpp: int | None
    ep: int
    distributed_optimizer: bool
    precision: str
    """``bf16``, ``fp16`` or ``fp32``: the model's training dtype."""


def _get(args: Mapping[str, Any], src: str, name: str, kind: type, default: Any = None) -> Any:
    v = args.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, kind) and not (kind is int and isinstance(v, bool))
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if not ok:
        raise CorruptCheckpoint(f"{src}: args.{name} is {v!r:.40}, not a {kind.__name__}", path=src)
    return v


def _pos(args: Mapping[str, Any], src: str, name: str, default: int | None = None) -> int:
    v = _get(args, src, name, int, default)
    if v is None or v <= 0:
        raise CorruptCheckpoint(
            f"{src}: args.{name} is {args.get(name)!r:.40}; a positive int is needed",
            hint="the model's shapes are read from common.pt's args",
            path=src,
        )
    return int(v)


def model_config(args: Mapping[str, Any], src: str) -> ModelConfig:
    heads = _pos(args, src, "num_attention_heads")
    hidden = _pos(args, src, "hidden_size")
    gqa = bool(args.get("group_query_attention"))
    groups = _pos(args, src, "num_query_groups", heads) if gqa else heads
    kv = _get(args, src, "kv_channels", int, None) or hidden // heads
    swiglu = bool(args.get("swiglu"))
    if swiglu:
        act = "swiglu"
    elif args.get("squared_relu"):
        act = "squared_relu"
    elif args.get("quick_geglu"):
        act = "quick_geglu"
    else:
        act = "gelu_new" if args.get("openai_gelu") else "gelu"
    padded = _pos(args, src, "padded_vocab_size")
    vocab = _get(args, src, "vocab_size", int, None)
    dt = args.get("params_dtype")
    if not isinstance(dt, DType):
        dt = dtypes.bfloat16 if args.get("bf16") else dtypes.float16 if args.get("fp16") else dtypes.float32
    if heads % groups:
        raise CorruptCheckpoint(f"{src}: args.num_attention_heads {heads} is not a multiple of "
                                f"num_query_groups {groups}", path=src)  # fmt: skip
    return ModelConfig(
        num_layers=_pos(args, src, "num_layers"),
        hidden_size=hidden,
        ffn_hidden_size=_pos(args, src, "ffn_hidden_size", 4 * hidden),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=int(kv),
        vocab_size=vocab if vocab and vocab <= padded else None,
        padded_vocab_size=padded,
        max_position_embeddings=_get(args, src, "max_position_embeddings", int, 0) or 0,
        normalization=_get(args, src, "normalization", str, "LayerNorm"),
        norm_epsilon=_get(args, src, "layernorm_epsilon", float, None)
        or _get(args, src, "norm_epsilon", float, 1e-5),
        position_embedding_type=_get(args, src, "position_embedding_type", str, "learned_absolute"),
        rotary_base=_get(args, src, "rotary_base", float, 10000.0),
        rotary_percent=_get(args, src, "rotary_percent", float, 1.0),
        swiglu=swiglu,
        add_bias_linear=bool(args.get("add_bias_linear", True)),
        add_qkv_bias=bool(args.get("add_qkv_bias", False)),
        tied=not bool(args.get("untie_embeddings_and_output_weights")),
        qk_layernorm=bool(args.get("qk_layernorm")),
        activation=act,
        num_experts=_get(args, src, "num_experts", int, None),
        multi_latent_attention=bool(args.get("multi_latent_attention")),
        zero_centered_gamma=bool(args.get("layernorm_zero_centered_gamma")),
        post_layernorm_residual=bool(args.get("apply_residual_connection_post_layernorm")),
        params_dtype=dt,
    )


def parallel(args: Mapping[str, Any], src: str) -> Parallel:
    tp = _pos(args, src, "tensor_model_parallel_size", 1)
    pp = _pos(args, src, "pipeline_model_parallel_size", 1)
    world = _pos(args, src, "world_size", 1)
    cp = _pos(args, src, "context_parallel_size", 1)
    dp = _get(args, src, "data_parallel_size", int, None) or max(1, world // (tp * pp * cp))
    prec = "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "fp32"
    return Parallel(
        tp=tp,
        pp=pp,
        dp=int(dp),
        world=world,
        vpp=_get(args, src, "virtual_pipeline_model_parallel_size", int, None),
        ep=_pos(args, src, "expert_model_parallel_size", 1),
        distributed_optimizer=bool(args.get("use_distributed_optimizer")),
        precision=prec,
    )


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape ``args`` give each (unstacked) parameter name suffix: what ``check_shapes`` compares."""
    h, kv, ffn = cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size
    qkv = kv * (cfg.num_attention_heads + 2 * cfg.num_query_groups)
    fc1 = ffn * (2 if cfg.swiglu else 1)
    return {
        "embedding.word_embeddings.weight": (cfg.padded_vocab_size, h),
        "embedding.position_embeddings.weight": (cfg.max_position_embeddings, h),
        "output_layer.weight": (cfg.padded_vocab_size, h),
        "layernorm.weight": (h,),
        "layernorm.bias": (h,),
        "linear_qkv.weight": (qkv, h),
        "linear_qkv.bias": (qkv,),
        "linear_proj.weight": (h, cfg.num_attention_heads * kv),
        "linear_proj.bias": (h,),
        "linear_fc1.weight": (fc1, h),
        "linear_fc1.bias": (fc1,),
        "linear_fc2.weight": (h, ffn),
        "linear_fc2.bias": (h,),
    }


def check_shapes(cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]], src: str) -> None:
    """Every known parameter's shape is the one ``args`` give (a ``common.pt`` of another model, or damaged
    args, would otherwise split tensors wrongly: QKV per group, ``[gate; up]``, flat buckets)."""
    want = expected_shapes(cfg)
    for name, shape in shapes.items():
        key = next((k for k in want if name.endswith(k)), None)
        if key is None or name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
            continue
        if shape != want[key]:
            raise CorruptCheckpoint(
                f"{src}: {name} has shape {list(shape)}, but common.pt's args give {list(want[key])}",
                hint="common.pt does not belong to these tensors (files of two saves mixed, or damaged args)",
                path=src,
            )
