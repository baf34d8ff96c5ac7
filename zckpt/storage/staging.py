"""Publishing outputs whole or not at all.

Files are written into a hidden staging folder beside the destination and moved into place by
``Staging.commit()`` after one fsync of everything staged; any exception removes the staging folder. A
folder is published with one rename that refuses to replace anything (``RENAME_NOREPLACE``), or, when
overwriting, swaps old and new in one ``RENAME_EXCHANGE`` (``publish_folder``, also the engine's): of two
writers racing for one output, one wins whole and the other fails. Staging folders are named
``.<dest>.zckpt-tmp-<host>-<pid>-<random>``; a later run into the same folder removes those whose process
is gone (a killed run's leftovers) and says so. ``fsync_path`` makes one path durable. Ctrl-C and SIGTERM
wait while the renames run (``zckpt.storage.interrupts``).

Overwriting never deletes a file zckpt did not write. The caller says which paths of an existing folder
output are its own (``owns``: its shard set, index, sidecars, the files it copies in); any other file is
either kept (``foreign="keep"``: hard-linked, or copied where links fail, into the staging folder before the
swap, so the published folder holds the new output plus the user's files: transformers' ``save_pretrained``
convention, which removes only stale shards of its own naming) or the run is refused before any work,
naming them (``foreign="refuse"``: a training checkpoint folder, where a kept stray rank file would pass
for part of the new set). The caller's own files that the new output does not rewrite (shards of a run
with another shard count) are not kept, so nothing stale looks like part of the new set.
An ``s3://`` destination is published by ``zckpt.storage.remote_staging.RemoteStaging``: ``open_staging(dest,
...)`` returns the one that fits ``dest``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import shutil
import socket
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType

from zckpt.errors import OutputExists, OutputNotWritable, WriteFailed
from zckpt.storage import interrupts, remote_staging, sink
from zckpt.storage.digest import SIDECAR_PATTERN, SIDECARS
from zckpt.storage.location import Location
from zckpt.storage.objstore import RemotePath
from zckpt.storage.remote_staging import RemoteStaging

_SIDECARS = SIDECARS

_WRITE_HINTS = {
    errno.ENOSPC: "free space on the output's filesystem or write elsewhere",
    errno.EDQUOT: "the disk quota is exhausted; free space or write elsewhere",
    errno.EFBIG: "the file size limit was reached (ulimit -f, or the filesystem's maximum file size)",
    errno.EROFS: "the output's filesystem is read-only; write elsewhere",
}


_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_TMP_MARK = ".zckpt-tmp-"


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library already loaded in this process (``dlopen(NULL)``). Not ``ctypes.util.find_library``: it
    runs ``ldconfig`` in a forked copy of this process, which a large process pays for (and its memory is
    briefly counted twice by whoever sums a process tree's RSS)."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """``renameat2(a, b, flags)`` (Linux); False where the kernel or filesystem does not offer it."""
    lib = _libc()
    fn = getattr(lib, "renameat2", None) if lib is not None else None
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _taken(dest: Path) -> OutputExists:
    return OutputExists(
        f"{dest}: created by another process while this one was writing; nothing of this run was kept",
        hint="pass --overwrite to replace it",
        path=str(dest),
    )


def move(src: Path, dest: Path, *, replace: bool) -> None:
    """Rename ``src`` (file or folder) to ``dest``; unless ``replace``, never over an existing ``dest``.
    Replacing a folder swaps the two atomically and then removes the old one."""
    if replace and dest.is_dir() and not dest.is_symlink():
        if _renameat2(src, dest, _RENAME_EXCHANGE):
            shutil.rmtree(src)  # now the old folder
            return
        old = dest.with_name(f".{dest.name}{_TMP_MARK}{_owner()}-old")
        os.rename(dest, old)
        os.rename(src, dest)
        shutil.rmtree(old)
        return
    if replace:
        os.replace(src, dest)
        return
    try:
        if _renameat2(src, dest, _RENAME_NOREPLACE):
            return
    except FileExistsError:
        raise _taken(dest) from None
    if dest.exists():  # no renameat2 here: check, then rename (a narrow race remains)
        raise _taken(dest)
    os.rename(src, dest)


def publish_folder(staged: Path, target: Path, *, overwrite: bool) -> None:
    """Make the complete, fsynced folder ``staged`` visible as ``target`` (see ``move``), durably. (An
    ``s3://`` target is published by ``remote_staging.publish_dir``: a store has no rename.)"""
    move(staged, target, replace=overwrite)
    _fsync_dir(target.parent)


def _owner() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def remove_stale(folder: Path) -> list[Path]:
    """Staging folders in ``folder`` left by a killed zckpt process of this host; removed, and returned.

    Not the ``-old`` folder of a swap without ``renameat2`` killed between its two renames: that is the
    previous output itself (files the user put there included), so it is left in place."""
    host = re.escape(socket.gethostname())
    rx = re.compile(rf"^\..+{re.escape(_TMP_MARK)}{host}-(\d+)-")
    out: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return out
    for d in entries:
        m = rx.match(d.name)
        if (
            m
            and int(m.group(1)) != os.getpid()
            and _gone(int(m.group(1)))
            and d.is_dir()
            and not d.is_symlink()
            and not d.name.endswith("-old")
        ):
            shutil.rmtree(d, ignore_errors=True)
            out.append(d)
    return out


_SHARD = r"-\d{5}-of-\d{5}"


def stale_shards(dest: Path, keep: set[str]) -> list[Path]:
    """Files of an earlier sharded output ``dest`` (``model-0000k-of-0000n.safetensors``, their sidecars,
    ``dest``'s index) that a new output with files ``keep`` does not overwrite."""
    stem, dot, suffix = dest.name.partition(".")
    rx = re.compile(
        rf"^{re.escape(stem)}(?:{_SHARD})?{re.escape(dot + suffix)}"
        rf"(?:{SIDECAR_PATTERN}|\.index\.json)?$"
    )
    try:
        return [f for f in dest.parent.iterdir() if rx.match(f.name) and f.name not in keep and f.is_file()]
    except OSError:
        return []


Ticket = str | remote_staging.Ticket
"""What rank 0 sends the other ranks of a split job about its staging folder (``Staging.ticket``): a local
folder's path, or a ``remote_staging.Ticket``."""


@contextlib.contextmanager
def share(ticket: Ticket, *, is_dir: bool) -> Iterator[tuple[Path, Callable[[], list[str]]]]:
    """(the folder a process writes its share of a split job's output into, ``done``): rank 0's staging
    folder (``ticket``), except for an ``s3://`` output on another node, where that folder is not: a
    ``remote_staging.Follower`` of its own there (see that module). ``done()`` once the share is written:
    the objects uploaded off rank 0's host, for rank 0 to ``RemoteStaging.adopt``; leaving the block by an
    error (or without ``done()``) deletes them."""
    if isinstance(ticket, str):
        yield Path(ticket), list
        return
    if remote_staging.on_this_host(ticket):  # rank 0's folder: its own, or one of its host's ranks'
        mine = remote_staging.register(Path(ticket.folder), ticket.url, ticket.is_dir, ticket.order)
        try:
            yield Path(ticket.folder), list
        finally:
            if mine:
                remote_staging.unregister(Path(ticket.folder))
        return
    follower = remote_staging.Follower(ticket.url, is_dir=is_dir, order=ticket.order)
    with follower:
        yield follower.dir, follower.flush


def open_staging(
    dest: Location,
    *,
    is_dir: bool,
    overwrite: bool = False,
    owns: Callable[[str], bool] | None = None,
    foreign: str = "keep",
    order: remote_staging.PublishOrder,
) -> Staging | RemoteStaging:
    """The staging of an output ``dest``: a ``Staging`` beside a local path, a ``RemoteStaging`` for an
    ``s3://`` (or other store's) URL, where nothing can be renamed (see each class; ``order``: which of its
    files complete it, there)."""
    if isinstance(dest, RemotePath):
        return RemoteStaging(
            dest, is_dir=is_dir, overwrite=overwrite, owns=owns, foreign=foreign, order=order
        )
    return Staging(dest, is_dir=is_dir, overwrite=overwrite, owns=owns, foreign=foreign)


class Staging:
    """A hidden temporary folder beside ``dest``; writers put files in ``.dir`` under their final names.

    ``commit()`` moves them into place: a folder ``dest`` is swapped in whole (the old one, when
    overwriting, is removed only after the new one is in place); for a file ``dest`` each staged file
    replaces its namesake in ``dest``'s folder. Leaving the ``with`` block without ``commit()`` — an
    error, KeyboardInterrupt — removes the temporary folder and everything in it.
    """

    def __init__(
        self,
        dest: Path,
        *,
        is_dir: bool,
        overwrite: bool = False,
        owns: Callable[[str], bool] | None = None,
        foreign: str = "keep",
    ) -> None:
        """``owns(relpath)`` (folder outputs): whether a path of an existing ``dest`` is this output's own,
        replaced or removed by the new one; every other file is kept or refused (``foreign``: ``"keep"`` or
        ``"refuse"``; module doc). ``None``: the old folder is replaced whole (only for folders nothing but
        zckpt writes into)."""
        self.dest = dest
        self.is_dir = is_dir
        self.overwrite = overwrite
        self.owns = owns
        self.foreign = foreign
        self.kept: list[str] = []
        """Top-level names of an earlier ``dest`` kept by ``commit`` (files zckpt did not write)."""
        check_dest(dest, is_dir=is_dir, overwrite=overwrite)
        if is_dir and overwrite and owns is not None and foreign == "refuse":
            _refuse_foreign(dest, owns)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            for d in remove_stale(dest.parent):
                warnings.warn(f"removed {d}, the staging folder of a killed run", stacklevel=3)
            self.dir = Path(tempfile.mkdtemp(prefix=f".{dest.name}{_TMP_MARK}{_owner()}-", dir=dest.parent))
        except OSError as e:  # name the path the user gave, not the staging folder's hidden name
            raise _cannot_write(dest, e) from e
        if is_dir:  # mkdtemp makes it 0700; the folder becomes the output, so give it the usual mode
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(self.dir, 0o777 & ~umask)
        self._done = False
        interrupts.opened(self)
        self._key = Path(os.path.abspath(self.dir))
        sink.defer_fsync(self._key)

    def ticket(self) -> Ticket:
        """What the other ranks of a split job need to write their share into this folder (``share``)."""
        return str(self.dir)

    def __enter__(self) -> Staging:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._done:
            self.abort()
        if (
            isinstance(ev, OSError)
            and not isinstance(ev, WriteFailed)
            and (ev.errno in _WRITE_HINTS or _inside(ev.filename, self.dir))
        ):
            raise _cannot_write(self.dest, ev) from ev

    def expect(self, names: Sequence[str]) -> None:
        """Fail now, before any work, if committing files ``names`` (file mode) would replace others."""
        if not self.is_dir:
            for n in names:
                check_dest(self.dest.parent / n, is_dir=False, overwrite=self.overwrite)

    def abort(self) -> None:
        self._release()
        shutil.rmtree(self.dir, ignore_errors=True)
        self._done = True
        interrupts.closed(self, published=False)

    def _release(self) -> None:
        sink.undefer_fsync(self._key)

    def commit(self) -> list[Path]:
        """Make every staged file durable (fsync, folders included), then move them into place;
        returns their final paths."""
        self._release()
        if self.is_dir and self.overwrite and self.owns is not None and self.dest.is_dir():
            self.kept = _keep_foreign(self.dest, self.dir, self.owns)
        _fsync_tree(self.dir)
        with interrupts.held():  # no interrupt between two renames, nor after the last one unrecorded
            return self._move_into_place()

    def _move_into_place(self) -> list[Path]:
        names = sorted(p.name for p in self.dir.iterdir() if p.name not in self.kept)
        if self.is_dir:
            move(self.dir, self.dest, replace=self.overwrite)
            final = [self.dest / n for n in names]
        else:
            final = []
            # shards of a file OUT have other names: check them too (a sidecar follows its file)
            self.expect([n for n in names if not n.endswith(_SIDECARS)])
            stale = stale_shards(self.dest, set(names)) if self.overwrite else []
            # an old sidecar must never sit beside a new file (a kill between the two renames below)
            for n in names:
                if n.endswith(_SIDECARS):
                    (self.dest.parent / n).unlink(missing_ok=True)
                else:  # nor one of the other kind (an output of an earlier zckpt)
                    for side in _SIDECARS:
                        (self.dest.parent / (n + side)).unlink(missing_ok=True)
            for n in names:  # sorted: each file before its sidecar
                move(self.dir / n, self.dest.parent / n, replace=self.overwrite)
                final.append(self.dest.parent / n)
            os.rmdir(self.dir)
            for f in stale:  # the earlier output's other shards, index and sidecars
                f.unlink(missing_ok=True)
        _fsync_dir(self.dest.parent)
        self._done = True
        interrupts.closed(self, published=True)
        return final


def _inside(filename: object, folder: Path) -> bool:
    """``filename`` (an OSError's) is ``folder`` or a path in it."""
    if not isinstance(filename, (str, bytes, os.PathLike)):
        return False
    f = os.path.abspath(os.fsdecode(filename))
    d = os.path.abspath(folder)
    return f == d or f.startswith(d + os.sep)


def _cannot_write(dest: Path, e: OSError) -> WriteFailed:
    """The error for a failed write of ``dest``, naming ``dest`` (never the staging folder's name)."""
    what = e.strerror or str(e)
    if e.errno in _WRITE_HINTS:
        msg = f"{dest}: writing failed ({what}); nothing was written, temporary files removed"
        return WriteFailed(msg, hint=_WRITE_HINTS[e.errno], path=str(dest))
    denied = e.errno in (errno.EACCES, errno.EPERM)
    cls = OutputNotWritable if denied else WriteFailed
    if denied:  # missing folders are made, so permission is what is wanting
        hint = "you may not write in that folder (or one above it): change its permissions or write elsewhere"
    elif e.errno in (errno.ENOTDIR, errno.EEXIST):  # makedirs over a file: EEXIST
        hint = "a part of the path is a file, not a folder: write elsewhere"
    else:
        hint = "write elsewhere"
    return cls(f"{dest}: cannot write here ({what}); nothing was written", hint=hint, path=str(dest))


def _foreign(dest: Path, owns: Callable[[str], bool]) -> list[str]:
    """Paths under folder ``dest`` (relative, ``/``-separated; a folder holding none of ``owns``' paths is
    one entry) that ``owns`` does not claim."""
    out: list[str] = []

    def walk(d: Path, rel: str) -> None:
        for p in sorted(d.iterdir()):
            r = f"{rel}{p.name}"
            if owns(r):
                continue
            if p.is_dir() and not p.is_symlink() and any(owns(f"{r}/{q.name}") for q in p.iterdir()):
                walk(p, r + "/")
            else:
                out.append(r)

    walk(dest, "")
    return out


def _refuse_foreign(dest: Path, owns: Callable[[str], bool]) -> None:
    """``--overwrite`` of a checkpoint folder that holds files zckpt did not write: refuse, naming them."""
    if not dest.is_dir():
        return
    other = _foreign(dest, owns)
    if other:
        shown = ", ".join(other[:5]) + (f" (+{len(other) - 5} more)" if len(other) > 5 else "")
        raise OutputExists(
            f"{dest}: --overwrite replaces only the files of a checkpoint zckpt writes; it also holds "
            f"{len(other)} other file(s): {shown}",
            hint="move them out of the folder, or choose another output path",
            path=str(dest),
        )


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link ``src`` at ``dst`` (no data copied; the old folder's removal leaves it intact), or copy it
    where the filesystem refuses links."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _keep_foreign(dest: Path, staged: Path, owns: Callable[[str], bool]) -> list[str]:
    """Put the files of the existing folder ``dest`` that ``owns`` does not claim (and the new output does
    not replace) into ``staged``; returns their top-level names."""
    new = {p.name for p in staged.iterdir()}
    kept: list[str] = []
    for p in sorted(dest.iterdir()):
        if p.name in new or owns(p.name):
            continue
        target = staged / p.name
        if p.is_dir() and not p.is_symlink():
            shutil.copytree(p, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(p), str(target))
        kept.append(p.name)
    return kept


def check_dest(dest: Path, *, is_dir: bool, overwrite: bool) -> None:
    """Refuse an existing output unless ``overwrite``; refuse replacing a folder by a file or back."""
    if not dest.exists():
        return
    if not overwrite:
        raise OutputExists(f"{dest} already exists", hint="pass --overwrite to replace it", path=str(dest))
    if dest.is_dir() != is_dir:
        kind = "a folder" if dest.is_dir() else "a file"
        want = "a folder" if is_dir else "a file"
        raise OutputExists(f"{dest} is {kind}; refusing to replace it by {want}",
                           hint="remove it first or choose another output path", path=str(dest))  # fmt: skip


def fsync_path(path: str | Path) -> None:
    """fsync one file or folder by path (errors propagate)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (files first, then their folders, ``root`` last)."""
    for d, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(d, name))
        _fsync_dir(Path(d))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
