"""Megatron GPT checkpoints as Hugging Face models: one module per architecture family (docs/megatron.md).

``export(ckpt)`` takes a Megatron-named ``Checkpoint`` (``zckpt.formats.megatron.read``) and gives an
``HfExport``: a ``Checkpoint`` of the HF names whose entries are pieces of the Megatron tensors (fused QKV
split per query group, ``[gate; up]`` split: ``carve``; nothing is read), and the ``config.json`` built from
``args``. Each family says what it cannot map; a model no family takes is refused with every family's reason
(the Megatron-named output, to a ``.safetensors`` file, still works).
"""

from __future__ import annotations

from zckpt.checkpoint import Checkpoint
from zckpt.errors import Unsupported
from zckpt.formats.megatron.hf import gpt_bigcode, llama
from zckpt.formats.megatron.hf.family import HfExport

FAMILIES = (llama, gpt_bigcode)


def export(ckpt: Checkpoint) -> HfExport:
    """``ckpt`` as an HF model of the first family that maps it; ``Unsupported`` naming why none does."""
    cfg = ckpt.meta.state.config or {}
    reasons = []
    for fam in FAMILIES:
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


__all__ = ["FAMILIES", "HfExport", "export"]
