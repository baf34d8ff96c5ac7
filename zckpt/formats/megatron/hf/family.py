"""What every HF architecture family of a Megatron export shares: the result, the rebuild, common refusals."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from zckpt.checkpoint import Checkpoint
from zckpt.model import TensorEntry


@dataclass(frozen=True)
class HfExport:
    """The HF-named checkpoint (its ``meta.tied``: ``{"lm_head.weight": embeddings}`` when tied) and the
    ``config.json`` to write beside its weights (``dtype`` set by the writer)."""

    checkpoint: Checkpoint
    config: Mapping[str, Any]


def rebuild(ckpt: Checkpoint, entries: list[TensorEntry], tied: dict[str, str]) -> Checkpoint:
    """A checkpoint of ``entries`` with ``ckpt``'s manifest (ties replaced)."""
    meta = replace(ckpt.meta, tied=tied, tied_files={})
    return Checkpoint(meta, entries)


def common_refusal(cfg: Mapping[str, Any]) -> str | None:
    """What no family maps (experts, MLA, QK layer norms, zero-centred gamma, post-LN residuals)."""
    if cfg.get("num_experts"):
        return "mixture of experts"
    if cfg.get("multi_latent_attention"):
        return "multi-latent attention"
    if cfg.get("qk_layernorm"):
        return "QK layer norms"
    if cfg.get("zero_centered_gamma"):
        return "zero-centred layer-norm gamma"
    if cfg.get("post_layernorm_residual"):
        return "residual taken after the layer norm"
    return None
