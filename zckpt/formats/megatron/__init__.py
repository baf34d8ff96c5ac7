"""Megatron-Core ``torch_dist`` checkpoints (Megatron-LM, NeMo, Megatron-Bridge): read without Megatron.

Spec: docs/megatron.md. One module per concern:

- ``layout``: save folders (``latest_checkpointed_iteration.txt``) and iteration folders (``iter_NNNNNNN``,
  ``release``);
- ``standins`` / ``common``: ``common.pt`` (``args``, iteration, optimizer groups and sharding type) through
  the allowlisted unpickler; ``.metadata``'s extra ``all_local_plans`` are DCP stand-ins
  (``zckpt.formats.dcp.standins``);
- ``config``: the model and parallel layout from ``args``;
- ``read``: unstacked TP1/PP1 names, roles, fp32 masters and Adam moments; ``flat``: the distributed
  optimizer's ``dp_reshardable`` flat buckets; ``carve``: pieces of parts of stored tensors;
- ``verify``: DCP's item checks plus ``common.pt`` and stray files;
- ``hf``: the Hugging Face export (one module per architecture family).
"""

from __future__ import annotations

from collections.abc import Mapping

from zckpt.checkpoint import Checkpoint
from zckpt.errors import ZckptError
from zckpt.formats.base import Format
from zckpt.formats.megatron import layout
from zckpt.storage.location import Location, location
from zckpt.stream.integrity import Problem, VerifyContext


class MegatronFormat(Format):
    name = layout.NAME  # the reader, checks and HF export are imported when used: detecting needs none
    training = True

    def detect(self, path: Location) -> bool:
        return layout.detect(path)

    def read(self, path: Location, *, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
        from zckpt.formats.megatron import read

        return read.open_megatron(path, tag=tag, trust_pickle=trust_pickle)[0]

    def read_model(self, path: Location, *, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
        from zckpt.formats.megatron import read

        return read.open_megatron(path, tag=tag, trust_pickle=trust_pickle, model_only=True)[0]

    def verify(self, path: Location, ckpt: Checkpoint | None, ctx: VerifyContext) -> list[Problem]:
        try:
            folder = layout.resolve(path, ctx.tag).folder if ckpt is None else location(ckpt.meta.path)
        except ZckptError:
            return []  # the reader's own error is already reported
        from zckpt.formats.megatron.verify import verify

        return verify(folder, ctx)

    def hf_model(self, ckpt: Checkpoint) -> tuple[Checkpoint, Mapping[str, object]] | None:
        from zckpt.formats.megatron import hf

        out = hf.export(ckpt)
        return out.checkpoint, out.config


FORMAT = MegatronFormat()
__all__ = ["FORMAT", "MegatronFormat"]
