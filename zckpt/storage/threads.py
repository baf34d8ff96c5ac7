"""Threads that carry the operation they work for: ``Pool`` (a ``ThreadPoolExecutor``) and ``start``
(a ``threading.Thread``) run each task in a copy of the submitting thread's ``contextvars`` context, so a
worker reads and writes through the same ``zckpt.storage.session.Storage`` as the operation that started it
(and two operations in two threads never see each other's). Every thread zckpt starts that may read or
write by path goes through here; the object store's own threads (its part pool, read-ahead streams) hold
their ``ObjectStore`` explicitly.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class Pool(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` whose tasks run in the submitter's context (a copy per task)."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        ctx = contextvars.copy_context()
        return super().submit(ctx.run, fn, *args, **kwargs)


def start(
    target: Callable[..., Any], *, name: str, daemon: bool = True, args: tuple[Any, ...] = ()
) -> threading.Thread:
    """A started thread running ``target(*args)`` in a copy of the caller's context."""
    ctx = contextvars.copy_context()
    t = threading.Thread(target=ctx.run, args=(target, *args), name=name, daemon=daemon)
    t.start()
    return t
