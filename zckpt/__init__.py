"""zckpt: read, consolidate, reshard, diff and verify sharded training checkpoints.

Library API (each CLI command is also a function here)::

    import zckpt
    ckpt = zckpt.open("out/")            # lazy: metadata only
    w = ckpt["emb.weight"]               # reads that one tensor
    zckpt.consolidate("out/", "model.safetensors", dtype="bf16")

The public names are ``__all__``; errors are in ``zckpt.errors`` (every one a ``ZckptError``, and where a
builtin means the same, also that builtin: ``KeyError``, ``ValueError``, ``FileNotFoundError``,
``PermissionError``). Names are bound on first use (``__getattr__``), so ``import zckpt.partition`` (pure
math the engine needs) loads nothing else.

``_guard_startup`` installs a SIGINT handler that turns Ctrl-C during the command line's start-up into one
line and exit status 130 (no traceback) until a command has imported torch and restores Python's own
(``zckpt.cli.app._leave_startup``): at once when run as ``python -m zckpt...`` (``sys.argv[0] == "-m"`` while
runpy imports this package), and from the console script's ``zckpt.cli.main``.
"""

# no ``from __future__ import annotations``: it would bind ``annotations`` in the public namespace
import os as _os
import signal as _signal
import sys as _sys


def _startup_interrupt(signum: int, frame: object) -> None:
    """SIGINT before the command line is running: one line, exit 130, nothing written yet."""
    _os.write(2, b"error: interrupted; nothing was written\n")
    _os._exit(130)


def _guard_startup() -> None:
    """Ctrl-C from now until the command line runs is ``_startup_interrupt`` (unless SIGINT is handled
    already, or ignored)."""
    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
        _signal.signal(_signal.SIGINT, _startup_interrupt)


if _sys.argv[:1] == ["-m"]:
    _guard_startup()

import importlib as _importlib  # noqa: E402
import typing as _typing  # noqa: E402

__version__ = "0.1.0"

_LAZY: dict[str, tuple[str, str]] = {
    "open": ("zckpt.formats", "open_checkpoint"),
    "Checkpoint": ("zckpt.checkpoint", "Checkpoint"),
    "CheckpointMeta": ("zckpt.state", "CheckpointMeta"),
    "TrainingState": ("zckpt.state", "TrainingState"),
    "Role": ("zckpt.model", "Role"),
    "TensorEntry": ("zckpt.model", "TensorEntry"),
    "ZckptError": ("zckpt.errors", "ZckptError"),
    "errors": ("zckpt.errors", ""),
    "consolidate": ("zckpt.ops.consolidate", "consolidate"),
    "diff": ("zckpt.ops.diff", "diff"),
    "diff_series": ("zckpt.ops.series", "diff_series"),
    "inspect": ("zckpt.ops.inspect", "inspect"),
    "reshard": ("zckpt.ops.reshard", "reshard"),
    "verify": ("zckpt.ops.verify", "verify"),
    "Storage": ("zckpt.storage.session", "Storage"),
}
__all__ = [
    "Checkpoint", "CheckpointMeta", "Role", "Storage", "TensorEntry", "TrainingState", "ZckptError",
    "consolidate", "diff", "diff_series", "errors", "inspect", "open", "reshard", "verify",
]  # fmt: skip

if _typing.TYPE_CHECKING:
    from zckpt import errors
    from zckpt.checkpoint import Checkpoint
    from zckpt.errors import ZckptError
    from zckpt.formats import open_checkpoint as open  # noqa: A004
    from zckpt.model import Role, TensorEntry
    from zckpt.ops.consolidate import consolidate
    from zckpt.ops.diff import diff
    from zckpt.ops.inspect import inspect
    from zckpt.ops.reshard import reshard
    from zckpt.ops.series import diff_series
    from zckpt.ops.verify import verify
    from zckpt.state import CheckpointMeta, TrainingState
    from zckpt.storage.session import Storage


def __getattr__(name: str) -> object:
    """Bind a public name on first use (PEP 562), importing only its module."""
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'zckpt' has no attribute {name!r}") from None
    mod = _importlib.import_module(module)
    value = getattr(mod, attr) if attr else mod
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names and the module's dunders (no private helpers, no typing imports)."""
    return sorted({*__all__, *(n for n in globals() if n.startswith("__"))})
