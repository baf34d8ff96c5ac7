"""Publishing a finished checkpoint folder atomically: stage, fsync, swap into place, move ``latest``.

A save writes every file into a staging folder beside the tag (``.<tag>.staging``); only when the whole
checkpoint is there does rank 0 make it visible. A new tag is one ``rename``. Re-saving a tag that exists
(possibly the one ``latest`` names) swaps the two folders in one ``renameat2(RENAME_EXCHANGE)`` on Linux,
so a reader or a crash sees the old checkpoint or the new one, never a mix; elsewhere it falls back to two
renames. ``latest`` moves last, through a temporary file and ``os.replace``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
from pathlib import Path

from zckpt.io.outputs import fsync_path

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def staging_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f".{tag}.staging"


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the call is unavailable."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (38, 22, 95):  # ENOSYS, EINVAL, EOPNOTSUPP: the filesystem can't exchange
            return False
        raise OSError(err, os.strerror(err), str(a))
    return True


def publish(staged: Path, target: Path) -> None:
    """Make the complete folder ``staged`` visible as ``target`` (replacing any old ``target``)."""
    for f in staged.iterdir():
        fsync_path(f)
    fsync_path(staged)
    if not target.exists():
        os.rename(staged, target)
    elif _exchange(staged, target):
        shutil.rmtree(staged)  # now holds the old checkpoint
    else:
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, old)
        os.rename(staged, target)
        shutil.rmtree(old)
    fsync_path(target.parent)


def move_latest(save_dir: Path, tag: str) -> None:
    tmp = save_dir / f".latest.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / "latest")
    fsync_path(save_dir)
