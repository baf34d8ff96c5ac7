"""Ctrl-C and SIGTERM around publishing: held while an output moves into place, and remembered after.

``held()`` defers SIGINT and SIGTERM for the few renames of a commit (``zckpt.storage.staging``): an interrupt
between two renames would leave a file output half old and half new, and one right after the last rename
but before the commit is recorded would report "nothing left behind" beside a published output. The
signal is delivered when the block ends, to the handler that was in place (``KeyboardInterrupt``, the
CLI's ``Terminated``, or the default action). Only the main thread can change handlers; elsewhere the
block runs as is.

``opened()``/``closed()``/``mark()``/``published_since()``: whether every output the running operation
staged since a point (a command's start) is in place, kept in its ``zckpt.storage.session.Storage`` (never
process-wide: two operations in two threads do not see each other's). The CLI uses it to tell an interrupt
that came after the output was published (the job is done: exit 0, with a warning) from one that stopped the
job (exit 130, and what was left, ``Storage.left``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from zckpt.storage import session

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """SIGINT and SIGTERM deferred until the block ends (main thread only; see the module doc)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old: dict[int, Any] = {int(sig): signal.getsignal(sig) for sig in _SIGNALS}
    if any(h is None for h in old.values()):  # a handler set outside Python: it could not be restored
        yield
        return
    caught: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        caught.append(signum)

    for sig in _SIGNALS:
        signal.signal(sig, hold)
    try:
        yield
    finally:
        for num, h in old.items():
            signal.signal(num, h)
        if caught:
            _deliver(caught[0], old[caught[0]])


def _deliver(signum: int, handler: Any) -> None:
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signum)


def opened(key: object) -> None:
    st = session.current()
    with st.lock:
        st.staged.add(id(key))


def closed(key: object, *, published: bool) -> None:
    st = session.current()
    with st.lock:
        st.staged.discard(id(key))
        if published:
            st.published += 1


def mark() -> int:
    """A point to ask ``published_since`` about (the start of a command)."""
    return session.current().published


def published_since(point: int) -> bool:
    """Some output was published since ``point`` and none is being staged now."""
    st = session.current()
    return st.published > point and not st.staged


__all__ = ["closed", "held", "mark", "opened", "published_since"]
