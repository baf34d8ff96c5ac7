"""Where a tensor sits in a picture: its layer (``model.layers.12.…``) and its role in the layer (q/k/v/o,
fused qkv, MLP gate/up/down, norms, …), from its name alone.

Both are data tables read by one function, ``place``: ``LAYER_STACKS`` names the containers whose numbered
children are layers (``layers.12.``, ``h.12.``, ``blocks.12.``); ``ROLE_RULES`` maps module paths inside a
layer to a role, first matching rule wins (MLP-qualified names come before attention's, whose ``c_proj`` /
``proj`` / ``dense`` they share). A name inside a layer that no rule knows goes to the ``other`` column, and
a name outside every layer stack keeps its module path (``lm_head``, ``transformer.wte``): nothing is
dropped. Optimizer-state keys (``name:state``) are placed by their parameter's name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import lru_cache

from zckpt.model import STATE_SEP

LAYER_STACKS: tuple[str, ...] = (
    "layers", "layer", "h", "blocks", "block", "blk", "resblocks", "transformer_blocks", "decoder_layers",
)  # fmt: skip
"""Container names whose ``.<N>.`` children are layers (HF ``model.layers``/``transformer.h``/BERT
``encoder.layer``, nanoGPT/timm ``blocks``, torchtitan ``layers``, CLIP ``resblocks``)."""

OTHER = "other"

ROLE_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # MoE first: experts hold their own w1/w2/w3 and up/down projections
    ("experts", ("experts", "shared_expert", "shared_experts")),
    ("router", ("block_sparse_moe.gate", "mlp.gate", "router", "moe.gate")),
    # attention's output projection where its name contains an MLP name (BERT's output.dense)
    ("o", ("attention.output.dense", "attention.dense", "attn.c_proj", "attn.proj", "self_attn.dense",
           "attention.wo")),
    # MLP names that attention shares (c_proj, proj, dense, wo) qualified by their MLP parent
    ("down", ("output.dense", "mlp.c_proj", "mlp.proj", "mlp.dense_4h_to_h", "mlp.fc2", "mlp.fc_out",
              "DenseReluDense.wo", "feed_forward.w2", "ffn.w2", "mlp.w2")),
    ("up", ("intermediate.dense", "mlp.c_fc", "mlp.fc", "mlp.fc1", "mlp.dense_h_to_4h", "feed_forward.w3",
            "ffn.w3", "mlp.w3", "DenseReluDense.wi")),
    ("gate", ("feed_forward.w1", "ffn.w1", "mlp.w1", "DenseReluDense.wi_0")),
    # attention
    ("qkv", ("qkv", "qkv_proj", "c_attn", "query_key_value", "Wqkv", "wqkv", "in_proj", "in_proj_weight")),
    ("q", ("q_proj", "query", "wq", "q_lin", "q")),
    ("k", ("k_proj", "key", "wk", "k_lin", "k")),
    ("v", ("v_proj", "value", "wv", "v_lin", "v")),
    ("o", ("o_proj", "out_proj", "wo", "out_lin", "proj", "c_proj", "o", "dense")),
    # MLP
    ("gate_up", ("gate_up_proj",)),
    ("gate", ("gate_proj", "w1", "wi_0")),
    ("up", ("up_proj", "c_fc", "fc1", "fc", "fc_in", "dense_h_to_4h", "w3", "wi", "wi_1", "lin1")),
    ("down", ("down_proj", "fc2", "fc_out", "dense_4h_to_h", "w2", "out", "lin2")),
    # norms: before attention, before the MLP, any other
    ("attn_norm", ("ln_1", "ln1", "input_layernorm", "attention_norm", "norm1", "attn_norm",
                   "self_attn_layer_norm", "attention.output.LayerNorm", "sa_layer_norm")),
    ("mlp_norm", ("ln_2", "ln2", "post_attention_layernorm", "ffn_norm", "norm2", "mlp_norm",
                  "final_layer_norm", "output.LayerNorm", "output_layer_norm", "pre_feedforward_layernorm")),
    ("norm", ("norm", "layernorm", "layer_norm", "LayerNorm", "ln", "q_norm", "k_norm", "ln_attn", "ln_mlp",
              "post_feedforward_layernorm")),
)  # fmt: skip
"""``(role, module paths)``: a rule matches when one of its dotted paths occurs in the name after the layer
index as whole segments (``mlp.c_proj`` matches ``mlp.c_proj.weight``, not ``mlp.c_proj_x``)."""

ROLE_ORDER: tuple[str, ...] = (
    "q", "k", "v", "qkv", "o", "attn_norm", "gate", "up", "gate_up", "down", "mlp_norm", "norm", "router",
    "experts", OTHER,
)  # fmt: skip
"""Column order of a layer × role grid (only the roles present are drawn)."""

_STACK_RE = re.compile(r"(?:^|\.)(" + "|".join(map(re.escape, LAYER_STACKS)) + r")\.(\d+)(?:\.|$)")
_RULES = tuple(
    (role, re.compile(r"(?:^|\.)(?:" + "|".join(re.escape(p) for p in paths) + r")(?:\.|$)"))
    for role, paths in ROLE_RULES
)
_PARAM_SUFFIXES = ("weight", "bias", "scale", "gamma", "beta", "g", "b")


@dataclass(frozen=True)
class Place:
    """Where one tensor goes: ``layer`` (``None`` outside every layer stack) of ``stack``, and ``column``
    (a role of ``ROLE_ORDER`` inside a layer, the module path outside)."""

    stack: str | None
    layer: int | None
    column: str


@lru_cache(maxsize=65536)
def place(key: str) -> Place:
    """The ``Place`` of a tensor key (an optimizer state's key is placed by its parameter's name)."""
    name = key.split(STATE_SEP, 1)[0]
    m = _STACK_RE.search(name)
    if m is None:
        return Place(None, None, module_of(name))
    stack = name[: m.end(1)]
    rest = name[m.end() :]
    for role, rx in _RULES:
        if rx.search(rest):
            return Place(stack, int(m.group(2)), role)
    return Place(stack, int(m.group(2)), OTHER)


def module_of(name: str) -> str:
    """``lm_head.weight`` -> ``lm_head``; a name without a parameter suffix is its own module."""
    head, dot, last = name.rpartition(".")
    return head if dot and last in _PARAM_SUFFIXES else name


def row_label(stack: str, layer: int, stacks: int) -> str:
    """A layer's row label: its index alone when the model has one layer stack, else ``stack.N``."""
    return str(layer) if stacks == 1 else f"{stack}.{layer}"


def shown(path: object) -> str:
    """A checkpoint's path as a figure shows it: relative to the working folder when it lies inside it
    (``out/global_step40``, not the machine's absolute path), else as given."""
    p = str(path)
    if os.path.isabs(p):
        rel = os.path.relpath(p)
        if not rel.startswith(".."):
            return rel
    return p


MAX_LABEL = 48
"""Characters of a tensor name shown in a picture."""


def short(text: str, n: int = MAX_LABEL) -> str:
    """Cut long names from the left (their end says most: ``...layers.31.mlp.down_proj.weight``)."""
    return text if len(text) <= n else "…" + text[-(n - 1) :]
