"""Whole-file integrity scans for ``verify``, many in flight: the CRC-32 of byte ranges (zip records) and
the sha256 of whole files.

A zip record's CRC-32 is cut into ``CHUNK_BYTES`` pieces read with ``pread`` and checksummed (ISA-L's
``crc32`` where installed) on a pool of threads, then joined with ``crc32_combine``: one 18 GB record is
checked at the speed of the disk, not of one core (``zipfile.testzip`` is one zlib stream on one thread).
A whole-file sha256 is one sequential stream by nature, so files are hashed side by side instead
(``Scanner.sha256``). Both release the GIL while they read and checksum. Threads: ``threads()`` (the usable
cores, at most 16, ``ZCKPT_WORKERS`` overrides); memory: one ``CHUNK_BYTES`` buffer per busy thread.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from zckpt.storage import env, fileio
from zckpt.storage.checks import crc32, crc32_combine
from zckpt.storage.location import Location
from zckpt.storage.threads import Pool

CHUNK_BYTES = 32 << 20
_READ = 8 << 20
_local = threading.local()


def cores() -> int:
    """The cores this process may run on (``zckpt.storage.env.cores``: its CPU affinity)."""
    return env.cores()


_SHARING: contextvars.ContextVar[int] = contextvars.ContextVar("zckpt_sharing", default=1)
"""Output files the running operation writes at once (``zckpt.stream.pipeline.each_file``): they share the
cores and the I/O buffers. Per operation (carried into its threads), not per process."""


def sharing() -> int:
    """How many output files this operation is writing side by side now (1 outside ``each_file``)."""
    return _SHARING.get()


@contextlib.contextmanager
def shared(k: int) -> Iterator[None]:
    """``k`` output files are written side by side inside the block (the count before is restored after)."""
    token = _SHARING.set(k)
    try:
        yield
    finally:
        _SHARING.reset(token)


def threads(cap: int = 16, per: int = 1) -> int:
    """Threads for work that scales with cores: one per ``per`` usable cores, at most ``cap`` (scans: every
    core, at most 16); ``ZCKPT_WORKERS`` overrides (``zckpt.storage.env``)."""
    return env.workers(min(cap, cores() // per))


def _buf() -> memoryview:
    b = getattr(_local, "buf", None)
    if b is None:
        b = _local.buf = memoryview(bytearray(_READ))
    return b


def _crc_piece(fd: fileio.Handle, lo: int, n: int) -> int:
    """CRC-32 of ``n`` bytes at ``lo`` (a short file: ``EOFError``). An object's piece is one sequential read
    up to its end: fetched ahead by a read-ahead stream (``objstore.ahead``), not one GET per read. (A local
    piece queued whole for reading first, ``posix_fadvise(WILLNEED)``, made a cold verify slower here: 10.3
    against 8.0 s for 4.85 GB on 2 cores, medians of 4 interleaved runs.)"""
    buf, crc, pos, end = _buf(), 0, lo, lo + n
    while pos < end:
        view = buf[: min(_READ, end - pos)]
        k = fileio.pread_into(fd, view, pos, end if fd.remote else None)
        if k <= 0:
            raise EOFError(f"file ends at byte {pos}")
        crc = crc32(view[:k], crc)
        pos += k
    return crc


def crc_ranges(
    path: str | Location, ranges: Sequence[tuple[int, int]], pool: ThreadPoolExecutor
) -> list[int]:
    """The CRC-32 of each ``(start, size)`` byte range of the file, computed in ``CHUNK_BYTES`` pieces on
    ``pool`` (a short file: ``EOFError``)."""
    fd = fileio.open_fd(str(path))
    try:
        return PendingCrcs(fd, ranges, pool).result()
    finally:  # the pending pieces are all done or cancelled by now (``result``)
        fileio.close_fd(fd)


Segment = tuple[int, int, int]
"""``(start, bytes, crc)``: the CRC-32 of a byte range of a file."""


def crc_segments(
    path: str | Location, ranges: Sequence[tuple[int, int]], pool: ThreadPoolExecutor, edge: int
) -> list[list[Segment]]:
    """``crc_ranges``, each range's CRC-32 given in segments cut at the multiples of ``edge`` (a file's block
    digest: ``zckpt.storage.crc_pieces`` combines them into both the range's and each block's CRC). Read as
    ``crc_ranges`` reads (``CHUNK_BYTES`` pieces, small ranges close together in one ``pread``): a piece is
    cut where its CRC is, not where it is read (pieces cut at 16 MiB edges made a cold verify slower)."""
    flat: list[tuple[int, int]] = []
    owner: list[int] = []
    for i, (start, size) in enumerate(ranges):
        if size >= SMALL_BYTES:
            flat.append((start, size))
            owner.append(i)
            continue
        a, end = start, start + size
        while a < end:  # a small range is checksummed whole (``_crc_run``): cut it here
            b = min(end, (a // edge + 1) * edge)
            flat.append((a, b - a))
            owner.append(i)
            a = b
    fd = fileio.open_fd(str(path))
    futs: list[tuple[list[int], Future[Any], bool]] = []  # (flat indices, future, a run of small ranges)
    try:
        cut = CHUNK_BYTES if not fd.remote else max((n for _, n in flat), default=1)
        for group in _small_runs(flat):
            start, size = flat[group[0]]
            if len(group) > 1 or size < SMALL_BYTES:
                futs.append((group, pool.submit(_crc_run, fd, [flat[j] for j in group]), True))
                continue
            for a in range(0, size, cut):
                futs.append((group, pool.submit(_crc_split, fd, start + a, min(cut, size - a), edge), False))
        out: list[list[Segment]] = [[] for _ in ranges]
        for group, fut, run in futs:
            if run:
                for j, crc in zip(group, fut.result(), strict=True):
                    out[owner[j]].append((flat[j][0], flat[j][1], crc))
            else:
                out[owner[group[0]]] += fut.result()
        return out
    finally:  # no piece may still read the descriptor once it is closed
        for _, fut, _ in futs:
            fut.cancel()
        for _, fut, _ in futs:
            if not fut.cancelled():
                with contextlib.suppress(BaseException):
                    fut.result()
        fileio.close_fd(fd)


def _crc_split(fd: fileio.Handle, lo: int, n: int, edge: int) -> list[Segment]:
    """``_crc_piece`` of ``n`` bytes at ``lo``, its CRC-32 in segments cut at the multiples of ``edge``."""
    buf, out, pos, end = _buf(), [], lo, lo + n
    seg, crc = lo, 0
    while pos < end:
        view = buf[: min(_READ, end - pos)]
        k = fileio.pread_into(fd, view, pos, end if fd.remote else None)
        if k <= 0:
            raise EOFError(f"file ends at byte {pos}")
        a = pos
        while a < pos + k:
            b = min(pos + k, (a // edge + 1) * edge)
            crc = crc32(view[a - pos : b - pos], crc)
            if b % edge == 0 or b == end:
                out.append((seg, b - seg, crc))
                seg, crc = b, 0
            a = b
        pos += k
    return out


SMALL_BYTES = 1 << 20
"""Ranges smaller than this that lie close together (a torch archive's many small records: a large world's
rank files hold hundreds) are read with one ``pread`` and checksummed by one task, so their cost follows
their bytes, not their count."""
_GAP = 64 << 10


def _small_runs(ranges: Sequence[tuple[int, int]]) -> list[list[int]]:
    """Indices of ``ranges`` in groups: consecutive small ranges at most ``_GAP`` apart and ``_READ`` long in
    all share a group; every other range is a group of its own."""
    groups: list[list[int]] = []
    lo = end = -1
    for i, (start, size) in enumerate(ranges):
        small = size < SMALL_BYTES
        if small and groups and lo >= 0 and 0 <= start - end <= _GAP and start + size - lo <= _READ:
            groups[-1].append(i)
        else:
            groups.append([i])
            lo = start if small else -1
        end = start + size
    return groups


def _crc_run(fd: fileio.Handle, ranges: Sequence[tuple[int, int]]) -> list[int]:
    """The CRC-32 of each of ``ranges`` (close together, ascending), read with one ``pread`` (a short file:
    ``EOFError``)."""
    lo = ranges[0][0]
    hi = ranges[-1][0] + ranges[-1][1]
    view, got = _buf()[: hi - lo], 0
    while got < hi - lo:
        k = fileio.pread_into(fd, view[got:], lo + got)
        if k <= 0:
            raise EOFError(f"file ends at byte {lo + got}")
        got += k
    return [crc32(view[s - lo : s - lo + n]) for s, n in ranges]


class PendingCrcs:
    """The CRC-32s of byte ranges of an open descriptor, being computed in pieces on a pool (small ranges
    close together in one task: ``SMALL_BYTES``): ``result`` waits for them; the caller keeps the descriptor
    open until it has returned."""

    def __init__(
        self, fd: fileio.Handle, ranges: Sequence[tuple[int, int]], pool: ThreadPoolExecutor
    ) -> None:
        self._jobs: list[list[tuple[Future[int], int]]] = []
        self._runs: list[tuple[Future[list[int]], int]] = []
        self._order: list[tuple[bool, int, int]] = []  # (in a run, job or run index, position in the run)
        # an object's record is one piece: one streamed GET (per ``ahead.MAX_REQUEST``), where 32 MiB pieces
        # cost a GET each (and a store that builds the whole object for a ranged GET, that object's size)
        cut = CHUNK_BYTES if not fd.remote else max((n for _, n in ranges), default=1)
        for group in _small_runs(ranges):
            if len(group) > 1:
                part = [ranges[i] for i in group]
                self._runs.append((pool.submit(_crc_run, fd, part), len(part)))
                self._order += [(True, len(self._runs) - 1, k) for k in range(len(group))]
                continue
            start, size = ranges[group[0]]
            cuts = [(a, min(cut, size - a)) for a in range(0, size, cut)]
            self._jobs.append([(pool.submit(_crc_piece, fd, start + a, n), n) for a, n in cuts])
            self._order.append((False, len(self._jobs) - 1, 0))

    def result(self) -> list[int]:
        try:
            out = []
            for in_run, j, k in self._order:
                if in_run:
                    out.append(self._runs[j][0].result()[k])
                    continue
                crc = 0
                for fut, n in self._jobs[j]:
                    crc = crc32_combine(crc, fut.result(), n)
                out.append(crc)
            return out
        finally:  # no piece may still read the descriptor once the caller closes it
            self.cancel()

    def cancel(self) -> None:
        """Cancel what has not started and wait for what has (a piece never outlives its descriptor)."""
        futs: list[Future[Any]] = [fut for job in self._jobs for fut, _ in job]
        futs += [fut for fut, _ in self._runs]
        for fut in futs:
            fut.cancel()
        for fut in futs:
            if not fut.cancelled():
                with contextlib.suppress(BaseException):
                    fut.result()


def sha256_file(f: str | Location) -> str:
    """The whole file's sha256, read in order on this thread (hashlib releases the GIL)."""
    h = hashlib.sha256()
    fd = fileio.open_fd(str(f))
    try:
        buf, pos, end = _buf(), 0, fileio.fd_size(fd) if fd.remote else None  # an object: streamed ahead
        while k := fileio.pread_into(fd, buf, pos, end):
            h.update(buf[:k])
            pos += k
    finally:
        fileio.close_fd(fd)
    return h.hexdigest()


class Scanner:
    """The thread pool of one verify run: ``crc_ranges`` pieces and whole-file sha256s share it."""

    def __init__(self, n: int | None = None) -> None:
        self.width = n or threads()
        """Threads computing CRC pieces (and, on the other pool, sha256s)."""
        self.pool = Pool(self.width, thread_name_prefix="zckpt-scan")
        self._crc_pool = Pool(self.width, thread_name_prefix="zckpt-crc")
        self._sha: dict[str, Future[str]] = {}
        self._lock = threading.Lock()

    def sha256(self, f: str | Location) -> Future[str]:
        """The file's sha256, computed once on the pool however often it is asked for."""
        key = str(f)
        with self._lock:
            if key not in self._sha:
                self._sha[key] = self.pool.submit(sha256_file, key)
            return self._sha[key]

    def crc_ranges(self, path: str | Location, ranges: Sequence[tuple[int, int]]) -> list[int]:
        return crc_ranges(path, ranges, self._crc_pool)

    def crc_segments(
        self, path: str | Location, ranges: Sequence[tuple[int, int]], edge: int
    ) -> list[list[Segment]]:
        return crc_segments(path, ranges, self._crc_pool, edge)

    def crc_pending(self, fd: fileio.Handle, ranges: Sequence[tuple[int, int]]) -> PendingCrcs:
        """The CRC-32s of ``ranges`` of the open ``fd``, started now (see ``PendingCrcs``)."""
        return PendingCrcs(fd, ranges, self._crc_pool)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self._crc_pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Scanner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
