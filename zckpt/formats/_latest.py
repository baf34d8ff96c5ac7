"""``latest``: the file in a save folder naming its newest complete tag (DeepSpeed and the native format).

Its content is input like any other: it must name one tag folder *inside* the save folder — one path
component of valid UTF-8, no NUL, not ``.``/``..``, no separator, not absolute, at most 255 bytes — or the
checkpoint is refused (a ``latest`` holding ``../other_run`` must never lead to another run's weights).
``write_latest`` moves it last, atomically (temp file, fsync, rename).
"""

from __future__ import annotations

import os

from zckpt.errors import CorruptCheckpoint
from zckpt.storage import fileio, objstore
from zckpt.storage.location import Location
from zckpt.storage.objstore import RemotePath

LATEST = "latest"
MAX_BYTES = 4096


def valid_tag(tag: str) -> bool:
    """``tag`` can name a folder inside a save folder (and nothing else)."""
    return (
        0 < len(tag.encode("utf-8", "surrogatepass")) <= 255
        and tag not in (".", "..")
        and not any(c in tag for c in ("/", "\\", "\0"))
        and tag.isprintable()
    )


def refuse_dangling(save_dir: Location, example: Location | None = None) -> None:
    """A ``latest`` that is a symbolic link leading to no file (its target gone, or a loop) is refused in
    those words, naming it (``example``: a tag folder to suggest instead)."""
    latest = save_dir / LATEST
    if isinstance(latest, RemotePath) or not latest.is_symlink() or latest.exists():
        return
    try:
        target = os.readlink(latest)
    except OSError:
        target = "?"
    instead = f", or give the tag folder, e.g. {example}" if example is not None else ", or pass --tag"
    raise CorruptCheckpoint(
        f"{latest}: a symbolic link to {target!r:.120} that leads to no file (its target is missing, or a "
        "loop)",
        hint=f"rewrite `latest` as a file holding the tag folder's name{instead}",
        path=str(latest),
    )


def read_latest(save_dir: Location) -> str | None:
    """The tag ``save_dir/latest`` names, checked; None when there is no ``latest`` file."""
    path = save_dir / LATEST
    if not path.exists() and not path.is_symlink():
        return None
    refuse_dangling(save_dir)
    with fileio.open_regular(path) as f:
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise CorruptCheckpoint(f"{path}: {len(raw)}+ bytes; a `latest` file names one tag", path=str(path))
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CorruptCheckpoint(
            f"{path}: not UTF-8 text; a `latest` file names one tag",
            path=str(path),
            hint="pass --tag, or rewrite `latest`",
        ) from None
    if not valid_tag(tag):
        raise CorruptCheckpoint(
            f"{path}: names {tag!r:.80}, which is not a tag folder inside {save_dir}",
            hint="pass --tag, or rewrite `latest` with the tag folder's name",
            path=str(path),
        )
    return tag


def write_latest(save_dir: Location, tag: str, *, staged: bool = False) -> None:
    """Point ``save_dir/latest`` at ``tag``: written beside it, fsynced, renamed over it, folder fsynced. In a
    ``staged`` folder (published whole later, everything in it fsynced first) it is simply written."""
    if not valid_tag(tag):
        raise ValueError(f"{tag!r} cannot name a tag folder")
    if isinstance(save_dir, RemotePath):  # an object is written whole: no temporary name needed
        objstore.put_bytes(save_dir / LATEST, tag.encode())
        return
    if staged:
        (save_dir / LATEST).write_text(tag, encoding="utf-8")
        return
    tmp = save_dir / f".{LATEST}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / LATEST)
    from zckpt.storage.staging import fsync_path  # the write path: reading ``latest`` needs none

    fsync_path(save_dir)
