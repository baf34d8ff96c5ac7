"""Read-ahead for sequential readers: a ``Stream`` follows one reader through one checksummed record of an
object (a ZeRO fp32 partition read param by param, a safetensors file read tensor by tensor) and fetches
ahead of it on a thread of its own, so the network overlaps the reader's decoding, casting and writing.

A stream is one *streamed* ranged GET per ``MAX_REQUEST`` bytes of the record (never past its end), its body
read as it arrives: a 200 MB record costs one request, not 25 parts (a store may charge per request; moto
pays the whole object on each). A reader that leaves early costs what the socket held, not the whole range:
the stream stops reading, and the connection is dropped once idle.
Its bytes are handed out in windows of at most ``UNIT`` bytes, registered before they are filled so a
reader waits on the one it needs; the thread stays at most ``window_bytes`` ahead of the furthest byte read
(the HTTP body waits in the socket meanwhile). A body cut off mid-way is resumed by the client (obstore)
from the byte it stopped at.
A stream idle for ``IDLE_S`` seconds, or whose object is written (``ObjectStore.forget``), is closed.

Memory: the windows held, at most ``MAX_WINDOWS`` of ``UNIT`` bytes (those already read are dropped first,
then the oldest), whatever the object size. A read whose window was dropped is fetched directly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from zckpt.storage.objstore import backend
from zckpt.storage.objstore.client import ObjectStore, Url, _retry, _Window, error
from zckpt.storage.objstore.failures import ShortBody

UNIT = 4 << 20
"""The largest window a stream hands out (smaller ones when ``window_bytes`` is smaller)."""
MAX_REQUEST = 256 << 20
"""The largest ranged GET a stream makes."""
IDLE_S = 30.0
"""A stream whose reader has not come back for this long is closed (its GET is dropped)."""
GAP_WINDOWS = 4
"""A reader (or a queued read) this many read-aheads past a stream's position waits for it; further on, it
starts a stream of its own."""
MAX_WINDOWS = 32
"""Windows held at once (per ``ObjectStore``): ``MAX_WINDOWS * UNIT`` = 128 MiB at most."""
_ids = iter(range(1 << 62))


class Stream:
    """One reader's way through ``[start, end)`` of one object, fetched ahead on a thread."""

    def __init__(self, st: ObjectStore, u: Url, start: int, end: int, ahead: int) -> None:
        self.st = st
        self.url = u
        self.key = str(u)
        self.start = start
        self.end = end
        self.ahead = ahead
        self.unit = max(1, min(UNIT, ahead))
        self.next = start  # the first byte no window of this stream covers yet
        self.want = start  # the furthest byte a reader has asked for
        self.cond = threading.Condition()
        self.closed = False
        self._mine: list[_Window] = []
        self._thread = threading.Thread(target=self._run, name="zckpt-ahead", daemon=True)
        self._thread.start()

    # ---- the reader's side ----------------------------------------------------------------------------
    def will_reach(self, at: int) -> bool:
        """This stream covers byte ``at`` soon: it lies ahead of what is fetched, at most ``GAP_WINDOWS``
        read-aheads past it (the write pipeline queues reads a few chunks ahead of the one being read)."""
        return not self.closed and self.next <= at < min(self.end, self.next + GAP_WINDOWS * self.ahead)

    def window(self, at: int) -> _Window | None:
        """The window holding byte ``at`` once the thread has registered it (None: the stream stopped)."""
        with self.cond:
            self.want = max(self.want, at + 1)
            self.cond.notify_all()
            while self.next <= at and not self.closed:
                self.cond.wait()
            return next((w for w in self._mine if w.start <= at < w.end), None)

    def reached(self, at: int) -> None:
        """A reader has consumed up to byte ``at``: the thread may fetch up to ``at + ahead``."""
        with self.cond:
            if at > self.want:
                self.want = at
                self.cond.notify_all()

    def clip(self, end: int) -> None:
        """Fetch nothing from ``end`` on: another stream of the object starts there (``find``)."""
        with self.cond:
            self.end = min(self.end, end)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    # ---- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        body: Iterator[Any] | None = None
        b_end = self.start
        pending = memoryview(b"")
        try:
            while True:
                with self.cond:
                    while not self.closed and self.next < self.end and self.next >= self.want + self.ahead:
                        if not self.cond.wait(IDLE_S):
                            self.closed = True
                    if self.closed or self.next >= self.end:
                        return
                    a, end = self.next, self.end
                if body is None or a >= b_end:
                    b_end = min(end, a + MAX_REQUEST)
                    body, pending = self._open(a, b_end), memoryview(b"")
                w = self._register(a, min(b_end, end, a + self.unit))  # (``end``: clipped since the open)
                try:
                    body, pending = self._fill(w, body, pending)
                except BaseException as e:
                    w.data.set_exception(e)
                    raise
                w.data.set_result(w.buf)
        except BaseException:  # noqa: BLE001 - the reader waiting on the window gets the error
            pass
        finally:
            self.close()
            with self.st.lock:
                if self in self.st.streams:
                    self.st.streams.remove(self)

    def _register(self, a: int, b: int) -> _Window:
        w = _Window(self.key, a, b, Future(), bytearray(b - a), self)
        with self.st.lock:
            self.st.windows[next(_ids)] = w
            while len(self.st.windows) > MAX_WINDOWS:
                _evict(self.st)
        with self.cond:
            self._mine = [x for x in self._mine if x.end > self.want - self.unit][-MAX_WINDOWS:] + [w]
            self.next = b
            self.cond.notify_all()
        return w

    def _open(self, a: int, b: int) -> Iterator[Any]:
        u, be, st = self.url, backend.of(self.st, self.url), self.st

        def once() -> Iterator[Any]:
            st.count("requests")
            return be.stream(u, a, b)

        return _retry(once, u, st=st)

    def _fill(self, w: _Window, body: Iterator[Any], pending: memoryview) -> tuple[Iterator[Any], memoryview]:
        """Fill ``w`` from the body (``pending``: bytes already received past the previous window). A body
        cut off mid-way has been resumed by the client already, within its retries (``policy``): what
        comes out here is final."""
        buf = memoryview(w.buf)
        got, n = 0, len(buf)
        while got < n:
            if not len(pending):
                chunk, cut = _next(body)
                if cut is not None:
                    raise error(cut, self.url) from None
                pending = memoryview(chunk)
                self.st.count("bytes", len(pending))
            k = min(n - got, len(pending))
            buf[got : got + k] = pending[:k]
            pending = pending[k:]
            got += k
        return body, pending


def _evict(st: ObjectStore) -> None:
    """Drop one window (``st.lock`` held): the oldest one its reader has gone past, else the oldest."""
    k = next((k for k, w in st.windows.items() if w.owner is None or w.end <= w.owner.want), None)
    if k is None:
        st.windows.popitem(last=False)
    else:
        del st.windows[k]


def _next(body: Iterator[Any]) -> tuple[bytes, BaseException | None]:
    """The body's next chunk, or why there is none (it ended early, or the connection failed)."""
    try:
        return next(body), None
    except StopIteration:
        return b"", ShortBody("the body ended before the range did: the object is shorter than expected")
    except Exception as e:  # noqa: BLE001 - raised by the caller as one line
        return b"", e


def find(
    st: ObjectStore, u: Url, at: int, limit: int | None = None, ahead: int = 0
) -> tuple[_Window | None, Stream | None]:
    """The window holding byte ``at`` of ``u``, if one is held, and the stream it came from; else a stream
    that will reach ``at`` soon, if one runs, or (given ``limit``) a new one from ``at`` to ``limit``. One
    lock for the look-up and the start: two readers of one record never start two streams. Streams of one
    object never fetch a byte twice: a new stream ends where a stream ahead of it starts, and a stream behind
    it is clipped to where it starts (two fill threads in one record: one reads a big tensor, the other the
    next tensor, past the first stream's reach; before, the first stream fetched on into the second's
    bytes: 1.02-1.34x the bytes a 2-thread consolidate needed, RESULTS "18:50")."""
    key = str(u)
    with st.lock:
        w = next((w for w in st.windows.values() if w.url == key and w.start <= at < w.end), None)
        mine = [s for s in st.streams if s.key == key]
        s = next((s for s in mine if (s.start <= at < s.next if w else s.will_reach(at))), None)
        passed = w is None and any(s.start <= at < s.next and not s.closed for s in mine)
        if w is None and s is None and limit is not None and not passed:  # (passed: its window was dropped)
            end = min([limit] + [o.start for o in mine if at < o.start])  # up to a stream already past it
            s = Stream(st, u, at, end if end > at else limit, ahead)
            for o in mine:  # a stream behind it stops where this one starts: no byte fetched twice
                if o.start < at < o.end:
                    o.clip(at)
            st.streams.append(s)
    return w, s


def read(
    st: ObjectStore, u: Url, offset: int, out: memoryview, limit: int, ahead: int, direct: Callable[..., None]
) -> None:
    """Fill ``out`` with bytes ``[offset, ...)`` of ``u`` from windows of a stream up to ``limit``: the one
    that holds or will reach them, else a new one from ``offset``. ``direct(u, at, view)``: a read whose
    window was dropped already."""
    done, n = 0, len(out)
    while done < n:
        at = offset + done
        w, s = find(st, u, at, limit, ahead)
        if w is None and s is not None:
            w = s.window(at)
        if w is None:
            direct(st, u, at, out[done:])
            return
        data = w.data.result()
        k = min(n - done, w.end - at)
        out[done : done + k] = memoryview(data)[at - w.start : at - w.start + k]
        done += k
        if s is not None:
            s.reached(at + k)


def expect(st: ObjectStore, u: Url, at: int, limit: int, ahead: int) -> None:
    """A reader will read on from byte ``at`` up to ``limit`` soon (``storage.expect``, from the write
    pipeline's queue): start its stream now, unless a window or a stream already covers ``at``."""
    find(st, u, at, limit, ahead)


def held(st: ObjectStore, u: Url, at: int) -> bool:
    """A window holds byte ``at`` of ``u`` (a reader's last read of a record comes from it too)."""
    return find(st, u, at)[0] is not None
