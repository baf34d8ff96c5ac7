"""File access for reading: every byte zckpt reads from a checkpoint goes through here.

``open_fd`` / ``open_regular`` open regular files only (FIFOs, devices, sockets and folders are refused
without blocking). ``read_into`` reads a byte range with ``pread`` straight into a caller's buffer (nothing
read stays in this process's RSS); ``view`` is a zero-copy view of a cached copy-on-write mapping and
``release`` drops its consumed pages. ``zckpt.io.spans`` turns tensor ranges into these byte reads.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from typing import BinaryIO

import torch

from zckpt.errors import CorruptCheckpoint

_lock = threading.Lock()
_maps: dict[str, tuple[mmap.mmap, int]] = {}
_fds: dict[str, tuple[int, int]] = {}


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}  # fmt: skip


def open_fd(path: str) -> int:
    """A read-only descriptor of the regular file ``path`` (a symlink to one is fine). FIFOs, devices,
    sockets and folders are refused without blocking (``O_NONBLOCK``): a checkpoint is made of files."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except PermissionError as e:
        raise CorruptCheckpoint(f"{path}: cannot open ({e.strerror})", hint=_PERM_HINT, path=path) from None
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
        raise CorruptCheckpoint(f"{p}: permission denied (a folder above it cannot be entered)",
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
        raise CorruptCheckpoint(f"{p}: permission denied (cannot list or enter the folder)",
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
        raise CorruptCheckpoint(f"{p}: permission denied (cannot open the file)", hint=_PERM_HINT,
                                path=p) from None  # fmt: skip
    except OSError:
        return
    os.close(fd)


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``open(path, "rb")`` for regular files only (see ``open_fd``)."""
    return os.fdopen(open_fd(os.fspath(path)), "rb")


def read_capped(path: str | os.PathLike[str], limit: int, what: str, hint: str) -> bytes:
    """All of a file that is small by nature (an index, a trainer state): more than ``limit`` bytes is
    refused naming it, never read into memory."""
    with open_regular(path) as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise CorruptCheckpoint(
            f"{path}: larger than {limit >> 20} MiB; not {what}", hint=hint, path=str(path)
        )
    return raw


def _map(path: str) -> tuple[mmap.mmap, int]:
    with _lock:
        hit = _maps.get(path)
        if hit is not None:
            return hit
        fd = open_fd(path)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else mmap.mmap(-1, 1)
        finally:
            os.close(fd)
        _maps[path] = (mm, size)
        return mm, size


def close_files(paths: object = None) -> None:
    """Drop cached mappings (all of them when ``paths`` is None). Views already handed out stay valid."""
    with _lock:
        keys = list(_maps) if paths is None else [p for p in paths if p in _maps]  # type: ignore[attr-defined]
        for k in keys:
            _maps.pop(k)
        fkeys = list(_fds) if paths is None else [p for p in paths if p in _fds]  # type: ignore[attr-defined]
        for k in fkeys:
            os.close(_fds.pop(k)[0])


def _fd(path: str) -> tuple[int, int]:
    with _lock:
        hit = _fds.get(path)
        if hit is not None:
            return hit
        fd = open_fd(path)
        size = os.fstat(fd).st_size
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        _fds[path] = (fd, size)
        return fd, size


def read_into(path: str, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor ``out`` with the file's bytes ``[offset, offset + out.nbytes)``
    by ``pread`` (thread-safe; releases the GIL). Unlike a mapping, nothing stays in this process's
    memory afterwards: the bytes live only in ``out`` and the kernel's page cache."""
    fd, size = _fd(path)
    n = out.numel() * out.element_size()
    if offset < 0 or offset + n > size:
        raise CorruptCheckpoint(
            f"{path}: needs bytes [{offset}, {offset + n}) but the file has {size} bytes (truncated?)",
            path=path,
        )
    mv = memoryview(out.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
    done = 0
    while done < n:
        k = os.preadv(fd, [mv[done:]], offset + done)
        if k <= 0:
            raise CorruptCheckpoint(f"{path}: short read at byte {offset + done} (file changed?)", path=path)
        done += k


def view(path: str, byte_offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` elements of ``dtype`` at ``byte_offset`` of the file, as a 1-D zero-copy view of a cached
    copy-on-write mapping (small metadata tensors, and diff's aligned chunks). Never modify it."""
    mm, size = _map(path)
    end = byte_offset + count * dtype.itemsize
    if byte_offset < 0 or end > size:
        raise CorruptCheckpoint(f"{path}: needs bytes [{byte_offset}, {end}) but the file has {size} bytes "
                                "(truncated?)", path=path)  # fmt: skip
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(mm, dtype=dtype, count=count, offset=byte_offset)


def release(path: str, offset: int, nbytes: int) -> None:
    """Drop the pages of a consumed byte range from this process (``MADV_DONTNEED``), so streaming a
    checkpoint does not grow RSS by its size. Safe on the copy-on-write mapping: untouched private
    pages are simply re-read from the file if anyone reads them again."""
    mm, size = _map(path)
    start = offset - offset % mmap.PAGESIZE
    end = min(size, offset + nbytes)
    if end > start and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)
