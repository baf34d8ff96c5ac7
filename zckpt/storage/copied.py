"""Files zckpt copies byte for byte into an output (the HF side files beside a consolidated checkpoint, an HF
Trainer folder's files, DeepSpeed's helper scripts): ``checked`` lets one through only when it is a regular
file whose bytes lie in the folder it was found in.

A copied file is never parsed, so the checkpoint decides what lands in the output. A ``tokenizer.json``
that is a symbolic link to ``~/.aws/credentials`` would otherwise be copied as a plain file into a folder a
user may then push to a hub. A link inside the folder is followed; so is a Hugging Face hub cache snapshot's
link to its blob (``.../snapshots/<rev>/config.json -> ../../blobs/<hash>``), the one layout whose files all
live elsewhere. Anything else (a link leading out, a FIFO, a device, a folder, a broken link) is refused
naming the file: a partial output is never written in silence. An object store has no links: its objects
pass.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from zckpt.errors import CorruptCheckpoint
from zckpt.storage.location import Location, size
from zckpt.storage.objstore.paths import RemotePath

HUB_SNAPSHOTS, HUB_BLOBS = "snapshots", "blobs"
"""A hub cache repository's folders: ``snapshots/<rev>/<name>`` links into ``blobs/``."""


def checked(p: Location, folder: Location, max_bytes: int | None = None) -> Location:
    """``p`` (a file of ``folder``) if zckpt may copy it into an output; else ``CorruptCheckpoint``.
    ``max_bytes``: larger is refused too (a 64 GiB sparse ``tokenizer.json`` would take minutes and the
    disk to copy)."""
    if isinstance(p, RemotePath) or isinstance(folder, RemotePath):
        return p if max_bytes is None else _bounded(p, size(p), max_bytes)
    try:
        st = os.stat(p)
    except OSError as e:
        raise CorruptCheckpoint(
            f"{p}: cannot be copied into the output ({'a broken link: ' if p.is_symlink() else ''}"
            f"{e.strerror})",
            hint="restore the file, or move it out of the checkpoint folder",
            path=str(p),
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise CorruptCheckpoint(
            f"{p}: not a regular file (a FIFO, device or folder); zckpt copies it into the output",
            hint="move it out of the checkpoint folder, or restore the file it stands for",
            path=str(p),
        )
    if p.is_symlink() and not _inside(Path(os.path.realpath(p)), Path(os.path.realpath(folder))):
        raise CorruptCheckpoint(
            f"{p}: a link leading out of the checkpoint's folder (to {os.path.realpath(p)}); zckpt copies "
            "this file into the output and copies no file from elsewhere",
            hint="put a copy of the file in place of the link if it belongs to the checkpoint",
            path=str(p),
        )
    return _bounded(p, st.st_size, max_bytes)


def _bounded(p: Location, n: int, max_bytes: int | None) -> Location:
    if max_bytes is not None and n > max_bytes:
        raise CorruptCheckpoint(
            f"{p}: {n:,} bytes, more than any file of its kind holds (limit {max_bytes:,}); zckpt copies it "
            "into the output",
            hint="move it out of the checkpoint folder, or restore the file it stands for",
            path=str(p),
        )
    return p


def _inside(target: Path, folder: Path) -> bool:
    if target.is_relative_to(folder):
        return True
    hub = folder.parent
    return hub.name == HUB_SNAPSHOTS and target.is_relative_to(hub.parent / HUB_BLOBS)
