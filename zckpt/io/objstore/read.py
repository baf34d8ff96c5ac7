"""Ranged reads: ``read_into`` fetches exactly ``[offset, offset + n)`` with ranged GETs, cut into parts of at
most ``part_bytes`` that go out ``in_flight`` at a time. A reader that says how far it reads on (``limit``:
the end of the checksummed record it is in) is served by a read-ahead stream (``ahead``: a few streamed GETs
that fetch up to ``window_bytes`` ahead of it on their own thread and never pass the record's end). Reads
under ``BLOCK`` bytes (headers, pickles, small tensors) come from a small cache of aligned ``BLOCK``-byte
blocks, so neighbouring small reads coalesce into one request; ``prefetch`` fetches several such blocks at
once. Memory: the caller's buffer, at most ``ahead.MAX_WINDOWS`` windows and ``CACHE_BLOCKS`` blocks.
``RemoteFile`` and ``open_read``: a seekable file over an object.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from zckpt.io.objstore import ahead, backend
from zckpt.io.objstore.client import (
    Url,
    _cache,
    _count,
    _lock,
    _options,
    _retry,
    _url,
    in_flight,
    part_bytes,
)
from zckpt.io.objstore.paths import size

BLOCK = 256 << 10
"""Reads smaller than this are served from aligned cached blocks of this size (one request per block)."""
CACHE_BLOCKS = 32
"""Blocks kept (LRU, whole process): 8 MiB at most, plus the room that running fills ask for
(``cache_room``)."""
_pool: ThreadPoolExecutor | None = None
MAX_ROOM = 64 << 20
"""The most that running ``cache_room`` blocks add in all (64 MiB: 256 blocks)."""
_room = 0
"""Blocks that running ``cache_room`` blocks ask to add to ``CACHE_BLOCKS`` (at most ``MAX_ROOM`` count)."""


@contextlib.contextmanager
def cache_room(nbytes: int) -> Iterator[None]:
    """Keep ``nbytes`` more of cached blocks while the block runs: a reader that locates its records this
    far ahead of reading them (the write pipeline announces the pieces it queues, and a DCP chunk archive's
    head and tail blocks, fetched to locate it, also hold its data) finds them still cached when it reads
    them (with the 32 blocks alone, a 48-layer DCP world-8 consolidate fetched 1.8x the bytes it needed,
    blocks evicted before their data was read). Memory: at most ``nbytes`` more while the block runs, and
    ``MAX_ROOM`` for all the running blocks together."""
    global _room
    k = max(0, nbytes) // BLOCK
    with _lock:
        _room += k
    try:
        yield
    finally:
        with _lock:
            _room -= k
            _trim()


def _trim() -> None:
    """Drop the least recently used blocks past the capacity (``_lock`` held)."""
    while len(_cache) > CACHE_BLOCKS + min(_room, MAX_ROOM // BLOCK):
        _cache.popitem(last=False)


def _get(u: Url, a: int, b: int) -> memoryview:
    be = backend.of(u)

    def once() -> memoryview:
        _count("requests")
        got = memoryview(be.get_range(u, a, b))
        if len(got) != b - a:
            raise OSError(f"connection closed: {len(got)} of {b - a} bytes")
        _count("bytes", b - a)
        return got

    return _retry(once, u)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(in_flight(), 1), thread_name_prefix="zckpt-s3")
        return _pool


def _block(u: Url, i: int, total: int) -> bytes:
    key = (str(u), i)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    data = bytes(_get(u, i * BLOCK, min(total, (i + 1) * BLOCK)))
    with _lock:
        _cache[key] = data
        _trim()
    return data


def window_bytes() -> int:
    """How far a sequential reader's stream fetches ahead of it (``ahead.Stream``), default 32 MiB."""
    return max(
        BLOCK, int(_options.get("window_bytes", os.environ.get("ZCKPT_S3_WINDOW_BYTES", str(32 << 20))))
    )


def expect(x: object, offset: int, limit: int) -> None:
    """A sequential read of ``[offset, limit)`` comes soon: its read-ahead stream starts now (from the first
    byte no cached block holds, up to the next cached block: ``_uncached``)."""
    u = _url(x)
    end = min(limit, size(u))
    offset, end = _uncached(u, offset, end)
    if offset < end:
        ahead.expect(u, offset, end, window_bytes())


def _uncached(u: Url, at: int, end: int) -> tuple[int, int]:
    """``[at, end)`` less what the block cache holds at its front, and cut at the next cached block: the
    range a stream should fetch. (An archive's head and tail blocks, fetched to locate its records, also
    hold the start and the end of its data: a stream over the whole record fetched them twice.)"""
    key = str(u)
    with _lock:
        held = {i for k, i in _cache if k == key}
        while at < end and at // BLOCK in held:
            at = (at // BLOCK + 1) * BLOCK
        nxt = min((i * BLOCK for i in held if at < i * BLOCK < end), default=end)
    return min(at, end), nxt


def _from_cache(u: Url, at: int, out: memoryview) -> int:
    """Copy into ``out`` what cached blocks hold from byte ``at`` on (stopping at the first block not
    cached); the number of bytes copied."""
    key, done = str(u), 0
    while done < len(out):
        i = (at + done) // BLOCK
        with _lock:
            blk = _cache.get((key, i))
            if blk is None:
                return done
            _cache.move_to_end((key, i))
        a = at + done - i * BLOCK
        k = min(len(out) - done, len(blk) - a)
        out[done : done + k] = blk[a : a + k]
        done += k
    return done


def prefetch_ends(xs: Sequence[object]) -> None:
    """The last block of each object, all fetched at once: a zip archive's end record and central
    directory, for objects about to be opened."""
    jobs = []
    for x in xs[: CACHE_BLOCKS // 2]:
        u = _url(x)
        total = size(u)
        last = (total - 1) // BLOCK
        with _lock:
            if (str(u), last) in _cache:
                continue
        jobs.append((u, last, total))
    if jobs:
        for f in [_executor().submit(_block, *j) for j in jobs]:
            f.result()


def prefetch(x: object, spans: list[tuple[int, int]]) -> None:
    """Fetch the blocks under these small ``(offset, length)`` spans of the object, all at once (``in_flight``
    requests in parallel), into the block cache: the reads that follow (a zip archive's local headers, one
    per record) then cost one round trip together instead of one each. At most ``CACHE_BLOCKS // 2``
    blocks; spans past the end are ignored."""
    u = _url(x)
    total = size(u)
    want: list[int] = []
    for off, n in spans:
        for i in range(max(0, off) // BLOCK, (min(total, off + n) - 1) // BLOCK + 1):
            if i not in want and i * BLOCK < total:
                want.append(i)
    with _lock:
        want = [i for i in want if (str(u), i) not in _cache][: CACHE_BLOCKS // 2]
    if len(want) > 1:
        for f in [_executor().submit(_block, u, i, total) for i in want]:
            f.result()


def read_into(x: object, offset: int, out: memoryview, limit: int | None = None) -> None:
    """Fill ``out`` with the object's bytes ``[offset, offset + len(out))``: ranged GETs of at most
    ``part_bytes``, ``in_flight`` at a time; a read under ``BLOCK`` bytes comes from the block cache.
    ``limit``: the caller reads on sequentially up to this byte (a checksummed record's end), so a window
    up to it may be fetched ahead (``_from_window``)."""
    u = _url(x)
    n = len(out)
    total = size(u)
    if offset < 0 or offset + n > total:
        from zckpt.errors import CorruptCheckpoint

        raise CorruptCheckpoint(
            f"{u}: needs bytes [{offset}, {offset + n}) but the object has {total} bytes (truncated?)",
            path=str(u),
        )
    if n == 0:
        return
    if limit is not None and min(limit, total) >= offset + n:
        _sequential(u, offset, out, min(limit, total))
    else:
        _direct(u, offset, out)


def _sequential(u: Url, offset: int, out: memoryview, limit: int) -> None:
    """A read of a reader that goes on up to ``limit``: what cached blocks hold is copied from them, the rest
    comes from read-ahead streams that stop where a cached block starts (``_uncached``). A read that ends
    where its stream would (nothing to fetch ahead), and that no window holds, is read as any other."""
    done, n = 0, len(out)
    while done < n:
        done += _from_cache(u, offset + done, out[done:])
        if done == n:
            return
        at = offset + done
        _, stop = _uncached(u, at, limit)
        m = min(n - done, stop - at)
        if stop > at + m or ahead.held(u, at):
            ahead.read(u, at, out[done : done + m], stop, window_bytes(), _read_parts)
        else:
            _direct(u, at, out[done : done + m])
        done += m


def _direct(u: Url, offset: int, out: memoryview) -> None:
    """A read with nothing to fetch ahead: under ``BLOCK`` bytes from the block cache, else in parts."""
    if len(out) < BLOCK:
        _blocks(u, offset, out)
    else:
        _read_parts(u, offset, out)


def _blocks(u: Url, offset: int, out: memoryview) -> None:
    """``out`` from the aligned cached blocks under it (fetched where missing)."""
    total, done, n = size(u), 0, len(out)
    while done < n:
        i = (offset + done) // BLOCK
        blk = _block(u, i, total)
        at = offset + done - i * BLOCK
        k = min(n - done, len(blk) - at)
        out[done : done + k] = blk[at : at + k]
        done += k


def _read_parts(u: Url, offset: int, out: memoryview) -> None:
    """``out`` from ``[offset, offset + len(out))`` in parts of ``part_bytes``, ``in_flight`` at a time."""
    n = len(out)
    step = part_bytes()
    cuts = [(a, min(n, a + step)) for a in range(0, n, step)]
    if len(cuts) == 1 or threading.current_thread().name.startswith("zckpt-s3"):
        for a, b in cuts:
            out[a:b] = _get(u, offset + a, offset + b)
        return

    def part(ab: tuple[int, int]) -> None:
        a, b = ab
        out[a:b] = _get(u, offset + a, offset + b)

    for f in [_executor().submit(part, c) for c in cuts]:
        f.result()


class RemoteFile(io.RawIOBase):
    """A read-only, seekable file over an object: small reads through the block cache, large ones direct
    (``zipfile``, the safetensors header, pickles read it like a local file)."""

    def __init__(self, x: object) -> None:
        super().__init__()
        self.url = _url(x)
        self.size = size(self.url)
        self.pos = 0
        self.name = str(self.url)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b: Any) -> int:
        """A small read stops at the end of its block (a short read, as raw files may return): a buffered
        reader's look-ahead does not cost a request for the next block."""
        mv = memoryview(b).cast("B")
        n = max(0, min(len(mv), self.size - self.pos))
        if n < BLOCK:
            n = min(n, BLOCK - self.pos % BLOCK)
        if n:
            read_into(self.url, self.pos, mv[:n])
            self.pos += n
        return n

    def readall(self) -> bytes:
        buf = bytearray(max(0, self.size - self.pos))
        self.readinto(buf)
        return bytes(buf)


def open_read(x: object) -> io.BufferedReader:
    return io.BufferedReader(RemoteFile(x), buffer_size=BLOCK // 4)
