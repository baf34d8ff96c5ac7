"""Listing and paths in a bucket: ``RemotePath`` (a ``Url`` with the path arithmetic and the few
stat-like questions the formats ask, ``is_dir``, ``is_file``, ``exists``, ``iterdir``, ``glob``, ``size``;
never a ``Path``) from one delimiter listing per folder, cached (``_list``); ``size``, ``kind``.
``zckpt.storage.location`` names a place that may be either (``Location``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath

from zckpt.errors import ObjectMissing
from zckpt.storage.objstore import backend
from zckpt.storage.objstore.client import (
    ObjectStore,
    Url,
    _Listing,
    _retry,
    _url,
    current,
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


@dataclass(frozen=True, repr=False)
class RemotePath(Url):
    """A location in a bucket (``s3://bucket/key``): the ``Url`` plus the path arithmetic the formats use
    (``/``, ``name``, ``parent``, ``suffix``, ``stem``, ``with_name``, ``with_suffix``, ``parents``) and the
    stat-like questions they ask (``exists``, ``is_file``, ``is_dir``, ``iterdir``, ``glob``, ``size``),
    answered from the folder listings of the running operation's ``ObjectStore``. It is not a ``Path`` nor
    ``os.PathLike``: ``open``, ``os.*`` and ``Path.resolve`` refuse it instead of naming a local file
    ``s3:/...``; reads go through ``zckpt.storage.fileio``, writes through ``zckpt.storage.staging``, and
    code that takes either says so with ``zckpt.storage.location.Location``."""

    @classmethod
    def of(cls, x: object) -> RemotePath:
        """The ``RemotePath`` of a URL: ``s3://b/k``, a ``Url``, or the ``s3:/b/k`` a ``Path`` made of one."""
        u = _url(x)
        return u if isinstance(u, RemotePath) else cls(u.scheme, u.bucket, u.key)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __lt__(self, other: RemotePath) -> bool:  # as ``Path`` sorts: by parts
        return str(self).split("/") < str(other).split("/")

    @property
    def url(self) -> Url:
        return Url(self.scheme, self.bucket, self.key)

    def _at(self, key: str) -> RemotePath:
        return RemotePath(self.scheme, self.bucket, key.strip("/"))

    def __truediv__(self, other: str) -> RemotePath:
        return self._at(str(PurePosixPath("/", self.key, other)))

    @property
    def name(self) -> str:
        """The last segment of the key (the bucket's name for its root, as ``Path("s3://b").name``)."""
        return self.key.rpartition("/")[2] if self.key else self.bucket

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.name).suffix

    @property
    def stem(self) -> str:
        return PurePosixPath(self.name).stem

    @property
    def parent(self) -> RemotePath:
        """The folder holding this key (the bucket's root is its own parent, as ``Path("/").parent``)."""
        return self._at(self.key.rpartition("/")[0]) if self.key else self

    @property
    def parents(self) -> tuple[RemotePath, ...]:
        out, p = [], self
        while p.key:
            p = p.parent
            out.append(p)
        return tuple(out)

    def with_name(self, name: str) -> RemotePath:
        return self.parent / PurePosixPath(self.name).with_name(name).name

    def with_suffix(self, suffix: str) -> RemotePath:
        return self.with_name(PurePosixPath(self.name).with_suffix(suffix).name)

    def is_absolute(self) -> bool:
        return True

    def exists(self) -> bool:
        return kind(current(), self) is not None

    def is_file(self) -> bool:
        return kind(current(), self) == "file"

    def is_dir(self) -> bool:
        return kind(current(), self) == "dir"

    def is_symlink(self) -> bool:
        return False

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

    def size(self) -> int:
        """The object's size in bytes (``Path.stat().st_size`` of a local file)."""
        return size(current(), self)
