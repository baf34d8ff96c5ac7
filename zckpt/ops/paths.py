"""Where outputs may go (never over, inside or around the input they are made from), and what an input is
called in reports."""

from __future__ import annotations

import os
from pathlib import Path

from zckpt.errors import OutputExists
from zckpt.state import CheckpointMeta
from zckpt.storage.location import Location, location, resolved
from zckpt.storage.objstore import RemotePath


def input_kind(format: str | None, path: str | Location) -> str:
    """What reports call an input: ``"safetensors file"`` for a lone ``.safetensors`` (the ``hf`` format reads
    it, but it is no HF checkpoint: no config, no index), else ``"<format> checkpoint"``."""
    if format is None:
        return "unrecognised checkpoint"
    if format == "hf" and str(path).endswith(".safetensors"):
        return "safetensors file"
    return f"{format} checkpoint"


def input_root(meta: CheckpointMeta) -> Location:
    """The folder (or file) an operation must leave untouched: the save folder holding every tag of a
    checkpoint with tags, else the checkpoint's own folder or file."""
    return resolved(location(meta.save_dir or meta.path))


def check_overlap(meta: CheckpointMeta, out: Location) -> None:
    """Refuse an output equal to the input, inside it, or containing it, before anything is written (a
    local path and a URL never overlap)."""
    src, res = input_root(meta), resolved(out)
    if res == src or src in res.parents:
        raise OutputExists(
            f"{out}: inside the input {src}; writing there could change or delete it",
            hint="write the output somewhere else",
            path=str(out),
        )
    if res in src.parents:
        raise OutputExists(
            f"{out}: contains the input {src}; replacing it would delete the input",
            hint="write the output somewhere else",
            path=str(out),
        )
    if isinstance(src, RemotePath) or isinstance(out, RemotePath):
        return  # a store has no symbolic links
    folder = src if src.is_dir() else src.parent
    given = Path(os.path.abspath(meta.save_dir or meta.path))
    link = _link_into(out, folder, {given, *given.parents})
    if link is not None:
        raise OutputExists(
            f"{out}: reaches the input's folder {folder} through the symbolic link {link}",
            hint="write the output somewhere else, or name the folder itself if writing there is meant",
            path=str(out),
        )


def _link_into(out: Path, folder: Path, ours: set[Path]) -> Path | None:
    """A symbolic link on ``out``'s path (``out`` included) that points at ``folder`` or inside it, other
    than the links the input was named through (``ours``); links to an ancestor of ``folder`` (``/tmp ->
    /private/tmp``) are ordinary paths, not this."""
    p = Path(os.path.abspath(out))
    for q in (p, *p.parents):
        if q.is_symlink() and q not in ours:
            t = q.resolve()
            if t == folder or folder in t.parents:
                return q
    return None
