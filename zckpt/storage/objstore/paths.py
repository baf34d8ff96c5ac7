"""Listing and paths in a bucket: ``RemotePath`` (a ``PurePosixPath`` that keeps its ``s3://`` and answers
the few ``pathlib`` questions the formats ask, ``is_dir``, ``is_file``, ``exists``, ``iterdir``, ``glob``,
``stat().st_size``) from one delimiter listing per folder, cached (``_list``); ``size``, ``kind``;
``as_path`` (a user's string, or the ``s3:/...`` a ``pathlib.Path`` makes of it, as a path) and ``absolute``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import cast

from zckpt.errors import ObjectMissing
from zckpt.storage.objstore import backend
from zckpt.storage.objstore.client import (
    ObjectStore,
    Url,
    _Listing,
    _retry,
    _url,
    current,
    is_url,
    parse,
)


def _list(st: ObjectStore, u: Url) -> _Listing:
    key = str(u)
    with st.lock:
        hit = st.listings.get(key)
    if hit is not None:
        return hit
    st.count("requests")
    dirs, files = _retry(lambda: backend.of(st, u).list_dir(u), u, st=st)
    out = _Listing(frozenset(dirs), files)
    with st.lock:
        st.listings[key] = out
        for name, size in files.items():
            st.sizes[f"{key}/{name}"] = size
    return out


def size(st: ObjectStore, x: object) -> int:
    """The object's size in bytes (from a listing when one is cached, else one HEAD)."""
    u = _url(x)
    with st.lock:
        hit = st.sizes.get(str(u))
    if hit is not None:
        return hit
    if u.key:  # the folder's listing answers (one request per folder, cached), else one HEAD
        name = u.key.rsplit("/", 1)[-1]
        listing = _list(st, Url(u.scheme, u.bucket, u.key.rpartition("/")[0]))
        if name in listing.files:
            return listing.files[name]
        if name not in listing.dirs:
            raise ObjectMissing(f"{u}: no such key", hint="check the URL: list its folder", path=str(u))
    st.count("requests")
    n = int(_retry(lambda: backend.of(st, u).head(u), u, st=st))
    with st.lock:
        st.sizes[str(u)] = n
    return n


def kind(st: ObjectStore, x: object) -> str | None:
    """``"file"``, ``"dir"`` or None (nothing there)."""
    u = _url(x)
    if not u.key:
        _list(st, u)  # the bucket itself: raises when it does not exist
        return "dir"
    name = u.key.rsplit("/", 1)[-1]
    listing = _list(st, Url(u.scheme, u.bucket, u.key.rpartition("/")[0]))
    if name in listing.files:
        return "file"
    if name in listing.dirs:
        return "dir"
    return None


class RemotePath(PurePosixPath):
    """A path in a bucket (``s3://bucket/key``): pure path arithmetic, plus the stat-like questions zckpt's
    formats ask, answered from the folder listings of the running operation's ``ObjectStore``. It opens
    nothing itself: reads go through ``zckpt.storage.fileio``."""

    def __str__(self) -> str:
        s = super().__str__()
        scheme, _, rest = s.partition(":/")
        return f"{scheme}://{rest.lstrip('/')}"

    def __fspath__(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    @property
    def url(self) -> Url:
        return _url(str(self))

    def exists(self) -> bool:
        return kind(current(), self) is not None

    def is_file(self) -> bool:
        return kind(current(), self) == "file"

    def is_dir(self) -> bool:
        return kind(current(), self) == "dir"

    def is_symlink(self) -> bool:
        return False

    def resolve(self, strict: bool = False) -> RemotePath:
        return self

    def absolute(self) -> RemotePath:
        return self

    def iterdir(self) -> Iterator[RemotePath]:
        listing = _list(current(), self.url)
        for name in sorted(listing.dirs | set(listing.files)):
            yield self / name

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        """Names matching ``pattern`` (``*`` segments, as the formats use) under this folder."""
        parts = pattern.split("/")
        level = [self]
        for i, part in enumerate(parts):
            nxt = []
            for d in level:
                if not d.is_dir():
                    continue
                for c in d.iterdir():
                    if PurePosixPath(c.name).match(part) and (i == len(parts) - 1 or c.is_dir()):
                        nxt.append(c)
            level = nxt
        yield from level

    def stat(self) -> os.stat_result:
        return os.stat_result((0o100644, 0, 0, 1, 0, 0, size(current(), self), 0, 0, 0))


def as_path(x: str | os.PathLike[str]) -> Path:
    """A ``RemotePath`` for a URL (or the ``s3:/`` a ``pathlib.Path`` made of one), else a local ``Path``.
    Typed as ``Path``: a ``RemotePath`` answers the ``Path`` methods zckpt's readers call on inputs."""
    if isinstance(x, RemotePath):
        return cast(Path, x)
    u = parse(x)
    return Path(x) if u is None else cast(Path, RemotePath(str(u)))


def absolute(x: str | os.PathLike[str]) -> Path:
    """``Path(os.path.abspath(x))`` for a local path; a URL is absolute already."""
    p = as_path(x)
    return p if is_url(p) else Path(os.path.abspath(p))
