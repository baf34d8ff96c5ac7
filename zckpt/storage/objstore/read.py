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
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from zckpt.storage.objstore import ahead, backend
from zckpt.storage.objstore.client import ObjectStore, Url, _retry, _url
from zckpt.storage.objstore.failures import ShortBody
from zckpt.storage.objstore.paths import size

BLOCK = 256 << 10
"""Reads smaller than this are served from aligned cached blocks of this size (one request per block)."""
CACHE_BLOCKS = 32
"""Blocks kept (LRU, per ``ObjectStore``): 8 MiB at most, plus the room that running fills ask for
(``cache_room``)."""
MAX_ROOM = 64 << 20
"""The most that running ``cache_room`` blocks add in all (64 MiB: 256 blocks)."""


@contextlib.contextmanager
def cache_room(st: ObjectStore, nbytes: int) -> Iterator[None]:
    """Keep ``nbytes`` more of cached blocks while the block runs: a reader that locates its records this
    far ahead of reading them (the write pipeline announces the pieces it queues, and a DCP chunk archive's
    head and tail blocks, fetched to locate it, also hold its data) finds them still cached when it reads
    them (with the 32 blocks alone, a 48-layer DCP world-8 consolidate fetched 1.8x the bytes it needed,
    blocks evicted before their data was read). Memory: at most ``nbytes`` more while the block runs, and
    ``MAX_ROOM`` for all the running blocks together."""
    k = max(0, nbytes) // BLOCK
    with st.lock:
        st.room += k
    try:
        yield
    finally:
        with st.lock:
            st.room -= k
            _trim(st)


def _trim(st: ObjectStore) -> None:
    """Drop the least recently used blocks past the capacity (``st.lock`` held)."""
    while len(st.cache) > CACHE_BLOCKS + min(st.room, MAX_ROOM // BLOCK):
        st.cache.popitem(last=False)


def _get(st: ObjectStore, u: Url, a: int, b: int) -> memoryview:
    be = backend.of(st, u)

    def once() -> memoryview:
        st.count("requests")
        got = memoryview(be.get_range(u, a, b))
        if len(got) != b - a:
            raise ShortBody(f"the store sent {len(got)} of {b - a} bytes")
        st.count("bytes", b - a)
        return got

    return _retry(once, u, st=st)


def _block(st: ObjectStore, u: Url, i: int, total: int) -> bytes:
    key = (str(u), i)
    with st.lock:
        hit = st.cache.get(key)
        if hit is not None:
            st.cache.move_to_end(key)
            return hit
    data = bytes(_get(st, u, i * BLOCK, min(total, (i + 1) * BLOCK)))
    with st.lock:
        st.cache[key] = data
        _trim(st)
    return data


def window_bytes(st: ObjectStore) -> int:
    """How far a sequential reader's stream fetches ahead of it (``ahead.Stream``), default 32 MiB."""
    return st.window_bytes(BLOCK)


def expect(st: ObjectStore, x: object, offset: int, limit: int) -> None:
    """A sequential read of ``[offset, limit)`` comes soon: its read-ahead stream starts now (from the first
    byte no cached block holds, up to the next cached block: ``_uncached``)."""
    u = _url(x)
    end = min(limit, size(st, u))
    offset, end = _uncached(st, u, offset, end)
    if offset < end:
        ahead.expect(st, u, offset, end, window_bytes(st))


def _uncached(st: ObjectStore, u: Url, at: int, end: int) -> tuple[int, int]:
    """``[at, end)`` less what the block cache holds at its front, and cut at the next cached block: the
    range a stream should fetch. (An archive's head and tail blocks, fetched to locate its records, also
    hold the start and the end of its data: a stream over the whole record fetched them twice.)"""
    key = str(u)
    with st.lock:
        held = {i for k, i in st.cache if k == key}
        while at < end and at // BLOCK in held:
            at = (at // BLOCK + 1) * BLOCK
        nxt = min((i * BLOCK for i in held if at < i * BLOCK < end), default=end)
    return min(at, end), nxt


def _from_cache(st: ObjectStore, u: Url, at: int, out: memoryview) -> int:
    """Copy into ``out`` what cached blocks hold from byte ``at`` on (stopping at the first block not
    cached); the number of bytes copied."""
    key, done = str(u), 0
    while done < len(out):
        i = (at + done) // BLOCK
        with st.lock:
            blk = st.cache.get((key, i))
            if blk is None:
                return done
            st.cache.move_to_end((key, i))
        a = at + done - i * BLOCK
        k = min(len(out) - done, len(blk) - a)
        out[done : done + k] = blk[a : a + k]
        done += k
    return done


def prefetch_ends(st: ObjectStore, xs: Sequence[object]) -> None:
    """The last block of each object, all fetched at once: a zip archive's end record and central
    directory, for objects about to be opened."""
    jobs = []
    for x in xs[: CACHE_BLOCKS // 2]:
        u = _url(x)
        total = size(st, u)
        last = (total - 1) // BLOCK
        with st.lock:
            if (str(u), last) in st.cache:
                continue
        jobs.append((u, last, total))
    if jobs:
        for f in [st.executor().submit(_block, st, *j) for j in jobs]:
            f.result()


def prefetch(st: ObjectStore, x: object, spans: list[tuple[int, int]]) -> None:
    """Fetch the blocks under these small ``(offset, length)`` spans of the object, all at once (``in_flight``
    requests in parallel), into the block cache: the reads that follow (a zip archive's local headers, one
    per record) then cost one round trip together instead of one each. At most ``CACHE_BLOCKS // 2``
    blocks; spans past the end are ignored."""
    u = _url(x)
    total = size(st, u)
    want: list[int] = []
    for off, n in spans:
        for i in range(max(0, off) // BLOCK, (min(total, off + n) - 1) // BLOCK + 1):
            if i not in want and i * BLOCK < total:
                want.append(i)
    with st.lock:
        want = [i for i in want if (str(u), i) not in st.cache][: CACHE_BLOCKS // 2]
    if len(want) > 1:
        for f in [st.executor().submit(_block, st, u, i, total) for i in want]:
            f.result()


def read_into(st: ObjectStore, x: object, offset: int, out: memoryview, limit: int | None = None) -> None:
    """Fill ``out`` with the object's bytes ``[offset, offset + len(out))``: ranged GETs of at most
    ``part_bytes``, ``in_flight`` at a time; a read under ``BLOCK`` bytes comes from the block cache.
    ``limit``: the caller reads on sequentially up to this byte (a checksummed record's end), so a window
    up to it may be fetched ahead (``_from_window``)."""
    u = _url(x)
    n = len(out)
    total = size(st, u)
    if offset < 0 or offset + n > total:
        from zckpt.errors import CorruptCheckpoint

        raise CorruptCheckpoint(
            f"{u}: needs bytes [{offset}, {offset + n}) but the object has {total} bytes (truncated?)",
            path=str(u),
        )
    if n == 0:
        return
    if limit is not None and min(limit, total) >= offset + n:
        _sequential(st, u, offset, out, min(limit, total))
    else:
        _direct(st, u, offset, out)


def _sequential(st: ObjectStore, u: Url, offset: int, out: memoryview, limit: int) -> None:
    """A read of a reader that goes on up to ``limit``: what cached blocks hold is copied from them, the rest
    comes from read-ahead streams that stop where a cached block starts (``_uncached``). A read that ends
    where its stream would (nothing to fetch ahead), and that no window holds, is read as any other."""
    done, n = 0, len(out)
    while done < n:
        done += _from_cache(st, u, offset + done, out[done:])
        if done == n:
            return
        at = offset + done
        _, stop = _uncached(st, u, at, limit)
        m = min(n - done, stop - at)
        if stop > at + m or ahead.held(st, u, at):
            ahead.read(st, u, at, out[done : done + m], stop, window_bytes(st), _read_parts)
        else:
            _direct(st, u, at, out[done : done + m])
        done += m


def _direct(st: ObjectStore, u: Url, offset: int, out: memoryview) -> None:
    """A read with nothing to fetch ahead: under ``BLOCK`` bytes from the block cache, else in parts."""
    if len(out) < BLOCK:
        _blocks(st, u, offset, out)
    else:
        _read_parts(st, u, offset, out)


def _blocks(st: ObjectStore, u: Url, offset: int, out: memoryview) -> None:
    """``out`` from the aligned cached blocks under it (fetched where missing)."""
    total, done, n = size(st, u), 0, len(out)
    while done < n:
        i = (offset + done) // BLOCK
        blk = _block(st, u, i, total)
        at = offset + done - i * BLOCK
        k = min(n - done, len(blk) - at)
        out[done : done + k] = blk[at : at + k]
        done += k


def _read_parts(st: ObjectStore, u: Url, offset: int, out: memoryview) -> None:
    """``out`` from ``[offset, offset + len(out))`` in parts of ``part_bytes``, ``in_flight`` at a time."""
    n = len(out)
    step = st.part_bytes()
    cuts = [(a, min(n, a + step)) for a in range(0, n, step)]
    if len(cuts) == 1 or threading.current_thread().name.startswith("zckpt-s3"):
        for a, b in cuts:
            out[a:b] = _get(st, u, offset + a, offset + b)
        return

    def part(ab: tuple[int, int]) -> None:
        a, b = ab
        out[a:b] = _get(st, u, offset + a, offset + b)

    for f in [st.executor().submit(part, c) for c in cuts]:
        f.result()


class RemoteFile(io.RawIOBase):
    """A read-only, seekable file over an object: small reads through the block cache, large ones direct
    (``zipfile``, the safetensors header, pickles read it like a local file), through the ``ObjectStore`` it
    was opened with."""

    def __init__(self, st: ObjectStore, x: object) -> None:
        super().__init__()
        self.st = st
        self.url = _url(x)
        self.size = size(st, self.url)
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
            read_into(self.st, self.url, self.pos, mv[:n])
            self.pos += n
        return n

    def readall(self) -> bytes:
        buf = bytearray(max(0, self.size - self.pos))
        self.readinto(buf)
        return bytes(buf)


def open_read(st: ObjectStore, x: object) -> io.BufferedReader:
    return io.BufferedReader(RemoteFile(st, x), buffer_size=BLOCK // 4)
