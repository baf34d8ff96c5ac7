"""Ranged reads: ``read_into`` fetches exactly ``[offset, offset + n)`` with ranged GETs, cut into parts of at
most ``part_bytes`` that go out ``in_flight`` at a time. A reader that says how far it reads on (``limit``:
the end of the checksummed record it is in) is served from read-ahead windows of ``window_bytes`` that tile
the record and never pass its end (``_from_window``). Reads under ``BLOCK`` bytes (headers, pickles, small
tensors) come from a small cache of aligned ``BLOCK``-byte blocks, so neighbouring small reads coalesce into
one request. Memory: the caller's buffer, at most ``MAX_WINDOWS`` windows and ``CACHE_BLOCKS`` blocks.
``RemoteFile`` and ``open_read``: a seekable file over an object.
"""

from __future__ import annotations

import io
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from zckpt.io.objstore.client import (
    Url,
    _cache,
    _count,
    _lock,
    _options,
    _retry,
    _store,
    _url,
    _Window,
    _windows,
    in_flight,
    part_bytes,
)
from zckpt.io.objstore.paths import size

BLOCK = 256 << 10
"""Reads smaller than this are served from aligned cached blocks of this size (one request per block)."""
CACHE_BLOCKS = 32
"""Blocks kept (LRU, whole process): 8 MiB at most."""
_pool: ThreadPoolExecutor | None = None


def _get(u: Url, a: int, b: int) -> memoryview:
    import obstore

    def once() -> memoryview:
        _count("requests")
        got = memoryview(obstore.get_range(_store(u), u.key, start=a, end=b))
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
        while len(_cache) > CACHE_BLOCKS:
            _cache.popitem(last=False)
    return data


_window_ids = iter(range(1 << 62))


def window_bytes() -> int:
    return max(
        BLOCK, int(_options.get("window_bytes", os.environ.get("ZCKPT_S3_WINDOW_BYTES", str(32 << 20))))
    )


def _from_window(u: Url, offset: int, out: memoryview, limit: int) -> None:
    """Serve ``out`` from windows of ``[offset, limit)`` fetched ahead: one sequential reader's small or
    medium reads (a ZeRO partition read param by param) become few large ranged GETs that tile the record,
    never past ``limit`` (the end of the record being read). Once a read passes the middle of a window, the
    next one is fetched in the background, so the network overlaps the reader's work. At most
    ``MAX_WINDOWS`` windows are held."""
    done, n = 0, len(out)
    while done < n:
        at = offset + done
        w, mine = _window_at(u, at, max(window_bytes(), n - done), limit)
        if mine:
            _fill(u, w)
        data = w.data.result()
        k = min(n - done, w.end - at)
        out[done : done + k] = memoryview(data)[at - w.start : at - w.start + k]
        done += k
        if w.end < limit and at + k > (w.start + w.end) // 2:
            nxt, new = _window_at(u, w.end, window_bytes(), limit)
            if new:
                threading.Thread(target=_fill, args=(u, nxt, False), name="zckpt-ahead", daemon=True).start()


def _held(u: Url, at: int) -> bool:
    """A window already holds byte ``at`` of ``u`` (a reader's last read of a record comes from it too)."""
    key = str(u)
    with _lock:
        return any(w.url == key and w.start <= at < w.end for w in _windows.values())


def _window_at(u: Url, at: int, size: int, limit: int) -> tuple[_Window, bool]:
    """The window holding byte ``at`` of ``u``, or a new one ``[at, at + size)`` (clipped to ``limit``) that
    the caller must fill (then True)."""
    key = str(u)
    with _lock:
        w = next((w for w in _windows.values() if w.url == key and w.start <= at < w.end), None)
        if w is not None:
            return w, False
        w = _Window(key, at, min(limit, at + size), Future())
        _windows[next(_window_ids)] = w
        while len(_windows) > MAX_WINDOWS:
            _windows.popitem(last=False)
        return w, True


def _fill(u: Url, w: _Window, raise_: bool = True) -> None:
    buf = bytearray(w.end - w.start)
    try:
        _read_parts(u, w.start, memoryview(buf))
    except BaseException as e:
        w.data.set_exception(e)
        with _lock:
            for k in [k for k, v in _windows.items() if v is w]:
                _windows.pop(k)
        if raise_:
            raise
        return
    w.data.set_result(buf)


MAX_WINDOWS = 4
"""Windows held at once (whole process), prefetched ones included: memory ``MAX_WINDOWS * window_bytes`` at
most (128 MiB)."""


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
    if (
        limit is not None
        and min(limit, total) >= offset + n
        and (min(limit, total) > offset + n or _held(u, offset))
    ):
        _from_window(u, offset, out, min(limit, total))
        return
    if n < BLOCK:
        done = 0
        while done < n:
            i = (offset + done) // BLOCK
            blk = _block(u, i, total)
            at = offset + done - i * BLOCK
            k = min(n - done, len(blk) - at)
            out[done : done + k] = blk[at : at + k]
            done += k
        return
    _read_parts(u, offset, out)


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
        mv = memoryview(b).cast("B")
        n = max(0, min(len(mv), self.size - self.pos))
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
