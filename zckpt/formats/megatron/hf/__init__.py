"""Megatron GPT checkpoints as Hugging Face models: one module per architecture family (docs/megatron.md).

``export(ckpt)`` takes a Megatron-named ``Checkpoint`` (``zckpt.formats.megatron.read``) and gives an
``HfExport``: a ``Checkpoint`` of the HF names whose entries are pieces of the Megatron tensors (fused QKV
split per query group, ``[gate; up]`` split: ``carve``; nothing is read), and the ``config.json`` built from
``args``. Each family says what it cannot map; a model no family takes is refused with every family's reason
(the Megatron-named output, to a ``.safetensors`` file, still works).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from zckpt.checkpoint import Checkpoint
from zckpt.errors import Unsupported
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


def export(ckpt: Checkpoint) -> HfExport:
    """``ckpt`` as an HF model of the first family that maps it; ``Unsupported`` naming why none does."""
    from zckpt.formats.megatron.hf import gpt_bigcode, llama

    cfg = ckpt.meta.state.config or {}
    reasons = []
    for fam in (llama, gpt_bigcode):
        why = fam.unsupported(cfg)
        if why is None:
            return fam.export(ckpt, cfg)
        reasons.append(f"{fam.FAMILY}: {why}")
    raise Unsupported(
        f"{ckpt.meta.path}: no Hugging Face architecture zckpt maps this Megatron model to "
        f"({'; '.join(reasons)})",
        hint="write Megatron's own names instead: zckpt consolidate CKPT model.safetensors",
        path=ckpt.meta.path,
    )


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
