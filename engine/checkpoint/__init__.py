"""Checkpoints of an ``Engine``: ``save`` writes the native format (docs/native-format.md, read by
``zckpt.formats.native``), synchronously or in the background; ``load`` restores from a native *or a real
DeepSpeed ZeRO-1/2/3* checkpoint saved at any world size, stage and precision.

- ``content``: what one save holds, captured when ``save_checkpoint`` is called (``RankSave``);
- ``save``: the save protocol (staging folder, each rank's file through the native format's one writer,
  ``zckpt.formats.native.write``, rank 0 publishing once every rank succeeded, ``latest`` last);
- ``ds_layout``: ``"checkpoint": {"format": "deepspeed"}``: DeepSpeed's own files instead, through zckpt's
  DeepSpeed writer, with the same protocol (sync or background);
- ``async_save``: ``checkpoint.writer.decoupled``: snapshot, background write, error surfacing;
- ``host``: the reusable (pinned) host memory a snapshot lives in;
- ``load``: restoring an engine; ``reads``: its tensor reads, batched at disk speed;
- the optimizer half of loading lives in ``engine.checkpoint_optim``.
"""

from __future__ import annotations

from engine.checkpoint.content import staging_dir, training_state
from engine.checkpoint.load import load
from engine.checkpoint.save import CheckpointSaveError, save
from engine.checkpoint_optim import CheckpointMismatch

__all__ = ["CheckpointMismatch", "CheckpointSaveError", "load", "save", "staging_dir", "training_state"]
