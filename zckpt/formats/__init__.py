"""Registry of on-disk formats. One module per format, each exposing the same small interface:

``NAME: str``, ``detect(path) -> bool`` (cheap: names and headers only) and
``read(path, *, tag=None, trust_pickle=False) -> Checkpoint``; writers add functions of their own
(``write_*``). Adding a format means adding a module here and a line to ``_MODULES`` — never an elif.
Order matters: more specific layouts are detected first.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from zckpt.checkpoint import Checkpoint
from zckpt.errors import UnknownFormat

_MODULES = (
    "zckpt.formats.native",
    "zckpt.formats.deepspeed",
    "zckpt.formats.dcp",
    "zckpt.formats.hf",
    "zckpt.formats.torch_file",
)


def registry() -> dict[str, ModuleType]:
    """Format name -> module, for the modules that exist in this build."""
    out: dict[str, ModuleType] = {}
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        out[mod.NAME] = mod
    return out


def detect(path: str | Path) -> ModuleType:
    """The format module that recognises ``path``."""
    p = Path(path)
    if not p.exists():
        raise UnknownFormat(f"{p}: no such file or folder", path=str(p))
    for mod in registry().values():
        if mod.detect(p):
            return mod
    hint = (
        "give the folder that holds `latest` (or a tag folder), a .safetensors/.bin/.pt file or an HF folder"
    )
    if p.is_dir() and not any(p.iterdir()):
        raise UnknownFormat(f"{p}: the folder is empty", hint=hint, path=str(p))
    if p.is_dir():  # one level too high: name the checkpoints inside
        mods = registry().values()
        inner = [d for d in sorted(p.iterdir()) if d.is_dir() and any(m.detect(d) for m in mods)]
        if inner:
            names = ", ".join(d.name for d in inner[:5]) + (", ..." if len(inner) > 5 else "")
            raise UnknownFormat(f"{p}: not a checkpoint, but holds {len(inner)} ({names})",
                                hint=f"give one of them, e.g. {inner[-1]}", path=str(p))  # fmt: skip
    raise UnknownFormat(f"{p}: not a checkpoint zckpt recognises", hint=hint, path=str(p))


def open_checkpoint(
    path: str | Path, *, tag: str | None = None, format: str | None = None, trust_pickle: bool = False
) -> Checkpoint:
    """Open any supported checkpoint lazily (metadata only; tensors are read on access)."""
    if format is not None:
        reg = registry()
        if format not in reg:
            raise UnknownFormat(f"unknown format {format!r}; known: {', '.join(reg)}")
        mod = reg[format]
    else:
        mod = detect(path)
    ckpt: Checkpoint = mod.read(Path(path), tag=tag, trust_pickle=trust_pickle)
    return ckpt
