"""torch.distributed.checkpoint (DCP) checkpoints: read lazily without running pickle code, verified, written.

Spec of the files: docs/dcp-format.md. One module per concern:

- ``metadata``: ``.metadata`` through the bounded unpickler into ``standins`` (DCP's classes), typed;
- ``chunks``: each item's bytes inside its ``.distcp`` file (embedded torch.save archives, safetensors blobs);
- ``boxes``: chunk boxes -> ``Piece`` (``grid`` for boxes cut along inner dimensions), the tiling check;
- ``values``: bytes items (param-group fields, scheduler, train state) decoded or kept opaque;
- ``layout``: which folders make a checkpoint (torchtitan ``step-N``, accelerate pairs, HF shards) and what
  each flattened key is; ``hfshards``: ``HuggingFaceStorageWriter`` folders;
- ``read`` / ``state``: entries, roles, ties and the ``TrainingState``;
- ``verify``: chunk files present, items inside their files, every archive's CRC-32, tiling, stray files;
- ``pickler`` / ``write``: ``zckpt reshard --to dcp`` (torchtitan layout, ``.metadata`` written last).
"""

from __future__ import annotations

import functools

from zckpt.checkpoint import Checkpoint
from zckpt.formats.base import CheckpointWriter, Format
from zckpt.formats.dcp import layout
from zckpt.storage.location import Location
from zckpt.stream.integrity import Problem, VerifyContext


class DcpFormat(Format):
    name = layout.NAME  # the reader, writer and checks are imported when used: detecting needs none
    training = True

    @functools.cached_property
    def writer(self) -> CheckpointWriter:
        from zckpt.formats.dcp.write import DcpWriter

        return DcpWriter()

    def detect(self, path: Location) -> bool:
        return layout.detect(path)

    def read(self, path: Location, *, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
        from zckpt.formats.dcp import read

        return read.read(path, tag=tag, trust_pickle=trust_pickle)

    def read_model(self, path: Location, *, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
        from zckpt.formats.dcp import read

        return read.read(path, tag=tag, trust_pickle=trust_pickle, model_only=True)

    def verify(self, path: Location, ckpt: Checkpoint | None, ctx: VerifyContext) -> list[Problem]:
        from zckpt.formats.dcp.verify import verify

        return verify(path, ckpt, ctx)


FORMAT = DcpFormat()
__all__ = ["FORMAT", "DcpFormat"]
