"""Byte access: pieces become tensors without reading any other bytes of their files.

Only this module touches tensor bytes. ``copy_piece`` / ``read_into`` read a byte range with ``pread``
straight into a caller's buffer (nothing read stays in this process's RSS); ``read_entry`` assembles an
owned copy of a logical tensor from its pieces; ``iter_chunks`` streams one in bounded chunks.
``piece_view`` is a zero-copy view of a cached copy-on-write mmap, for small metadata tensors (never
modify it).
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, BinaryIO

import torch

from zckpt.errors import CorruptCheckpoint

if TYPE_CHECKING:
    from zckpt.model import Piece, TensorEntry

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
    except OSError as e:
        raise CorruptCheckpoint(f"{path}: cannot open ({e.strerror})", path=path) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise CorruptCheckpoint(f"{path}: is {kind}, not a checkpoint file", hint="give the real file",
                                path=path)  # fmt: skip
    return fd


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``open(path, "rb")`` for regular files only (see ``open_fd``)."""
    return os.fdopen(open_fd(os.fspath(path)), "rb")


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


def piece_view(p: Piece) -> torch.Tensor:
    """The stored elements of one piece as a 1-D tensor in its stored dtype (a view of the mapping)."""
    if p.value is not None:
        return p.value.reshape(-1)[: p.numel]
    mm, size = _map(p.file)
    end = p.byte_offset + p.nbytes
    if p.byte_offset < 0 or end > size:
        raise CorruptCheckpoint(
            f"{p.file}: needs bytes [{p.byte_offset}, {end}) but the file has {size} bytes (truncated?)",
            path=p.file,
        )
    if p.numel == 0:
        return torch.empty(0, dtype=p.dtype)
    return torch.frombuffer(mm, dtype=p.dtype, count=p.numel, offset=p.byte_offset)


def read_entry(e: TensorEntry, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Assemble a logical tensor from its pieces; cast to ``dtype`` (default: the entry's dtype)."""
    want = e.dtype if dtype is None else dtype
    out = torch.empty(e.numel, dtype=want)
    for p in e.pieces:
        copy_piece(p, 0, p.numel, out[p.start : p.start + p.numel])
    return out.view(e.shape)


def copy_piece(p: Piece, lo: int, hi: int, out: torch.Tensor) -> None:
    """Copy the piece's elements ``[lo, hi)`` (piece-relative) into ``out`` (1-D, ``hi - lo`` elements),
    casting to ``out``'s dtype. File bytes are read with ``pread`` (straight into ``out`` when the
    dtypes match), never through the mapping, so nothing read stays in this process's RSS."""
    n = hi - lo
    if n <= 0:
        return
    if p.value is not None:
        out.copy_(p.value.reshape(-1)[lo:hi])
        return
    if lo < 0 or hi > p.numel:
        raise ValueError(f"range [{lo}, {hi}) outside a piece of {p.numel} elements")
    offset = p.byte_offset + lo * p.dtype.itemsize
    if out.dtype == p.dtype and out.is_contiguous():
        read_into(p.file, offset, out)
    else:
        tmp = torch.empty(n, dtype=p.dtype)
        read_into(p.file, offset, tmp)
        out.copy_(tmp)


def iter_chunks(
    e: TensorEntry, dtype: torch.dtype | None = None, max_bytes: int = 64 << 20
) -> Iterator[torch.Tensor]:
    """The entry's flattened elements in order as 1-D tensors of at most ``max_bytes``, cast to ``dtype``.

    Memory stays bounded by one chunk whatever the tensor size. A chunk already in the wanted dtype is
    a view of the file mapping (zero-copy): write it out, never keep or modify it.
    """
    want = e.dtype if dtype is None else dtype
    for p in sorted(e.pieces, key=lambda p: p.start):
        view = piece_view(p)
        step = max(1, max_bytes // max(p.dtype.itemsize, want.itemsize))
        for lo in range(0, p.numel, step):
            yield view[lo : lo + step].to(want)
            if p.value is None:
                _release(
                    p.file, p.byte_offset + lo * p.dtype.itemsize, min(step, p.numel - lo) * p.dtype.itemsize
                )


def _release(path: str, offset: int, nbytes: int) -> None:
    """Drop the pages of a consumed byte range from this process (``MADV_DONTNEED``), so streaming a
    checkpoint does not grow RSS by its size. Safe on the copy-on-write mapping: untouched private
    pages are simply re-read from the file if anyone reads them again."""
    mm, size = _map(path)
    start = offset - offset % mmap.PAGESIZE
    end = min(size, offset + nbytes)
    if end > start and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def iter_aligned_views(
    a: TensorEntry, b: TensorEntry, max_elems: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Aligned chunks of two same-size entries, ``(A's elements [lo, hi), B's elements [lo, hi))``, in
    each entry's dtype, at most ``max_elems`` per chunk.

    Chunk boundaries include every piece boundary of both sides, so each chunk lies inside one piece
    per side and is a zero-copy view of the file mapping (a cast copy only when a piece's stored dtype
    differs from its entry's). Warm pages are mapped by the kernel's fault-around, several times
    faster than copying them out with ``pread``; each chunk's pages are released (``MADV_DONTNEED``)
    once the consumer moves on, so RSS stays at one chunk. Never keep or modify a yielded chunk.
    """
    if a.numel != b.numel:
        raise ValueError(f"{a.key} has {a.numel} elements, {b.key} has {b.numel}")
    pa, pb = sorted(a.pieces, key=lambda p: p.start), sorted(b.pieces, key=lambda p: p.start)
    ia = ib = 0
    lo = 0
    while lo < a.numel:
        while pa[ia].start + pa[ia].numel <= lo:
            ia += 1
        while pb[ib].start + pb[ib].numel <= lo:
            ib += 1
        x, y = pa[ia], pb[ib]
        hi = min(lo + max_elems, x.start + x.numel, y.start + y.numel, a.numel)
        yield _span(x, lo, hi, a.dtype), _span(y, lo, hi, b.dtype)
        for p in (x, y):
            if p.value is None:
                isz = p.dtype.itemsize
                _release(p.file, p.byte_offset + (lo - p.start) * isz, (hi - lo) * isz)
        lo = hi


def _span(p: Piece, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    v = piece_view(p)[lo - p.start : hi - p.start]
    return v if v.dtype == dtype else v.to(dtype)
