"""``ReadPlan``: the tensor reads of one ``load_checkpoint``, done together at disk speed.

A load asks for many ranges of many tensors (this rank's chunk of every master, frozen param and optimizer
state). Read one by one, each is a separate buffered ``pread`` whose readahead stops at the range's end.
Here they are only recorded (``add``: the ranges become byte extents of the pieces that hold them, through
``zckpt.stream.spans.spans``, the same resolution every zckpt reader uses) and ``run()`` reads them file by
file in byte order: extents closer than ``GAP`` are merged (a same-size resume reads each rank file once,
front to back), cut into ``CHUNK``-byte reads with ``O_DIRECT`` (``zckpt.storage.direct_io.read_direct``),
``DEPTH`` of them in flight on reader threads, into page-aligned buffers (pinned when the destinations are
on a GPU). Each finished chunk is scattered into its destinations: bytes go straight into the destination
when its dtype is the stored one (an asynchronous host-to-device copy for GPU tensors, waited for before
the buffer is reused), else into a host temporary that is cast into the destination once complete. Memory:
``DEPTH + 1`` chunk buffers plus the temporaries of casting reads.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from zckpt.errors import CorruptCheckpoint
from zckpt.model import TensorEntry
from zckpt.storage import direct_io, fileio
from zckpt.storage.direct_io import ALIGN
from zckpt.storage.threads import Pool
from zckpt.stream.spans import spans

CHUNK = 64 << 20
"""Bytes per read."""
DEPTH = 3
"""Reads in flight."""
GAP = 1 << 20
"""Extents at most this far apart are read as one (the bytes between are read and dropped)."""


@dataclass
class _Seg:
    """``dst`` (1-D, contiguous, of the stored dtype) is the file's bytes ``[off, off + nbytes)``."""

    off: int
    nbytes: int
    dst: torch.Tensor

    @property
    def end(self) -> int:
        return self.off + self.nbytes


class ReadPlan:
    """Reads recorded by ``add`` and performed by ``run`` (see the module doc)."""

    def __init__(self) -> None:
        self._segs: dict[str, list[_Seg]] = {}
        self._casts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.bytes = 0
        self.stats: dict[str, float | int | bool] = {}
        """After ``run``: the bytes asked for and the seconds ``run`` took, the bytes read from storage (gaps
        between extents included), reads in flight, seconds spent waiting on storage reads and on
        host-to-device copies, and whether ``O_DIRECT`` was used."""

    def add(self, entry: TensorEntry, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements ``[lo, hi)`` of ``entry`` into ``out`` (1-D, ``hi - lo`` elements, any dtype and device)
        when ``run()`` is called; in-memory pieces are copied now."""
        for s in spans(entry, lo, hi):
            dst = out[s.lo - lo : s.lo - lo + s.n]
            p = s.piece
            if p.value is not None:
                dst.copy_(p.inline().reshape(-1)[s.offset : s.offset + s.n])
                continue
            if dst.dtype != p.dtype or not dst.is_contiguous():
                tmp = torch.empty(s.n, dtype=p.dtype.torch)
                self._casts.append((dst, tmp))
                dst = tmp
            self._segs.setdefault(p.file, []).append(_Seg(s.byte_offset, s.n * p.dtype.itemsize, dst))
            self.bytes += s.n * p.dtype.itemsize

    def run(self) -> None:
        """Perform every recorded read."""
        t0 = time.perf_counter()
        files = {path: sorted(segs, key=lambda s: s.off) for path, segs in self._segs.items()}
        chunks = {path: _chunks(segs) for path, segs in files.items()}
        size = max((b - a for cs in chunks.values() for a, b in cs), default=0)
        waits = _Waits()
        if size:
            cuda = any(s.dst.device.type == "cuda" for segs in files.values() for s in segs)
            bufs = [_buffer(size, cuda) for _ in range(DEPTH + 1)]
            with Pool(DEPTH, thread_name_prefix="engine-read") as pool:
                for path, segs in files.items():
                    _read_file(path, segs, chunks[path], bufs, pool, waits)
        for dst, tmp in self._casts:
            dst.copy_(tmp)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.stats = {"bytes": self.bytes, "wall_s": time.perf_counter() - t0,
                      "storage_bytes": sum(b - a for cs in chunks.values() for a, b in cs), "depth": DEPTH,
                      "wait_read_s": round(waits.read_s, 4), "wait_copy_s": round(waits.copy_s, 4),
                      "direct": waits.direct}  # fmt: skip
        self._segs.clear()
        self._casts.clear()


def _buffer(n: int, pinned: bool) -> torch.Tensor:
    if pinned:
        t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        if t.data_ptr() % ALIGN == 0:
            return t
    return torch.frombuffer(direct_io.aligned_buffer(n, populate=False), dtype=torch.uint8)


def _chunks(segs: list[_Seg]) -> list[tuple[int, int]]:
    """Aligned byte ranges covering ``segs`` (sorted): merged extents cut into ``CHUNK``-byte reads."""
    out: list[tuple[int, int]] = []
    a = b = -1
    for s in segs:
        if not s.nbytes:
            continue
        if a >= 0 and s.off - b <= GAP:
            b = max(b, s.end)
            continue
        if a >= 0:
            out += _cut(a, b)
        a, b = s.off, s.end
    if a >= 0:
        out += _cut(a, b)
    return out


def _cut(a: int, b: int) -> list[tuple[int, int]]:
    a -= a % ALIGN
    b += -b % ALIGN
    return [(x, min(b, x + CHUNK)) for x in range(a, b, CHUNK)]


@dataclass
class _Waits:
    """Where ``run``'s caller thread waited: on storage reads, on host-to-device copies out of a buffer."""

    read_s: float = 0.0
    copy_s: float = 0.0
    direct: bool = True


class _Events:
    """Per buffer: the host-to-device copies out of it (a CUDA event), waited for before it is refilled."""

    def __init__(self, n: int) -> None:
        self._ev: list[torch.cuda.Event | None] = [None] * n

    def record(self, i: int) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            ev = torch.cuda.Event()
            ev.record()
            self._ev[i] = ev

    def wait(self, i: int, waits: _Waits) -> None:
        ev, self._ev[i] = self._ev[i], None
        if ev is not None:
            t = time.perf_counter()
            ev.synchronize()
            waits.copy_s += time.perf_counter() - t


def _read_file(
    path: str,
    segs: list[_Seg],
    chunks: list[tuple[int, int]],
    bufs: list[torch.Tensor],
    pool: ThreadPoolExecutor,
    waits: _Waits,
) -> None:
    """Read ``chunks`` of ``path`` (``DEPTH`` in flight, into ``bufs`` in turn), scatter into ``segs``."""
    fd = fileio.open_fd(path)
    local = fd.fd  # None: an object (s3://), ranged GETs through zckpt.storage.fileio, no O_DIRECT
    remote = local is None
    dfd = None if remote else direct_io.open_direct(path)
    waits.direct &= dfd is not None
    events = _Events(len(bufs))
    pending: list[tuple[int, int, int, Future[int]]] = []
    cursor = [0]  # first segment that may still overlap a chunk

    def drain() -> None:
        a, b, i, fut = pending.pop(0)
        t = time.perf_counter()
        got = fut.result()
        waits.read_s += time.perf_counter() - t
        _scatter(path, segs, cursor, a, b, got, bufs[i])
        events.record(i)

    try:
        for k, (a, b) in enumerate(chunks):
            i = k % len(bufs)
            if len(pending) == len(bufs) - 1:
                drain()
            events.wait(i, waits)
            view = memoryview(bufs[i].numpy()).cast("B")[: b - a]  # type: ignore[arg-type]
            if local is None:
                fut = pool.submit(fileio.pread_into, fd, view, a)
            else:
                fut = pool.submit(direct_io.read_direct, dfd, local, a, view)
            pending.append((a, b, i, fut))
        while pending:
            drain()
    finally:
        for f in pending:
            f[3].cancel()
        fileio.close_fd(fd)
        if dfd is not None:
            os.close(dfd)


def _scatter(
    path: str, segs: list[_Seg], cursor: list[int], a: int, b: int, got: int, buf: torch.Tensor
) -> None:
    """Copy the file bytes ``[a, a + got)`` held in ``buf`` into every segment overlapping ``[a, b)``."""
    while cursor[0] < len(segs) and segs[cursor[0]].end <= a:
        cursor[0] += 1
    j = cursor[0]
    while j < len(segs) and segs[j].off < b:
        s = segs[j]
        x, y = max(s.off, a), min(s.end, b)
        if y > a + got:
            end = a + got
            raise CorruptCheckpoint(
                f"{path}: needs bytes up to {y} but ends at {end} (truncated?)", path=path
            )
        if y > x:
            dst = s.dst.view(torch.uint8) if s.dst.dtype != torch.uint8 else s.dst
            dst[x - s.off : y - s.off].copy_(buf[x - a : y - a], non_blocking=dst.device.type == "cuda")
        j += 1
