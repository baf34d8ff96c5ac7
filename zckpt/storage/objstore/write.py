"""Writes: ``Upload``, one object streamed as a multipart upload (parts of ``part_bytes``) that becomes
visible only when it completes, ``abort()`` leaves nothing; ``upload_file`` (create-if-absent for the objects
that complete a checkpoint), ``put_bytes``, ``delete``, ``list_keys``. Each drops what the caches hold about
the objects it changes. Each works through the ``ObjectStore`` it is given.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from zckpt.errors import StorageError
from zckpt.storage.objstore import backend
from zckpt.storage.objstore.client import ObjectStore, Url, _retry, _url, error
from zckpt.storage.objstore.paths import _list


class Upload:
    """One object written as a stream: a multipart upload in parts of ``part_bytes`` (``in_flight`` parts
    uploading at once), a single PUT when it stays under one part. The object appears only at ``close()``;
    ``abort()`` (or an error) leaves nothing, not even the parts."""

    def __init__(self, st: ObjectStore, x: object) -> None:
        self.st = st
        self.url = _url(x)
        self._w = _retry(lambda: backend.of(st, self.url).writer(self.url), self.url, st=st)
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
        self.st.count("uploads")
        self.st.count("bytes_up", self._n)
        self.st.forget(self.url)

    def abort(self) -> None:
        """Abort the multipart upload (its parts are deleted); nothing appears."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):  # best effort: never hide the error that caused the abort
            self._w.abort()


def upload_file(st: ObjectStore, local: str | os.PathLike[str], x: object, *, create: bool = False) -> None:
    """Upload the local file to ``x``: one PUT under a part, else a multipart upload. ``create``: fail with
    ``OutputExists`` if the object exists (``If-None-Match: *``: of two writers, one wins)."""
    u = _url(x)
    n = os.path.getsize(local)
    if n <= st.part_bytes() or create:
        if n > (256 << 20):
            raise StorageError(f"{u}: {n} bytes for a create-if-absent object", path=str(u))
        with open(local, "rb") as f:
            data = f.read()
        try:
            st.count("requests")
            _retry(lambda: backend.of(st, u).put(u, data, create), u, st=st)
        except StorageError as e:
            if create and "already exists" in str(e).lower():
                from zckpt.errors import OutputExists

                raise OutputExists(
                    f"{u}: created by another process while this one was writing",
                    hint="pass --overwrite to replace it",
                    path=str(u),
                ) from None
            raise
        st.count("uploads")
        st.count("bytes_up", n)
        st.forget(u)
        return
    up = Upload(st, u)
    try:
        with open(local, "rb") as f:
            while chunk := f.read(st.part_bytes()):
                up.write(chunk)
        up.close()
    except BaseException:
        up.abort()
        raise


def delete(st: ObjectStore, urls: list[str]) -> None:
    """Delete these objects (missing ones are fine)."""
    by_bucket: dict[str, list[Url]] = {}
    for s in urls:
        u = _url(s)
        by_bucket.setdefault(u.bucket, []).append(u)
    for us in by_bucket.values():
        for i in range(0, len(us), 1000):
            part = us[i : i + 1000]
            st.count("requests")
            _retry(lambda part=part: backend.of(st, part[0]).delete(part), part[0], st=st)
            for u in part:
                st.forget(u)


def list_keys(st: ObjectStore, x: object, *, recursive: bool = True) -> list[str]:
    """The URLs of every object under the folder ``x`` (its whole subtree unless not ``recursive``)."""
    u = _url(x)
    if not recursive:
        return [f"{u}/{n}" for n in sorted(_list(st, u).files)]
    st.count("requests")
    keys = _retry(lambda: backend.of(st, u).list_all(u), u, st=st)
    return sorted(f"{u.scheme}://{u.bucket}/{k}" for k in keys)


def put_bytes(st: ObjectStore, x: object, data: bytes) -> None:
    """One small object, written whole by one PUT (it replaces what was there)."""
    u = _url(x)
    st.count("requests")
    _retry(lambda: backend.of(st, u).put(u, data, False), u, st=st)
    st.count("uploads")
    st.count("bytes_up", len(data))
    st.forget(u)
