"""File access for reading: every byte zckpt reads from a checkpoint goes through here.

``open_fd`` / ``open_regular`` open regular files only (FIFOs, devices, sockets and folders are refused
without blocking). ``read_into`` reads a byte range with ``pread`` straight into a caller's buffer (nothing
read stays in this process's RSS). No checkpoint file is ever mapped: a file another process shortens while
it is read is an error naming it ("short read ... file changed?"), never a ``SIGBUS`` that ends the process
(a pipeline's, a training loop's). ``zckpt.stream.spans`` turns tensor ranges into these byte reads.

An object-store URL (``s3://bucket/key``) is routed to ``zckpt.storage.objstore`` here, at the top of each
function (``objstore.parse``), and nowhere else. ``open_fd`` returns a ``Handle``: a local descriptor, or an
object read through the ``ObjectStore`` of the operation that opened it. Open descriptors belong to the
running operation's ``zckpt.storage.session.Storage`` (``close_files`` closes its own only).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from typing import TYPE_CHECKING, Any, BinaryIO

from zckpt.errors import CorruptCheckpoint, PermissionDenied
from zckpt.storage import objstore, session
from zckpt.storage.location import LocationLike, location
from zckpt.storage.objstore import RemotePath

if TYPE_CHECKING:  # imported where used: the CLI opens a DCP .metadata here before torch is imported
    import numpy as np
    import torch


class Handle:
    """An open checkpoint file (``open_fd``): a local read descriptor ``fd``, or (``fd`` None) an object
    read through the ``ObjectStore`` it was opened with. ``size`` is fixed at open."""

    __slots__ = ("_st", "_url", "fd", "name", "size")

    def __init__(self, name: str, fd: int | None, size: int, st: objstore.ObjectStore | None = None) -> None:
        self.name, self.fd, self.size, self._st = name, fd, size, st
        self._url = objstore.parse(name) if fd is None else None

    def pread(self, n: int, offset: int) -> bytes:
        if self.fd is not None:
            return os.pread(self.fd, n, offset)
        buf = bytearray(max(0, min(n, self.size - offset)))
        self.read_object(offset, memoryview(buf))
        return bytes(buf)

    def pread_into(self, buf: memoryview, offset: int, limit: int | None = None) -> int:
        """``limit``: the caller reads on sequentially up to this byte (an object streams ahead up to it)."""
        if self.fd is not None:
            return os.preadv(self.fd, [buf], offset)
        n = max(0, min(len(buf), self.size - offset))
        self.read_object(offset, buf[:n], limit)
        return n

    @property
    def remote(self) -> bool:
        """An object, read through its store (not a local descriptor)."""
        return self.fd is None

    def read_object(self, offset: int, out: memoryview, limit: int | None = None) -> None:
        assert self._st is not None and self._url is not None
        from zckpt.storage.objstore import read

        read.read_into(self._st, self._url, offset, out, limit)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = -1

    def __repr__(self) -> str:
        return f"Handle({self.name!r})"


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}  # fmt: skip


def open_fd(path: str) -> Handle:
    """A read-only ``Handle`` of the regular file ``path`` (a symlink to one is fine), or of the object
    ``path`` names. FIFOs, devices, sockets and folders are refused without blocking (``O_NONBLOCK``): a
    checkpoint is made of files."""
    if objstore.is_url(path):
        st = objstore.current()
        n = objstore.paths.size(st, path)  # fails here, naming the URL, when the object is not there
        return Handle(str(objstore.parse(path)), None, n, st)
    fd = _open_local(path)
    return Handle(path, fd, os.fstat(fd).st_size)


def _open_local(path: str) -> int:
    """A read-only descriptor of the local regular file ``path`` (see ``open_fd``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except PermissionError as e:  # not damage: say so, as the PermissionError it is
        raise PermissionDenied(f"{path}: cannot open ({e.strerror})", hint=_PERM_HINT, path=path) from None
    except OSError as e:
        raise CorruptCheckpoint(f"{path}: cannot open ({e.strerror})", path=path) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise CorruptCheckpoint(f"{path}: is {kind}, not a checkpoint file", hint="give the real file",
                                path=path)  # fmt: skip
    return fd


_PERM_HINT = "check its permissions (ls -ld), or run as a user that may read it"


def check_access(path: str | os.PathLike[str]) -> None:
    """Refuse ``path`` when this process may not reach it, or (a folder) list it and enter it, as
    "permission denied" naming it. Format probes treat what they cannot read as absent ("no tag", "not a
    checkpoint"); this runs first so that an unreadable input is reported as what it is. A missing path
    passes (the caller reports it)."""
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except PermissionError:
        raise PermissionDenied(f"{p}: permission denied (a folder above it cannot be entered)",
                                hint=_PERM_HINT, path=p) from None  # fmt: skip
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        return
    try:
        names = os.listdir(p)
        if names:
            os.lstat(os.path.join(p, names[0]))
    except PermissionError:
        raise PermissionDenied(f"{p}: permission denied (cannot list or enter the folder)",
                                hint=_PERM_HINT, path=p) from None  # fmt: skip
    except OSError:
        return


def check_readable(path: str | os.PathLike[str]) -> None:
    """Refuse the file ``path`` as "permission denied" when this process may not open it for reading; any
    other failure (missing, a FIFO...) is left to the reader that opens it."""
    p = os.fspath(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except PermissionError:
        raise PermissionDenied(f"{p}: permission denied (cannot open the file)", hint=_PERM_HINT,
                                path=p) from None  # fmt: skip
    except OSError:
        return
    os.close(fd)


def open_regular(path: LocationLike) -> BinaryIO:
    """``open(path, "rb")`` for regular files only (see ``open_fd``)."""
    p = location(path)
    if isinstance(p, RemotePath):
        return objstore.open_read(p)
    return os.fdopen(_open_local(os.fspath(p)), "rb")


def read_capped(path: LocationLike, limit: int, what: str, hint: str) -> bytes:
    """All of a file that is small by nature (an index, a trainer state): more than ``limit`` bytes is
    refused naming it, never read into memory."""
    with open_regular(path) as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise CorruptCheckpoint(
            f"{path}: larger than {limit >> 20} MiB; not {what}", hint=hint, path=str(path)
        )
    return raw


def is_remote(path: LocationLike) -> bool:
    """``path`` names an object in a store (``s3://...``), not a local file."""
    return objstore.is_url(path)


def will_open(paths: list[str]) -> None:
    """A hint: these files are opened next (a sharded checkpoint's rank files). Objects fetch their last
    blocks (where a zip archive's directory lies) in parallel now; local files ignore it."""
    urls = [p for p in paths if objstore.is_url(p)]
    if urls:
        objstore.prefetch_ends(urls)


def will_read(f: BinaryIO, spans: list[tuple[int, int]]) -> None:
    """A hint: these small ``(offset, length)`` spans of the ``open_regular`` file ``f`` are read next (a zip
    archive's local headers). An object fetches their blocks in parallel now; a local file ignores it."""
    raw = getattr(f, "raw", f)
    if isinstance(raw, objstore.RemoteFile):
        objstore.prefetch(raw.url, spans)


def expect(path: str, offset: int, limit: int | None) -> None:
    """A hint: a sequential read from byte ``offset`` of ``path`` up to ``limit`` (a record's end) comes
    soon. An object starts fetching it now (``objstore.expect``); a local file ignores it."""
    if limit is not None and objstore.is_url(path):
        objstore.expect(path, offset, limit)


def read_ahead(nbytes: int) -> contextlib.AbstractContextManager[None]:
    """A hint: while the block runs, reads are announced (``expect``) and their records located up to
    ``nbytes`` ahead of the reading. An object store keeps that much more of its small reads cached
    (``objstore.cache_room``), so that the reading finds them; local files ignore it."""
    return objstore.cache_room(nbytes)


def pread(fd: Handle, n: int, offset: int) -> bytes:
    """``os.pread`` of an ``open_fd`` handle (a file or an object)."""
    return fd.pread(n, offset)


def pread_into(fd: Handle, buf: memoryview, offset: int, limit: int | None = None) -> int:
    """``os.preadv(fd, [buf], offset)`` of an ``open_fd`` handle (a file or an object). ``limit``: the caller
    reads on sequentially up to this byte (an object fetches ahead up to it; a local file ignores it)."""
    return fd.pread_into(buf, offset, limit)


def exists(path: LocationLike) -> bool:
    """``os.path.exists`` for a path or an object URL."""
    p = location(path)
    if isinstance(p, RemotePath):
        return objstore.kind(p) is not None
    return os.path.exists(p)


def is_file(path: LocationLike) -> bool:
    """``os.path.isfile`` for a path or an object URL."""
    p = location(path)
    if isinstance(p, RemotePath):
        return objstore.kind(p) == "file"
    return os.path.isfile(p)


def size(path: LocationLike) -> int:
    """``os.path.getsize`` for a path or an object URL."""
    p = location(path)
    return objstore.size(p) if isinstance(p, RemotePath) else os.path.getsize(p)


def copy_file(src: LocationLike, dst: str | os.PathLike[str]) -> None:
    """``shutil.copy2(src, dst)`` where ``src`` may be an object (streamed, 8 MiB at a time)."""
    p = location(src)
    if not isinstance(p, RemotePath):
        shutil.copy2(p, dst)
        return
    with open_regular(src) as fin, open(dst, "xb") as fout:
        shutil.copyfileobj(fin, fout, 8 << 20)


def fd_size(fd: Handle) -> int:
    """The size of the file (or object) behind an ``open_fd`` handle."""
    return fd.size


def file_size(f: BinaryIO) -> int:
    """The size of an ``open_regular`` file."""
    raw = getattr(f, "raw", f)
    return raw.size if isinstance(raw, objstore.RemoteFile) else os.fstat(f.fileno()).st_size


def close_fd(fd: Handle) -> None:
    fd.close()


def _files() -> session.LocalFiles:
    """The running operation's open files; outside any operation, a throwaway set (closed by its reader)."""
    s = session.bound_storage()
    return s.files if s is not None else session.LocalFiles()


def close_files(paths: object = None) -> None:
    """Close the running operation's cached descriptors of ``paths`` (all of them when None)."""
    s = session.bound_storage()
    if s is not None:
        s.files.close(paths)


def read_into(path: str, offset: int, out: torch.Tensor | np.ndarray, limit: int | None = None) -> None:
    """Fill ``out`` (a contiguous CPU tensor, or a contiguous numpy array: the torch-free write path) with
    the file's bytes ``[offset, offset + out.nbytes)`` by ``pread`` (thread-safe; releases the GIL). Unlike a
    mapping, nothing stays in this process's memory afterwards: the bytes live only in ``out`` and the
    kernel's page cache. ``limit``: the caller goes on reading up to this byte (an object store may fetch
    ahead up to it; local files ignore it)."""
    mv = _byte_view(out)
    n = len(mv)
    if objstore.is_url(path):
        objstore.read_into(path, offset, mv, limit)
        return
    files = _files()
    fd, size = files.fd(path, _open_local)
    try:
        _pread_all(path, fd, size, offset, mv, n)
    finally:
        if session.bound_storage() is None:
            files.close()


def _byte_view(out: torch.Tensor | np.ndarray) -> memoryview:
    """``out``'s memory as a writable byte view (a tensor through numpy: torch is imported, it made one)."""
    buf: Any = out
    if type(buf).__module__ == "numpy":
        return memoryview(buf).cast("B")
    import torch

    return memoryview(buf.view(torch.uint8).numpy()).cast("B")


def _pread_all(path: str, fd: int, size: int, offset: int, mv: memoryview, n: int) -> None:
    if offset < 0 or offset + n > size:
        raise CorruptCheckpoint(
            f"{path}: needs bytes [{offset}, {offset + n}) but the file has {size} bytes (truncated?)",
            path=path,
        )
    done = 0
    while done < n:
        k = os.preadv(fd, [mv[done:]], offset + done)
        if k <= 0:
            raise CorruptCheckpoint(f"{path}: short read at byte {offset + done} (file changed?)", path=path)
        done += k
