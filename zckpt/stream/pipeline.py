"""Streaming tensors to a file at disk speed: read, cast and write overlapped, in bounded memory.

``write_items(sink, items)`` writes each ``WriteItem``'s bytes (in order, output dtype) to ``sink``.
Work is cut into chunks of at most ``CHUNK_BYTES`` of source bytes; a pool of ``workers`` threads
fills a ring of reusable buffers — ``pread`` of exactly the chunk's byte range from the rank file
(``fileio.read_into``: no mmap page faults, no page tables, nothing left in the process's RSS),
plus a cast when the output dtype differs (``zckpt.stream.cast``) — while the calling thread writes the
finished chunks in order with large sequential writes (a ``HashingSink`` hashes each chunk on its own
thread while it is being written). ``pread``, numpy and torch casts, file writes and hashing all
release the GIL, so the stages run in parallel on separate cores. Memory: ``workers + 2`` slots of
one source chunk (plus its cast), whatever the model size; no Python loop ever touches elements.

``default_workers()`` is the pool size when none is given: the usable cores, at least 1 and at most 8,
divided among the files ``each_file`` writes side by side, overridable with ``ZCKPT_WORKERS``. The writer
threads wait in the kernel and the hash lanes keep up, so they need no core of their own: on 2 cores (numpy
casts, bench/RESULTS.md 2026-12-06 13:18) 2 fillers took a CPU-bound consolidate to 0.64-0.85 of 1 filler's
wall, and a disk-bound one stayed where it was; on the 16-core H200 host 4 fillers left a 1.5B consolidate
waiting on its reads a third of its write phase. An object-store source is filled by ``REMOTE_WORKERS``
threads when none is asked for.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

import numpy as np

from zckpt.dtypes import DType, torch_of
from zckpt.storage import checks, env, fileio, willneed
from zckpt.storage.scan import cores as _cores
from zckpt.storage.scan import shared, sharing
from zckpt.storage.threads import Pool, start
from zckpt.stream.fill import Layout, layout_of_items
from zckpt.stream.spans import CHUNK_BYTES, Span, spans, windows

if TYPE_CHECKING:
    import torch

    from zckpt.storage.sink import FillRing
    from zckpt.stream.items import WriteItem

T = TypeVar("T")
R = TypeVar("R")


class Sink(Protocol):
    def write(self, b: memoryview) -> int: ...


READ_AHEAD_BYTES = 64 << 20
"""Output bytes past the pieces being filled whose local sources the kernel is asked to read already
(``zckpt.storage.willneed``; the sources of a cast are larger: fp32 read for bf16, twice). Page cache, not
this process's memory."""


def default_workers() -> int:
    """Reader threads of a write: the usable cores, at most 8 (``ZCKPT_WORKERS`` overrides,
    ``zckpt.storage.env``); files written side by side share them."""
    return max(1, env.workers(min(8, _cores())) // sharing())


REMOTE_WORKERS = 1
"""Fill threads of a write whose source is an object (``s3://``) when none is asked for: each record's bytes
come from a read-ahead stream on a thread of its own (``zckpt.storage.objstore.ahead``), so the fetches of
the rank files already run side by side. More fill threads read one record at places further apart than a
stream holds in memory: its windows were dropped before they were read and fetched again (2 fill threads on
2 cores, ``bench/s3_bench.py``, moto: 1.02-1.35x the bytes the output needs, 21-49 requests, 4.3-11.3 s,
against 1.003x, 17 requests, 3.0 s with one; RESULTS "18:50")."""


def files_in_flight(n: int) -> int:
    """Output files ``each_file`` writes at once: one per 4 usable cores (a file's stream has a reader, a
    writer, a hasher and a device writer), at most 4 and at most ``n``; ``ZCKPT_FILES`` overrides. On 2 cores:
    1, one file after another as before."""
    k = env.count(env.FILES)
    return max(1, min(n, k if k is not None else min(4, _cores() // 4)))


def each_file(write: Callable[[T], R], jobs: Sequence[T]) -> list[R]:
    """``write(job)`` for every job (one output file, or one rank's files, each), ``files_in_flight`` at
    once, results in order. A file's sha256 is one sequential stream on one core (1.1-1.4 GB/s with SHA-NI),
    slower than an NVMe disk: streams side by side are what let a many-file output reach the disk's speed.
    The first error is raised once the files already started have stopped."""
    k = files_in_flight(len(jobs))
    if k <= 1:
        return [write(j) for j in jobs]
    with Pool(k, thread_name_prefix="zckpt-file") as pool, shared(k):
        futures = [pool.submit(write, j) for j in jobs]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise


@dataclass(frozen=True)
class _Task:
    span: Span | None  # None: ``n`` zeros (padding)
    n: int
    dtype: DType | torch.dtype  # output dtype


def item_tasks(it: WriteItem, chunk_bytes: int = CHUNK_BYTES) -> Iterator[_Task]:
    """The chunks of one item, in output order: its spans, then its padding."""
    lo, hi = it.range
    src = max((p.dtype.itemsize for p in it.entry.pieces), default=1)
    step = max(1, chunk_bytes // max(src, it.dtype.itemsize))
    for s in spans(it.entry, lo, hi, step):
        yield _Task(s, s.n, it.dtype)
    for a, b in windows(0, it.pad, step):
        yield _Task(None, b - a, it.dtype)


def _tasks(items: Sequence[WriteItem], chunk_bytes: int) -> Iterator[_Task]:
    for it in items:
        yield from item_tasks(it, chunk_bytes)


class _Slot:
    """One reusable buffer: raw source bytes, and (when casting) the cast output (a plain sink's path, in
    torch: sinks that take reusable memory are filled by ``fill``, which needs no torch)."""

    def __init__(self, nbytes: int) -> None:
        import torch

        self.raw = torch.empty(nbytes, dtype=torch.uint8)
        self.cast: torch.Tensor | None = None

    def fill(self, t: _Task) -> memoryview:
        import torch

        s = t.span
        dtype = torch_of(t.dtype)
        if s is None:
            src = torch.zeros(t.n, dtype=dtype)
        elif s.piece.value is not None:
            src = s.piece.inline().reshape(-1)[s.offset : s.offset + s.n]
        else:
            raw = self.raw[: t.n * s.piece.dtype.itemsize]
            fileio.read_into(s.piece.file, s.byte_offset, raw, checks.record_end(s.piece))
            checks.consumed(s.piece.check, s.byte_offset, raw)
            src = raw.view(s.piece.dtype.torch)
            if src.dtype == dtype:
                return _bytes(src)
        out_bytes = t.n * t.dtype.itemsize
        if self.cast is None or self.cast.numel() < out_bytes:
            self.cast = torch.empty(max(out_bytes, self.raw.numel()), dtype=torch.uint8)
        out = self.cast[:out_bytes].view(dtype)
        out.copy_(src)
        return _bytes(out)


def _bytes(t: torch.Tensor) -> memoryview:
    import torch

    return memoryview(t.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


class BlockSink(Sink, Protocol):
    """A sink that takes pieces of reusable memory (``zckpt.storage.sink.HashingSink``): ``fill`` writes to
    it."""

    piece_bytes: int
    head_room: int
    in_flight: int

    def write_owned(self, mv: memoryview) -> list[Future[None]]: ...

    def fill_ring(self) -> FillRing: ...

    def reserve(self) -> memoryview: ...

    def commit(self, n: int) -> None: ...


def _in_place(sink: BlockSink, layout: Layout, lo: int, hi: int, crc: bool, on_bytes: Progress) -> int:
    """Bytes ``[lo, hi)`` of ``layout`` filled on this thread straight into the sink's own buffer
    (``reserve``/``commit``); returns their CRC-32 with ``crc``."""
    out = 0
    while lo < hi:
        mv = sink.reserve()
        n = min(len(mv), hi - lo)
        dst = np.frombuffer(mv, dtype=np.uint8)[:n]
        layout.fill(dst, lo)
        if crc:
            out = checks.crc32_combine(out, checks.crc32(dst.data), n)
        del dst
        sink.commit(n)
        if on_bytes is not None:
            on_bytes(n)
        lo += n
    return out


Progress = Callable[[int], None] | None


def fill(
    sink: BlockSink,
    layout: Layout,
    *,
    workers: int | None = None,
    on_bytes: Progress = None,
    crc: bool = False,
) -> int:
    """Append ``layout``'s bytes to ``sink`` with no copy on the way. The bytes that complete the sink's
    current device buffer, and a last partial piece, are filled on this thread straight into the sink's
    buffer (``reserve``/``commit``: a small record costs no thread and no wait on the device). Whole
    device-write-sized pieces between them are filled side by side on ``workers`` threads (``Layout.fill``:
    reads and casts into page-aligned buffers of the sink's ``FillRing``) and handed over in order, each
    written from where it lies (``write_owned``) while the next ones fill; the ring remembers what still
    reads each buffer, so the next fill goes on without waiting for these writes. Returns the CRC-32 of the
    bytes with ``crc`` (combined from the pieces', computed on the filling threads), else 0."""
    size = layout.nbytes
    if not size:
        return 0
    step = sink.piece_bytes
    head = min(size, sink.head_room)
    out = _in_place(sink, layout, 0, head, crc, on_bytes) if head else 0
    end = head + (size - head) // step * step  # whole pieces: [head, end)
    pieces = [(lo, lo + step) for lo in range(head, end, step)]
    if pieces:
        out = _pieces_fill(sink, layout, pieces, out, workers, on_bytes, crc)
    if end < size:
        c = _in_place(sink, layout, end, size, crc, on_bytes)
        out = checks.crc32_combine(out, c, size - end) if crc else 0
    return out


def _pieces_fill(
    sink: BlockSink,
    layout: Layout,
    pieces: list[tuple[int, int]],
    out: int,
    workers: int | None,
    on_bytes: Progress,
    crc: bool,
) -> int:
    step = sink.piece_bytes
    if workers is None:
        workers = REMOTE_WORKERS if layout.remote else default_workers()
    workers = min(len(pieces), max(1, workers))
    ring = sink.fill_ring()
    cap = workers + sink.in_flight + 1

    def job(i: int, lo: int, hi: int) -> int:
        dst = np.frombuffer(ring.bufs[i], dtype=np.uint8)[: hi - lo]
        layout.fill(dst, lo)
        return checks.crc32(dst.data) if crc else 0

    window: collections.deque[tuple[int, int, int, Future[int]]] = collections.deque()

    def hand_over() -> None:
        nonlocal out
        i, lo, hi, f = window.popleft()
        c = f.result()
        if crc:
            out = checks.crc32_combine(out, c, hi - lo)
        ring.busy(i, sink.write_owned(ring.bufs[i][: hi - lo]))
        if on_bytes is not None:
            on_bytes(hi - lo)

    if len(pieces) == 1:  # one piece: filled here (a pool would cost a thread start and a hand-off)
        lo, hi = pieces[0]
        i = ring.take(cap, step)
        window.append((i, lo, hi, _done(job(i, lo, hi))))
        hand_over()
        return out
    room = fileio.read_ahead(2 * (workers + 1) * step if layout.remote else 0)  # fp32 read for bf16: 2x
    # a local source: the kernel reads the next pieces' bytes while these fill (a cold page cache)
    ahead = -1 if layout.remote else max(1, READ_AHEAD_BYTES // step)
    with room, Pool(workers, thread_name_prefix="zckpt-fill") as pool, willneed.Advisor() as advisor:
        advised = 0
        try:
            for j, (lo, hi) in enumerate(pieces):
                while advised < min(len(pieces), j + 1 + ahead):  # (none for an object: ``expect`` below)
                    for s in layout.sources(*pieces[advised]):
                        advisor.advise(s.piece.file, s.byte_offset, s.n * s.piece.dtype.itemsize)
                    advised += 1
                # hand over what is filled (in order), and at most ``workers + 1`` pieces filling: the other
                # buffers are the ones the device and the hash are reading
                while window and (len(window) > workers or window[0][3].done()):
                    hand_over()
                i = ring.take(cap, step)  # waits for the writes of the piece that used it last
                if layout.remote:  # an object starts fetching the piece's sources from now on
                    for s in layout.sources(lo, hi):
                        fileio.expect(s.piece.file, s.byte_offset, checks.record_end(s.piece))
                window.append((i, lo, hi, pool.submit(job, i, lo, hi)))
            while window:
                hand_over()
        except BaseException:
            for *_, pending in window:
                pending.cancel()
            raise
    return out


def _done(v: int) -> Future[int]:
    f: Future[int] = Future()
    f.set_result(v)
    return f


def write_items(
    sink: Sink,
    items: Sequence[WriteItem],
    *,
    workers: int | None = None,
    on_bytes: Callable[[int], None] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> int:
    """Write the items' bytes to ``sink`` in order (see the module doc); returns the bytes written. A sink
    that takes reusable memory (``BlockSink``) is filled block by block (``fill``)."""
    if hasattr(sink, "write_owned"):
        layout = layout_of_items(items)
        fill(cast(BlockSink, sink), layout, workers=workers, on_bytes=on_bytes)
        return layout.nbytes
    workers = default_workers() if workers is None else max(1, workers)
    nslots = workers + 2
    slots = [_Slot(chunk_bytes) for _ in range(nslots)]
    tasks = _tasks(items, chunk_bytes)
    total = 0
    with Pool(workers, thread_name_prefix="zckpt-read") as pool:
        write = sink.write
        window: list[tuple[Future[memoryview], int]] = []
        k = 0
        try:
            for t in tasks:
                if len(window) == nslots:
                    total += _drain(window.pop(0)[0], write, on_bytes)
                if t.span is not None and t.span.piece.value is None:  # an object fetches it from now on
                    p = t.span.piece
                    fileio.expect(p.file, t.span.byte_offset, checks.record_end(p))
                window.append((pool.submit(slots[k % nslots].fill, t), k))
                k += 1
            while window:
                total += _drain(window.pop(0)[0], write, on_bytes)
        except BaseException:
            for f, _ in window:
                f.cancel()
            raise
    return total


def prefetch(it: Iterable[T], depth: int = 2) -> Iterator[T]:
    """Iterate ``it`` on a background thread, up to ``depth`` items ahead of the consumer: a chunk
    producer (reads, casts) overlaps with the consumer's writes. Exceptions are re-raised in order."""
    q: queue.Queue[tuple[int, object]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def run() -> None:
        try:
            for x in it:
                while not stop.is_set():
                    try:
                        q.put((0, x), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((1, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put((2, e))

    t = start(run, name="zckpt-prefetch")
    try:
        while True:
            kind, x = q.get()
            if kind == 1:
                return
            if kind == 2:
                raise x  # type: ignore[misc]
            yield x  # type: ignore[misc]
    finally:
        stop.set()
        while t.is_alive():
            with contextlib.suppress(queue.Empty):
                q.get(timeout=0.1)


def _drain(
    f: Future[memoryview], write: Callable[[memoryview], object], on_bytes: Callable[[int], None] | None
) -> int:
    mv = f.result()
    write(mv)
    if on_bytes is not None:
        on_bytes(len(mv))
    return len(mv)
