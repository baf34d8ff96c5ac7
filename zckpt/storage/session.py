"""``Storage``: everything one operation keeps about where it reads and writes, owned by that operation.

Every operation (``zckpt.open`` and the ``Checkpoint`` it returns, ``consolidate``, ``reshard``, ``diff``,
``verify``, ``inspect``, a CLI command, an engine ``save_checkpoint`` / ``load_checkpoint``) makes one
``Storage`` from its ``storage_options`` (or takes the one it is given, ``storage=``) and binds it while it
runs (``bound``): for its own thread and for the threads it starts (``zckpt.storage.threads``, which carry the
binding). It holds:

- ``objects``: the ``ObjectStore`` (clients, credentials, listings, sizes, block cache, read-ahead streams,
  request figures) for ``s3://`` and fsspec URLs;
- the local files it has open (read descriptors of checkpoint files; no file is ever mapped), closed by
  ``close_files`` / ``close`` of this ``Storage`` only;
- ``memo``: parsed metadata kept for the operation (a DCP ``.metadata``, a zip archive's shape);
- ``stand_ins``: the local folders of this operation that stand for an ``s3://`` output folder (a data file
  written there streams to its object; ``zckpt.storage.remote_staging``), registered by the code that made
  them, never found on disk;
- ``deferred``: staging folders whose files are fsynced at their publish, not at each close;
- ``staged``, ``published``, ``left``: its outputs being staged and published so far, and objects a given-up
  output could not delete (``zckpt.storage.interrupts``: what an interrupted command reports).

Nothing of this is process-wide: two operations in two threads, with different storage options, share
nothing; a new operation lists the store afresh (a long-lived process sees another writer's ``latest``); a
``Checkpoint`` keeps one consistent view of its files for its lifetime. The binding is a
``contextvars.ContextVar`` (as ``decimal`` and ``asyncio`` keep theirs): a value per thread and task, not a
global. ``current()`` outside any operation (an internal function called on its own) is a fresh ``Storage``
that keeps nothing beyond the call.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from zckpt.storage import objstore


class LocalFiles:
    """The local checkpoint files one ``Storage`` has open: read descriptors (``fd``), keyed by path, until
    ``close``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[str, tuple[int, int]] = {}

    def fd(self, path: str, open_fd: Any) -> tuple[int, int]:
        with self._lock:
            hit = self._fds.get(path)
            if hit is not None:
                return hit
            fd = open_fd(path)
            size = os.fstat(fd).st_size
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            self._fds[path] = (fd, size)
            return fd, size

    def close(self, paths: object = None) -> None:
        """Close these files' descriptors (all when ``paths`` is None)."""
        with self._lock:
            fkeys = list(self._fds) if paths is None else [p for p in paths if p in self._fds]  # type: ignore[attr-defined]
            for k in fkeys:
                os.close(self._fds.pop(k)[0])


class Storage:
    """One operation's storage (see the module doc). ``Storage(storage_options)``; use it as
    ``with storage.bound(): ...``, and ``close()`` it when the operation ends (the operation that made it
    does). ``stats()``: its object-store requests and bytes so far."""

    def __init__(self, storage_options: Mapping[str, str] | None = None) -> None:
        self.options: dict[str, str] = {k: str(v) for k, v in (storage_options or {}).items()}
        self.objects = objstore.ObjectStore(self.options)
        self.files = LocalFiles()
        self.memo: dict[str, dict[Any, Any]] = {}
        self.stand_ins: dict[Path, Any] = {}
        """Local folder -> its ``remote_staging.StandIn`` (the ``s3://`` URL it stands for)."""
        self.deferred: set[Path] = set()
        self.staged: set[int] = set()
        """Outputs being staged now (``zckpt.storage.interrupts``)."""
        self.published = 0
        """Outputs published so far (``zckpt.storage.interrupts``)."""
        self.left: list[str] = []
        """Objects a given-up output could not delete (an interrupted command names them)."""
        self.lock = threading.Lock()

    def cache(self, name: str) -> dict[Any, Any]:
        """A dict kept for this ``Storage``'s lifetime under ``name`` (parsed metadata)."""
        with self.lock:
            return self.memo.setdefault(name, {})

    def cached(self, name: str) -> dict[Any, Any] | None:
        """The dict ``cache(name)`` made, or None when no one asked for it: what an operation opts into."""
        with self.lock:
            return self.memo.get(name)

    def forget(self, name: str) -> None:
        """Drop ``cache(name)`` (an operation done with what it kept)."""
        with self.lock:
            self.memo.pop(name, None)

    def stats(self) -> dict[str, int]:
        """Object-store requests made, bytes fetched and uploaded, retries, through this storage so far."""
        return self.objects.stats()

    @contextlib.contextmanager
    def bound(self) -> Iterator[Storage]:
        """Make this the current ``Storage`` (and its ``ObjectStore`` the current one) in this context."""
        token = _CURRENT.set(self)
        try:
            with objstore.bound(self.objects):
                yield self
        finally:
            _CURRENT.reset(token)

    def close(self) -> None:
        """Close its local files, stop its object-store streams and threads."""
        self.files.close()
        self.objects.close()

    def __repr__(self) -> str:
        return f"Storage(options={sorted(self.options)})"


_CURRENT: contextvars.ContextVar[Storage | None] = contextvars.ContextVar("zckpt_storage", default=None)


def current() -> Storage:
    """The running operation's ``Storage``; outside any operation, a fresh one (nothing kept)."""
    s = _CURRENT.get()
    return s if s is not None else Storage()


def bound_storage() -> Storage | None:
    """The running operation's ``Storage``, or None outside any operation."""
    return _CURRENT.get()


@contextlib.contextmanager
def operation(
    storage: Storage | None = None, storage_options: Mapping[str, str] | None = None
) -> Iterator[Storage]:
    """The ``Storage`` an operation runs with, bound while the block runs: ``storage`` when given (the
    caller owns it), else the one already bound (an operation called by another shares its storage), else a
    new one from ``storage_options``, closed at the end."""
    if storage is not None:
        with storage.bound():
            yield storage
        return
    here = _CURRENT.get()
    if here is not None and not storage_options:
        yield here
        return
    made = Storage(storage_options)
    try:
        with made.bound():
            yield made
    finally:
        made.close()
