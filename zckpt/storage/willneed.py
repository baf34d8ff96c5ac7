"""Read-ahead of local input files on a cold page cache: an ``Advisor`` asks the kernel to start reading the
byte ranges a reader will need soon (``posix_fadvise(POSIX_FADV_WILLNEED)``), on a thread of its own.

The kernel reads ahead of one sequential reader by a window of ``read_ahead_kb``, and the ``pread`` of a
filling thread waits for its own bytes: on a cold cache the device sees few requests at a time (measured on
the 2-core machine: a cold 2 GiB file read in 16 MiB ``pread`` calls at 0.8-1.0 GB/s, 1.5-1.8 GB/s with the
next 64 MiB advised ahead). Advised ranges are queued as reads at once, so the device works on the next
pieces while the current ones are cast and written. (In a whole cold consolidate on that machine, whose disk
other sessions kept busy, the difference was within the noise: ``bench/RESULTS.md``, 2026-12-06 03:00.)

One ``WILLNEED`` call queues at most ``max(read_ahead_kb, max_sectors_kb)`` of the device (the kernel's cap,
``force_page_cache_ra``: a 64 MiB call queued 8 MiB here) and waits while the device's queue is full, so a
range is cut into calls of that size (``call_bytes``) made on the advisor's thread, never the reader's.
Memory: the page cache only (clean pages the kernel may drop), at most what the caller advises ahead of its
reading. Object URLs, and files that cannot be opened, are skipped: the reader reads them (and reports them)
as it always does. Nothing here changes a byte read: the kernel only reads sooner what the reader reads.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from pathlib import Path

from zckpt.storage import objstore
from zckpt.storage.threads import start

_MIN_CALL = 128 << 10
"""The smallest cap a device may have (Linux's default ``read_ahead_kb``): always queued whole."""
_MAX_CALL = 8 << 20


def call_bytes(dev: int) -> int:
    """The most one ``WILLNEED`` call queues on the device ``dev`` (an ``st_dev``):
    ``max(read_ahead_kb, max_sectors_kb)`` of its queue in sysfs (a partition's is its disk's), within
    [128 KiB, 8 MiB]; 128 KiB where unknown."""
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for q in (base / "queue", base / ".." / "queue"):
        with contextlib.suppress(OSError, ValueError):
            kb = max(int((q / f).read_text()) for f in ("read_ahead_kb", "max_sectors_kb"))
            return min(_MAX_CALL, max(_MIN_CALL, kb << 10))
    return _MIN_CALL


def advise_now(fd: int, offset: int, nbytes: int, step: int) -> None:
    """Queue reads of bytes ``[offset, offset + nbytes)`` of the open local file ``fd`` now, on this thread,
    in calls of ``step`` bytes (``call_bytes``) on the cap's grid; returns once they are queued (a call waits
    while the device's queue is full), not read. A refused call ends it quietly (the reader reads anyway)."""
    a, end = offset, offset + nbytes
    while a < end:
        k = min(step - a % step, end - a)  # calls on the cap's grid: each one queued whole
        try:
            os.posix_fadvise(fd, a, k, os.POSIX_FADV_WILLNEED)
        except OSError:
            return
        a += k


class Advisor:
    """Advise the kernel of ranges of local files a reader needs soon (see the module doc). ``advise``
    queues a range and returns at once; the calls run in order on one thread, started at the first range.
    Use it as a context manager: leaving stops the thread (what was not advised yet is dropped) and closes
    its descriptors."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[str, int, int] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._fds: dict[str, tuple[int, int] | None] = {}
        self._calls: dict[int, int] = {}  # bytes per call, by device

    def advise(self, path: str, offset: int, nbytes: int) -> None:
        """Bytes ``[offset, offset + nbytes)`` of the local file ``path`` are read soon."""
        if nbytes <= 0 or not hasattr(os, "posix_fadvise") or objstore.is_url(path):
            return
        if self._thread is None:
            self._thread = start(self._run, name="zckpt-willneed")
        self._q.put((path, offset, nbytes))

    def _fd(self, path: str) -> tuple[int, int] | None:
        """(descriptor, bytes per call) of ``path``, opened once; None where it cannot be opened."""
        if path not in self._fds:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                self._fds[path] = None
            else:
                dev = os.fstat(fd).st_dev
                if dev not in self._calls:
                    self._calls[dev] = call_bytes(dev)
                self._fds[path] = (fd, self._calls[dev])
        return self._fds[path]

    def _run(self) -> None:
        while not self._stop.is_set():
            job = self._q.get()
            if job is None:
                return
            path, a, n = job
            got = self._fd(path)
            if got is None:
                continue
            fd, step = got
            for lo in range(a, a + n, 16 * step):  # the stop is seen between runs of 16 calls
                if self._stop.is_set():
                    break
                advise_now(fd, lo, min(16 * step, a + n - lo), step)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None
        for got in self._fds.values():
            if got is not None:
                os.close(got[0])
        self._fds.clear()

    def __enter__(self) -> Advisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Advisor", "advise_now", "call_bytes"]
