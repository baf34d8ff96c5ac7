"""zckpt: read, consolidate, reshard, diff and verify sharded training checkpoints.

Library API (each CLI command is also a function here)::

    import zckpt
    ckpt = zckpt.open("out/")            # lazy: metadata only
    w = ckpt["emb.weight"]               # reads that one tensor
    zckpt.consolidate("out/", "model.safetensors", dtype="bf16")
"""

from __future__ import annotations

from zckpt.errors import ZckptError
from zckpt.formats import open_checkpoint as open
from zckpt.model import Checkpoint, CheckpointMeta, Role, TensorEntry

__all__ = ["Checkpoint", "CheckpointMeta", "Role", "TensorEntry", "ZckptError", "open", "consolidate",
           "inspect", "reshard", "diff", "verify"]  # fmt: skip
__version__ = "0.1.0"


# Each command function is bound eagerly, after everything above: importing submodule `zckpt.X`
# sets the package attribute `X` to the *module*, which would shadow a lazy `__getattr__`; the
# from-import rebinds the name to the function. (Use `from zckpt.X import ...` for the module.)
from zckpt.consolidate import consolidate  # noqa: E402
from zckpt.diff import diff  # noqa: E402
from zckpt.inspect import inspect  # noqa: E402
from zckpt.reshard import reshard  # noqa: E402
from zckpt.verify import verify  # noqa: E402
