"""The client contract every store is used through, and its two implementations: ``S3`` (obstore, for
``s3://``: tested against a real S3 server) and ``Fsspec`` (any other scheme an installed fsspec knows:
``gs://``, ``az://``, ``hf://``, ``memory://``...; tested with fsspec's in-process ``memory://``).

The contract: ranged reads (``get_range``) and streamed ranged reads (``stream``), a folder listing with
sizes (``list_dir``), ``head``, whole-subtree ``list_all``, ``delete``, ``put`` (create-if-absent on
request), and ``writer``, an object written as a stream that appears only when ``close`` completes it and
never after ``abort``. ``S3`` does that with multipart uploads; ``Fsspec`` spools the object (in memory up to
``part_bytes``, then in a local temporary file) and writes it whole at ``close``: a generic fsspec filesystem
has no multipart upload to abort, so a partial object is never made visible. Its create-if-absent is a
check before the write, not atomic.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any, Protocol

from zckpt.errors import StorageError
from zckpt.storage.objstore.client import ObjectStore, Url


class Writer(Protocol):
    def write(self, b: bytes) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...


class S3:
    """``s3://`` through obstore, with the clients of one ``ObjectStore``."""

    def __init__(self, st: ObjectStore) -> None:
        self.st = st

    def get_range(self, u: Url, a: int, b: int) -> Any:
        import obstore

        return obstore.get_range(self.st.client(u), u.key, start=a, end=b)

    def stream(self, u: Url, a: int, b: int) -> Iterator[bytes]:
        import obstore

        res = obstore.get(self.st.client(u), u.key, options={"range": (a, b)})
        return iter(res.stream(min_chunk_size=1 << 20))

    def list_dir(self, u: Url) -> tuple[list[str], dict[str, int]]:
        import obstore

        res = obstore.list_with_delimiter(self.st.client(u), u.key + "/" if u.key else None)
        dirs = [p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"]]
        return dirs, {m["path"].rsplit("/", 1)[-1]: int(m["size"]) for m in res["objects"]}

    def head(self, u: Url) -> int:
        import obstore

        return int(obstore.head(self.st.client(u), u.key)["size"])

    def list_all(self, u: Url) -> list[str]:
        import obstore

        keys = []
        for batch in obstore.list(self.st.client(u), u.key + "/" if u.key else None):
            keys += [m["path"] for m in batch]
        return keys

    def delete(self, us: list[Url]) -> None:
        import obstore

        obstore.delete(self.st.client(us[0]), [u.key for u in us])

    def put(self, u: Url, data: bytes, create: bool) -> None:
        import obstore

        obstore.put(self.st.client(u), u.key, data, mode="create" if create else "overwrite")

    def writer(self, u: Url) -> Writer:
        return _S3Writer(self.st, u)


class _S3Writer:
    def __init__(self, st: ObjectStore, u: Url) -> None:
        import obstore

        self._w = obstore.open_writer(
            st.client(u), u.key, buffer_size=st.part_bytes(), max_concurrency=st.in_flight()
        )
        self._w.__enter__()

    def write(self, b: bytes) -> None:
        self._w.write(b)

    def close(self) -> None:
        self._w.__exit__(None, None, None)

    def abort(self) -> None:
        self._w.__exit__(RuntimeError, RuntimeError("aborted"), None)


class Fsspec:
    """Any other scheme, through the fsspec filesystem registered for it (one per ``ObjectStore``)."""

    def __init__(self, st: ObjectStore) -> None:
        self.st = st

    @staticmethod
    def _p(u: Url) -> str:
        return f"{u.bucket}/{u.key}" if u.key else u.bucket

    def get_range(self, u: Url, a: int, b: int) -> Any:
        return self.st.fsspec_fs(u).cat_file(self._p(u), start=a, end=b)

    def stream(self, u: Url, a: int, b: int) -> Iterator[bytes]:
        fs, path, step = self.st.fsspec_fs(u), self._p(u), max(1 << 20, self.st.part_bytes())

        def chunks() -> Iterator[bytes]:
            for at in range(a, b, step):
                yield fs.cat_file(path, start=at, end=min(b, at + step))

        return chunks()

    def list_dir(self, u: Url) -> tuple[list[str], dict[str, int]]:
        fs = self.st.fsspec_fs(u)
        try:
            entries = fs.ls(self._p(u), detail=True)
        except FileNotFoundError:
            entries = []
        dirs, files = [], {}
        for e in entries:
            name = str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
            if e.get("type") == "directory":
                dirs.append(name)
            else:
                files[name] = int(e.get("size") or 0)
        return dirs, files

    def head(self, u: Url) -> int:
        return int(self.st.fsspec_fs(u).info(self._p(u))["size"])

    def list_all(self, u: Url) -> list[str]:
        fs, root = self.st.fsspec_fs(u), self._p(u)
        try:
            found = fs.find(root)
        except FileNotFoundError:
            return []
        out = []
        for p in found:
            rel = str(p).lstrip("/")
            bucket_rel = rel.partition("/")[2] if rel.startswith(u.bucket + "/") or rel == u.bucket else rel
            out.append(bucket_rel)
        return out

    def delete(self, us: list[Url]) -> None:
        fs = self.st.fsspec_fs(us[0])
        for u in us:
            if fs.exists(self._p(u)):
                fs.rm_file(self._p(u))

    def put(self, u: Url, data: bytes, create: bool) -> None:
        fs = self.st.fsspec_fs(u)
        if create and fs.exists(self._p(u)):
            raise FileExistsError(f"{u}: already exists")
        fs.pipe_file(self._p(u), data)

    def writer(self, u: Url) -> Writer:
        return _SpooledWriter(self, u)


class _SpooledWriter:
    """An object spooled here and written whole at ``close`` (``Fsspec``: nothing partial is ever seen)."""

    def __init__(self, be: Fsspec, u: Url) -> None:
        self._be, self._u, self._part = be, u, be.st.part_bytes()
        self._f = tempfile.SpooledTemporaryFile(max_size=self._part, prefix="zckpt-up-")  # noqa: SIM115

    def write(self, b: bytes) -> None:
        self._f.write(b)

    def close(self) -> None:
        fs, path = self._be.st.fsspec_fs(self._u), self._be._p(self._u)
        try:
            self._f.seek(0)
            if not getattr(self._f, "_rolled", True):  # still in memory: one write of the whole object
                fs.pipe_file(path, self._f.read())
                return
            with fs.open(path, "wb") as out:
                while chunk := self._f.read(self._part):
                    out.write(chunk)
        finally:
            self._f.close()

    def abort(self) -> None:
        self._f.close()


def of(st: ObjectStore, u: Url) -> S3 | Fsspec:
    """The client for ``u``'s scheme, with ``st``'s options and credentials."""
    if u.scheme == "s3":
        return S3(st)
    if u.scheme:
        return Fsspec(st)
    raise StorageError(f"{u}: no client for this scheme", path=str(u))  # pragma: no cover - parse refuses
