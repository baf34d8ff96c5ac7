"""DeepSpeed checkpoints (``DeepSpeedEngine.save_checkpoint``): ZeRO-0/1/2/3 and BF16_Optimizer, read and
written without importing deepspeed (layout facts: ../shared/docs/deepspeed-format.md).

``files`` locates the tag folder and its rank files; ``read`` builds the checkpoint, with the layouts in
``zero0`` / ``zero12`` / ``zero3`` and the helpers they share in ``common``; ``write`` writes ZeRO-1/2/3
for any world size (``layout``: the math, ``archive``: torch.save archives of lazy tensors).
"""

from __future__ import annotations

import functools

from zckpt.checkpoint import Checkpoint
from zckpt.formats.base import CheckpointWriter, Format
from zckpt.formats.deepspeed.files import detect
from zckpt.formats.deepspeed.read import read  # the package's ``read`` (callers use it): not lazy
from zckpt.storage.location import Location
from zckpt.stream.integrity import Problem, VerifyContext


class DeepSpeedFormat(Format):
    name = "deepspeed"
    training = True

    @functools.cached_property
    def writer(self) -> CheckpointWriter:
        from zckpt.formats.deepspeed.write import DeepSpeedWriter

        return DeepSpeedWriter()

    def detect(self, path: Location) -> bool:
        return detect(path)

    def read(self, path: Location, *, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
        return read(path, tag=tag, trust_pickle=trust_pickle)

    def verify(self, path: Location, ckpt: Checkpoint | None, ctx: VerifyContext) -> list[Problem]:
        """Every rank file written by the same DeepSpeed version (when the reader itself failed)."""
        versions: dict[str, str] = {}
        for f, obj in ctx.pickles.items():
            if isinstance(obj, dict):
                v = obj.get("ds_version")
                if v is None and isinstance(obj.get("optimizer_state_dict"), dict):
                    v = obj["optimizer_state_dict"].get("ds_version")
                if isinstance(v, str):
                    versions[f] = v
        if len(set(versions.values())) <= 1:
            return []
        common = max(set(versions.values()), key=list(versions.values()).count)
        return [
            Problem(
                f, f"written by DeepSpeed {v}, the other rank files by {common}", "stale", "two runs mixed"
            )
            for f, v in sorted(versions.items())
            if v != common
        ]


FORMAT = DeepSpeedFormat()
__all__ = ["FORMAT", "DeepSpeedFormat"]
