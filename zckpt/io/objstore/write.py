"""Writes: ``Upload``, one object streamed as a multipart upload (parts of ``part_bytes``) that becomes
visible only when it completes, ``abort()`` leaves nothing; ``upload_file`` (create-if-absent for the objects
that complete a checkpoint), ``put_bytes``, ``delete``, ``list_keys``. Each drops what the caches hold about
the objects it changes.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from zckpt.errors import StorageError
from zckpt.io.objstore import backend
from zckpt.io.objstore.client import Url, _count, _forget, _retry, _url, error, part_bytes
from zckpt.io.objstore.paths import _list


class Upload:
    """One object written as a stream: a multipart upload in parts of ``part_bytes`` (``in_flight`` parts
    uploading at once), a single PUT when it stays under one part. The object appears only at ``close()``;
    ``abort()`` (or an error) leaves nothing, not even the parts."""

    def __init__(self, x: object) -> None:
        self.url = _url(x)
        self._w = _retry(lambda: backend.of(self.url).writer(self.url), self.url, tries=1)
        self._n = 0
        self.closed = False

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        try:
            self._w.write(bytes(mv))  # a copy: the client may keep the buffer, and callers reuse theirs
        except Exception as e:  # noqa: BLE001 - one line
            self.abort()
            raise error(e, self.url) from None
        self._n += len(mv)
        return len(mv)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._w.close()
        except Exception as e:  # noqa: BLE001 - one line
            raise error(e, self.url) from None
        _count("uploads")
        _count("bytes_up", self._n)
        _forget(self.url)

    def abort(self) -> None:
        """Abort the multipart upload (its parts are deleted); nothing appears."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):  # best effort: never hide the error that caused the abort
            self._w.abort()


def upload_file(local: str | os.PathLike[str], x: object, *, create: bool = False) -> None:
    """Upload the local file to ``x``: one PUT under a part, else a multipart upload. ``create``: fail with
    ``OutputExists`` if the object exists (``If-None-Match: *``: of two writers, one wins)."""
    u = _url(x)
    n = os.path.getsize(local)
    if n <= part_bytes() or create:
        if n > (256 << 20):
            raise StorageError(f"{u}: {n} bytes for a create-if-absent object", path=str(u))
        with open(local, "rb") as f:
            data = f.read()
        try:
            _count("requests")
            _retry(lambda: backend.of(u).put(u, data, create), u)
        except StorageError as e:
            if create and "already exists" in str(e).lower():
                from zckpt.errors import OutputExists

                raise OutputExists(
                    f"{u}: created by another process while this one was writing",
                    hint="pass --overwrite to replace it",
                    path=str(u),
                ) from None
            raise
        _count("uploads")
        _count("bytes_up", n)
        _forget(u)
        return
    up = Upload(u)
    try:
        with open(local, "rb") as f:
            while chunk := f.read(part_bytes()):
                up.write(chunk)
        up.close()
    except BaseException:
        up.abort()
        raise


def delete(urls: list[str]) -> None:
    """Delete these objects (missing ones are fine)."""
    by_bucket: dict[str, list[Url]] = {}
    for s in urls:
        u = _url(s)
        by_bucket.setdefault(u.bucket, []).append(u)
    for us in by_bucket.values():
        for i in range(0, len(us), 1000):
            part = us[i : i + 1000]
            _count("requests")
            _retry(lambda part=part: backend.of(part[0]).delete(part), part[0])
            for u in part:
                _forget(u)


def list_keys(x: object, *, recursive: bool = True) -> list[str]:
    """The URLs of every object under the folder ``x`` (its whole subtree unless not ``recursive``)."""
    u = _url(x)
    if not recursive:
        return [f"{u}/{n}" for n in sorted(_list(u).files)]
    _count("requests")
    keys = _retry(lambda: backend.of(u).list_all(u), u)
    return sorted(f"{u.scheme}://{u.bucket}/{k}" for k in keys)


def put_bytes(x: object, data: bytes) -> None:
    """One small object, written whole by one PUT (it replaces what was there)."""
    u = _url(x)
    _count("requests")
    _retry(lambda: backend.of(u).put(u, data, False), u)
    _count("uploads")
    _count("bytes_up", len(data))
    _forget(u)
