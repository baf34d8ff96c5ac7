"""Checksum work off the threads that read the bytes: ``Offload`` runs jobs (the CRC-32s of views of a file's
mapping, ``zckpt.storage.checks.Session.offloaded``) on threads of its own, at most ``OFFLOAD_BYTES`` of
views queued before a submitter waits, so the readers go on while idle cores check what they read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from zckpt.storage.threads import Pool

OFFLOAD_BYTES = 64 << 20
"""Bytes of mapped views queued for a session's CRC threads (``Session.offloaded``) before a reader waits."""


class Offload:
    """CRC-32s of mapped views computed on threads of a session's own, off the threads that read the bytes:
    at most ``OFFLOAD_BYTES`` queued (the views stay valid: they are the file's mapping, nothing is copied);
    ``close`` waits for every job and raises the first job's error."""

    def __init__(self, threads: int) -> None:
        self._pool = Pool(threads, thread_name_prefix="zckpt-check")
        self._cond = threading.Condition()
        self._queued = 0
        self._error: BaseException | None = None

    def submit(self, job: Callable[[], None], nbytes: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._queued or self._queued + nbytes <= OFFLOAD_BYTES)
            self._queued += nbytes
        self._pool.submit(self._run, job, nbytes)

    def _run(self, job: Callable[[], None], nbytes: int) -> None:
        try:
            job()
        except BaseException as e:  # re-raised by ``close``, on the thread that owns the session
            self._error = self._error or e
        finally:
            with self._cond:
                self._queued -= nbytes
                self._cond.notify_all()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._error is not None:
            raise self._error
