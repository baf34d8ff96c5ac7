"""Sequential file I/O that bypasses the page cache (``O_DIRECT``): writes through a ring of page-aligned
buffers (or straight from the caller's aligned memory), reads into aligned buffers.

Buffered writes copy every byte into the page cache, and the kernel writes the dirty pages back later;
``fsync`` then waits for that writeback. On the virtual disks these tools usually run on, writeback is far
slower than the device: measured here, 1.68 GB took 4.8-5.8 s buffered + fsync and 1.6 s with ``O_DIRECT``
(``dd bs=16M``). Tensor files are written once, sequentially, and not read back soon, which is the case
``O_DIRECT`` exists for.

``DirectWriter`` gathers the byte stream into ``buffers`` page-aligned buffers (anonymous ``mmap``) of
``buf_bytes``: while up to ``buffers - 1`` full ones go to the device (``pwrite`` on an ``O_DIRECT``
descriptor, each on its own writer thread), the caller fills the next; with one buffer every write is
synchronous. ``write(mv, stable=True)`` skips the copy when ``mv`` lies at a page-aligned address and the file
offset is aligned (a snapshot in page-aligned host memory): its aligned part goes to the device straight
from the caller's memory, ``max(1, buffers - 1)`` slices of ``buf_bytes`` in flight, and the caller keeps
``mv`` unchanged until ``close()``. ``close()`` writes the aligned remainder the same way and the last
partial block through the ordinary descriptor (``O_DIRECT`` needs block-sized lengths). Durability is
unchanged: the caller still fsyncs the file (which now has almost nothing dirty to flush). Where
``O_DIRECT`` is refused (tmpfs, some network filesystems) -- at open, or on a write with ``EINVAL`` -- it
falls back to plain writes. ``ZCKPT_DIRECT_IO=0`` turns it off. ``hash_fn`` (the sink's sha256, queued on
its hash thread) sees every byte in stream order: a full buffer as it is handed to a writer thread (the
buffer is refilled once both are done), memory written in place as it is queued; the caller's ``write``
only copies, so hashing and device writes run back to back on their own threads.

``preallocate(fd, size)`` allocates a file whose size the writer knows up front (``HashingSink(size=)``), so
that a disk too small fails at open.

``reserve()`` / ``commit(n)`` let the caller fill the current buffer in place (a small record read straight
into it: no copy, no wait unless every buffer is in flight).

``read_direct(fd, offset, buf)`` fills an aligned buffer from an aligned file offset with one ``O_DIRECT``
``pread`` loop (short at the end of the file), falling back to a plain ``pread`` where it is refused.
``aligned_buffer`` allocates such a buffer; ``address`` says where a buffer lies.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import functools
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from zckpt.storage.threads import Pool

BUF_BYTES = 16 << 20
"""Default bytes per ``O_DIRECT`` write (two such buffers per open file)."""
ALIGN = 4096
"""Offset, length and address alignment for ``O_DIRECT`` (the logical block size is at most this)."""


HashFn = Callable[[memoryview], "Future[None]"]
"""Queue hashing of a byte range (in stream order); the future completes once it is hashed."""


def enabled() -> bool:
    return hasattr(os, "O_DIRECT") and os.environ.get("ZCKPT_DIRECT_IO", "1") != "0"


@dataclass(frozen=True)
class WriteOptions:
    """How an output file goes to the device (the engine's ``checkpoint.writer`` block maps onto this)."""

    direct: bool = True
    """``O_DIRECT`` where the filesystem takes it (and ``ZCKPT_DIRECT_IO`` is not 0); False: buffered."""
    buf_bytes: int = BUF_BYTES
    """Bytes per device write (a multiple of ``ALIGN``)."""
    buffers: int = 2
    """Buffers per file: one is filled while up to ``buffers - 1`` are written (1: synchronous writes)."""

    def __post_init__(self) -> None:
        if self.buf_bytes < ALIGN or self.buf_bytes % ALIGN:
            raise ValueError(f"buf_bytes must be a positive multiple of {ALIGN}, got {self.buf_bytes}")
        if self.buffers < 1:
            raise ValueError(f"buffers must be >= 1, got {self.buffers}")

    @property
    def in_flight(self) -> int:
        """Device writes outstanding at once."""
        return max(1, self.buffers - 1)


def address(mv: memoryview) -> int:
    """The address of ``mv``'s first byte."""
    if not len(mv):
        return 0
    return int(np.frombuffer(mv, dtype=np.uint8).__array_interface__["data"][0])


def aligned_buffer(nbytes: int, populate: bool = True) -> mmap.mmap:
    """``nbytes`` of page-aligned anonymous memory (an ``mmap``); with ``populate`` faulted in up front where
    Linux allows (``MAP_POPULATE``), so a later copy into it runs at memory speed."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(-1, max(nbytes, 1), flags=flags)


class DirectWriter:
    """Appends bytes to the file behind ``fd`` (opened for writing, empty), bypassing the page cache."""

    def __init__(
        self, path: str, fd: int, opts: WriteOptions | None = None, hash_fn: HashFn | None = None
    ) -> None:
        self.opts = opts or WriteOptions()
        self._hash_fn = hash_fn
        self._hashes: list[Future[None] | None] = []  # per buffer: the hash reading it
        self._loose: list[Future[None]] = []  # hashes of memory written in place
        self._fd = fd
        self._dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)  # OSError: the caller writes plainly
        self._bufs: list[mmap.mmap] = []  # allocated on the first copied byte
        self._cur = 0
        self._fill = 0
        self._off = 0  # file offset of the current buffer's first byte
        self._pool = Pool(self.opts.in_flight, thread_name_prefix="zckpt-direct")
        self._pending: collections.deque[Future[None]] = collections.deque()
        self._direct = True
        self._stats_lock = threading.Lock()
        self.busy_s = 0.0
        """Seconds the device writes took, summed over writer threads (statistics)."""
        self.copied = 0
        """Bytes that went through the buffers (the rest was written from the caller's memory)."""

    # -- copied writes -----------------------------------------------------------------------------
    def write(self, mv: memoryview, stable: bool = False) -> None:
        """Append ``mv``. ``stable``: it stays unchanged until ``close()``, so aligned memory is written
        without a copy."""
        if stable and self._fill == 0 and self._off % ALIGN == 0 and address(mv) % ALIGN == 0:
            mv = self._write_in_place(mv)
        pos, n = 0, len(mv)
        size = self.opts.buf_bytes
        self.copied += n
        while pos < n:
            if not self._bufs:
                self._bufs = [mmap.mmap(-1, size) for _ in range(self.opts.buffers)]
                self._hashes = [None] * len(self._bufs)
            buf = self._bufs[self._cur]
            take = min(n - pos, size - self._fill)
            buf[self._fill : self._fill + take] = mv[pos : pos + take]
            self._fill += take
            pos += take
            if self._fill == size:
                self._hand_over()

    def _hand_over(self) -> None:
        """Send the full current buffer to the hash and a writer thread; move to the next, once free."""
        self._hashes[self._cur] = self._hash(memoryview(self._bufs[self._cur])[: self._fill])
        self._submit(partial(self._write_buffer, self._cur, self._fill, self._off), self.opts.buffers - 1)
        self._off += self._fill
        self._cur = (self._cur + 1) % len(self._bufs)
        self._fill = 0
        self._wait_hash(self._cur)

    def _hash(self, view: memoryview) -> Future[None] | None:
        return self._hash_fn(view) if self._hash_fn is not None and len(view) else None

    def _wait_hash(self, i: int) -> None:
        h, self._hashes[i] = self._hashes[i], None
        if h is not None:
            h.result()

    def _wait_hashes(self) -> None:
        for i in range(len(self._hashes)):
            self._wait_hash(i)
        while self._loose:
            self._loose.pop(0).result()

    def _submit(self, job: Callable[[], None], limit: int) -> Future[None]:
        """Queue ``job``, then wait until at most ``limit`` queued jobs are unfinished (oldest first)."""
        f = self._pool.submit(job)
        self._pending.append(f)
        while len(self._pending) > limit:
            self._pending.popleft().result()
        return f

    def _wait(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def _write_buffer(self, i: int, n: int, off: int) -> None:
        with memoryview(self._bufs[i]) as whole:
            self._pwrite(whole[:n], off)

    # -- writes straight from the caller's memory ---------------------------------------------------
    def write_owned(self, mv: memoryview) -> list[Future[None]]:
        """Append ``mv``, written from where it lies when it is page-aligned at an aligned file offset
        (else copied); returns what must finish before the caller may change ``mv`` (empty: copied)."""
        if self._fill or self._off % ALIGN or address(mv) % ALIGN:
            self.write(mv)
            return []
        busy: list[Future[None]] = []
        self.write(self._write_in_place(mv, busy))
        return busy

    def _write_in_place(self, mv: memoryview, busy: list[Future[None]] | None = None) -> memoryview:
        """Queue the aligned part of ``mv`` (page-aligned, at an aligned file offset) for writing from where
        it lies; returns the unaligned tail, which the caller copies. ``busy`` collects the hash and the
        writes that read ``mv``."""
        aligned = len(mv) - len(mv) % ALIGN
        step = self.opts.buf_bytes
        h = self._hash(mv[:aligned])
        if h is not None:
            if len(self._loose) >= 64:
                self._loose = [f for f in self._loose if not f.done()]
            self._loose.append(h)
            if busy is not None:
                busy.append(h)
        for a in range(0, aligned, step):
            f = self._submit(
                partial(self._pwrite, mv[a : min(aligned, a + step)], self._off + a), self.opts.in_flight
            )
            if busy is not None:
                busy.append(f)
        self._off += aligned
        return mv[aligned:]

    # -- filled in place --------------------------------------------------------------------------
    def reserve(self) -> memoryview:
        """The free rest of the buffer being filled (at least one byte): the caller writes the stream's next
        bytes straight into it, then ``commit``s how many. No copy, and nothing waits for the device unless
        every buffer is in flight."""
        if not self._bufs:
            self._bufs = [mmap.mmap(-1, self.opts.buf_bytes) for _ in range(self.opts.buffers)]
            self._hashes = [None] * len(self._bufs)
        return memoryview(self._bufs[self._cur])[self._fill :]

    def commit(self, n: int) -> None:
        """``n`` bytes of the last ``reserve`` are the stream's next bytes."""
        if n < 0 or self._fill + n > self.opts.buf_bytes:
            raise ValueError(f"commit of {n} bytes past the reserved buffer")
        self._fill += n
        self.copied += n
        if self._fill == self.opts.buf_bytes:
            self._hand_over()

    @property
    def head_room(self) -> int:
        """Bytes that complete the current buffer (0 when it is empty)."""
        return self.opts.buf_bytes - self._fill if self._fill else 0

    def _pwrite(self, view: memoryview, off: int) -> None:
        """Write ``view`` (a multiple of ``ALIGN`` long) at ``off``; plainly once ``O_DIRECT`` is refused."""
        t0 = time.perf_counter()
        while len(view):
            if self._direct:
                try:
                    done = os.pwrite(self._dfd, view, off)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self._direct = False  # the filesystem takes O_DIRECT opens but not its writes
                    continue
                if done % ALIGN:  # a short, unaligned write: finish this buffer plainly
                    self._direct = False
            else:
                done = os.pwrite(self._fd, view, off)
            view, off = view[done:], off + done
        with self._stats_lock:
            self.busy_s += time.perf_counter() - t0

    def close(self) -> None:
        """Write what is buffered (the last partial block plainly) and release the buffers; the caller
        fsyncs and closes ``fd``."""
        try:
            self._wait()
            self._write_rest()
            self._wait_hashes()
        finally:
            self.abort()

    def _write_rest(self) -> None:
        if not self._fill:
            return
        self._hashes[self._cur] = self._hash(memoryview(self._bufs[self._cur])[: self._fill])
        aligned = self._fill - self._fill % ALIGN
        with memoryview(self._bufs[self._cur]) as whole:
            if aligned:
                self._pwrite(whole[:aligned], self._off)
            tail, off = whole[aligned : self._fill], self._off + aligned
            while len(tail):
                done = os.pwrite(self._fd, tail, off)
                tail, off = tail[done:], off + done
            tail.release()

    def drop(self) -> None:
        """Release the descriptor and the pool without waiting for anything (a sink being collected)."""
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(OSError):
            os.close(self._dfd)

    def abort(self) -> None:
        """Release everything without writing what is still buffered (after an error)."""
        try:
            with contextlib.suppress(OSError):
                self._wait()
            with contextlib.suppress(Exception):
                self._wait_hashes()  # nothing may still read the buffers
        finally:
            self._pending.clear()
            self._pool.shutdown()
            os.close(self._dfd)
            for b in self._bufs:
                # a view still referenced (by an error's traceback) keeps it open: freed along with it
                with contextlib.suppress(BufferError):
                    b.close()


def preallocate(fd: int, size: int) -> bool:
    """Allocate ``size`` bytes of the (empty) file behind ``fd`` up front (Linux ``fallocate``, mode 0: the
    file is ``size`` long, its blocks allocated, reading as zeros until written). A full disk or quota then
    fails here, before the first byte is written, not after the rest (and the file is not fragmented by
    writes that each extend it). Not a speed change on the ext4 disks measured (``bench/write_modes.py``,
    bench/RESULTS.md 2026-12-06 11:53). False where the filesystem or platform cannot (nothing changed then);
    ``OSError`` for a full disk, a quota or the file size limit."""
    if size <= 0 or not sys.platform.startswith("linux"):
        return False
    fn = _fallocate()
    if fn is None:
        return False
    if fn(fd, 0, ctypes.c_int64(0), ctypes.c_int64(size)) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        raise OSError(err, os.strerror(err))
    return False  # EOPNOTSUPP (NFSv3, many FUSE filesystems), EINVAL, ENOSYS: written as before


@functools.cache
def _fallocate() -> Any:
    """libc's ``fallocate`` (not ``posix_fallocate``, which falls back to writing zeros block by block where
    the filesystem cannot allocate), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


# -- reads -----------------------------------------------------------------------------------------
def open_direct(path: str) -> int | None:
    """A read-only ``O_DIRECT`` descriptor of ``path``, or None where that is refused or turned off."""
    if not enabled():
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


def read_direct(dfd: int | None, fd: int, offset: int, buf: memoryview) -> int:
    """Fill ``buf`` with the file's bytes from ``offset`` (both aligned for ``dfd``, the ``O_DIRECT``
    descriptor, when given; else ``fd`` is read plainly); returns the bytes read (fewer at the end of the
    file)."""
    done, n = 0, len(buf)
    use = dfd if dfd is not None and offset % ALIGN == 0 and address(buf) % ALIGN == 0 else None
    while done < n:
        try:
            k = os.preadv(use if use is not None else fd, [buf[done:]], offset + done)
        except OSError as e:
            if use is None or e.errno != errno.EINVAL:
                raise
            use = None  # the filesystem takes O_DIRECT opens but not its reads
            continue
        if k <= 0:
            break
        done += k
        if use is not None and k % ALIGN:  # a short direct read: the end of the file, or finish plainly
            use = None
    return done
