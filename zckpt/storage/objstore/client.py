"""The store client and what every other part of ``zckpt.storage.objstore`` shares: URL parsing (``Url``,
``parse``, ``is_url``), ``parse_options``, client errors as one ``StorageError`` line (``error``), retries of
a cut-off GET (``_retry``), and ``ObjectStore``: one operation's options, clients per bucket and their
credentials, figures (``stats``) and caches (listings, sizes, blocks, read-ahead windows and streams), with
their invalidation after a write (``forget``). Nothing here is process-wide: every ``ObjectStore`` is made
by one ``zckpt.storage.session.Storage`` and lives as long as it does.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from zckpt.errors import StorageError
from zckpt.storage.objstore import credentials, failures, policy

SCHEMES = ("s3",)
"""Schemes served by obstore (S3 and S3-compatible stores; tested against one). Any other scheme that an
installed fsspec knows goes through fsspec (``backend.Fsspec``)."""
_LOCAL_SCHEMES = frozenset({"file", "local"})
"""fsspec's names for the local disk: such a URL is refused (give the path itself)."""


_OWN_KEYS = frozenset({"in_flight", "part_bytes", "window_bytes", "endpoint_url"}) | policy.OWN_KEYS
"""Storage options zckpt reads itself; every other key goes to the client."""
_URL = re.compile(r"^([a-z][a-z0-9+.-]*):/(/?)(.*)$")


@dataclass(frozen=True)
class Url:
    """``scheme://bucket/key`` split: ``key`` has no leading slash ("" for the bucket's root)."""

    scheme: str
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"


def parse(x: object) -> Url | None:
    """The URL ``x`` names (``s3://b/k``, or the ``s3:/b/k`` that ``pathlib.Path("s3://b/k")`` makes of
    it), or None for a local path."""
    if isinstance(x, Url):
        return x
    s = os.fspath(x) if isinstance(x, os.PathLike) else x
    if not isinstance(s, str):
        return None
    m = _URL.match(s)
    if m is None:
        return None
    if m.group(1) not in SCHEMES and not _fsspec_knows(m.group(1), s, explicit=m.group(2) == "/"):
        return None
    bucket, _, key = m.group(3).partition("/")
    if not bucket:
        if m.group(2) != "/" and os.path.lexists(s):
            return None  # a local file that looks like one (``pathlib`` keeps one slash of ``x://``)
        scheme = m.group(1)
        raise StorageError(f"{scheme}://: the URL names no bucket", hint=f"give {scheme}://BUCKET/PATH",
                           path=f"{scheme}://")  # fmt: skip
    return Url(m.group(1), bucket, key.strip("/"))


def _fsspec_knows(scheme: str, s: str, explicit: bool) -> bool:
    """``scheme`` is one an installed fsspec serves. A ``scheme://`` it does not know (or with fsspec not
    installed) is refused in one line, and so is ``x:/...`` (what ``pathlib`` makes of ``x://...``) unless a
    local file has that name."""
    if len(scheme) < 2:  # a drive letter, not a scheme
        return False
    if scheme not in _LOCAL_SCHEMES:
        try:
            from fsspec.registry import known_implementations, registry
        except ImportError:
            known_implementations, registry = {}, {}
        if scheme in known_implementations or scheme in registry:
            return True
    if not explicit and (os.path.lexists(s) or scheme in _LOCAL_SCHEMES):
        return False  # a local path that looks like one (``pathlib`` keeps one slash of ``x://``)
    shown = _URL.sub(r"\1://\3", s)
    raise StorageError(
        f"{shown}: no client for {scheme}:// URLs",
        hint="s3:// is served by obstore (pip install 'zckpt[s3]'); other stores by an fsspec implementation "
        "of the scheme (pip install 'zckpt[fsspec]' and the scheme's package, e.g. gcsfs)"
        if scheme not in _LOCAL_SCHEMES
        else "give the local path itself, without file://",
        path=shown,
    )


def is_url(x: object) -> bool:
    return parse(x) is not None


def parse_options(pairs: list[str] | None) -> dict[str, str]:
    """``["key=value", ...]`` (the CLI's repeatable ``--storage-option``) as a dict."""
    out: dict[str, str] = {}
    for p in pairs or []:
        k, eq, v = p.partition("=")
        if not eq or not k:
            raise StorageError(
                f"--storage-option {p!r}: not key=value",
                hint="e.g. --storage-option endpoint=http://127.0.0.1:9000",
            )
        out[k.strip()] = v.strip()
    return out


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0][:200] if s else type(e).__name__


def error(e: BaseException, url: object) -> StorageError:
    """One line for a client error (``failures.one_line``)."""
    return failures.one_line(e, url)


def _retry(fn: Any, url: object, st: ObjectStore | None = None) -> Any:
    """``fn()``, its error as one line; retried only as ``policy.call`` says (a listing's body cut off),
    within ``st``'s options."""
    pol = policy.Policy.from_options(st.options if st is not None else {})
    return policy.call(fn, url, pol, on_retry=(lambda: st.count("retries")) if st is not None else None)


@dataclass(frozen=True)
class _Listing:
    """One folder (key prefix) listed with a delimiter: its sub-folders and its objects' sizes."""

    dirs: frozenset[str]
    files: Mapping[str, int]


@dataclass
class _Window:
    """Bytes ``[start, end)`` of one object, fetched (or being fetched) ahead of a sequential reader."""

    url: str
    start: int
    end: int
    data: Future[bytearray]
    buf: bytearray
    owner: Any = None
    """The ``ahead.Stream`` that fills it."""


def _url(x: object) -> Url:
    u = parse(x)
    if u is None:
        raise ValueError(f"{x!r} is not an object-store URL")
    return u


class ObjectStore:
    """One operation's object stores (made by ``zckpt.storage.session.Storage``, never shared between
    operations): its storage options, the client per bucket (and per fsspec scheme) with its credentials,
    the figures of its requests (``stats``), and its caches: folder listings, object sizes, small aligned
    blocks, read-ahead windows and their streams (``ahead``), a thread pool for parallel parts. A listing or
    size is cached for this object's lifetime (an operation, or a ``Checkpoint``: a consistent snapshot), and
    dropped when this object writes or deletes the key (``forget``). ``close()`` stops its streams and pool.

    Options: ``in_flight`` (default 8), ``part_bytes`` (default 8 MiB), ``window_bytes`` (default 32 MiB),
    ``max_retries`` (default 10), ``endpoint``/``endpoint_url``; every other key goes to the client."""

    def __init__(self, options: Mapping[str, str] | None = None) -> None:
        self.options: dict[str, str] = {k: str(v) for k, v in (options or {}).items()}
        self.lock = threading.Lock()
        self.clients: dict[str, Any] = {}
        self.listings: dict[str, _Listing] = {}
        self.sizes: dict[str, int] = {}
        self.cache: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        """Aligned small-read blocks (``read.BLOCK`` bytes), LRU."""
        self.room = 0
        """Blocks that running ``read.cache_room`` blocks ask to add to the cache's capacity."""
        self.windows: OrderedDict[int, _Window] = OrderedDict()
        self.streams: list[Any] = []
        """Read-ahead streams (``ahead.Stream``): closed when their object is written, and by ``close``."""
        self.counts = {"requests": 0, "bytes": 0, "retries": 0, "uploads": 0, "bytes_up": 0}
        self._pool: ThreadPoolExecutor | None = None

    # -- options -----------------------------------------------------------------------------------------
    def in_flight(self) -> int:
        return max(1, int(self.options.get("in_flight", os.environ.get("ZCKPT_S3_IN_FLIGHT", "8"))))

    def part_bytes(self) -> int:
        dflt = os.environ.get("ZCKPT_S3_PART_BYTES", str(8 << 20))
        return max(5 << 20, int(self.options.get("part_bytes", dflt)))

    def window_bytes(self, floor: int) -> int:
        """How far a sequential reader's stream fetches ahead of it (``ahead.Stream``), default 32 MiB."""
        dflt = os.environ.get("ZCKPT_S3_WINDOW_BYTES", str(32 << 20))
        return max(floor, int(self.options.get("window_bytes", dflt)))

    # -- figures -----------------------------------------------------------------------------------------
    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def stats(self) -> dict[str, int]:
        """Requests made, bytes fetched and uploaded, retries, by this object so far."""
        with self.lock:
            return dict(self.counts)

    # -- threads -----------------------------------------------------------------------------------------
    def executor(self) -> ThreadPoolExecutor:
        with self.lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.in_flight(), thread_name_prefix="zckpt-s3")
            return self._pool

    def close(self) -> None:
        """Stop the read-ahead streams and the thread pool; drop the caches (clients too)."""
        with self.lock:
            gone, self.streams = list(self.streams), []
            pool, self._pool = self._pool, None
            self.windows.clear()
            self.cache.clear()
            self.listings.clear()
            self.sizes.clear()
            self.clients.clear()
        for st in gone:
            st.close()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    # -- cache invalidation ------------------------------------------------------------------------------
    def forget(self, u: Url) -> None:
        """Drop what is cached about ``u`` and its folder (after this object wrote or deleted it)."""
        parent = Url(u.scheme, u.bucket, u.key.rpartition("/")[0])
        with self.lock:
            self.sizes.pop(str(u), None)
            for k in [k for k in self.listings if str(u).startswith(k) or k.startswith(str(u))]:
                self.listings.pop(k)
            self.listings.pop(str(parent), None)
            for ck in [ck for ck in self.cache if ck[0] == str(u)]:
                self.cache.pop(ck)
            for wk in [wk for wk, w in self.windows.items() if w.url == str(u)]:
                self.windows.pop(wk)
            gone = [s for s in self.streams if s.key == str(u)]
        for s in gone:
            s.close()

    # -- clients -----------------------------------------------------------------------------------------
    def _endpoint(self) -> str | None:
        return (
            self.options.get("endpoint")
            or self.options.get("endpoint_url")
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
        )

    def fsspec_fs(self, u: Url) -> Any:
        """The fsspec filesystem for ``u``'s scheme, built with the storage options (one per scheme)."""
        with self.lock:
            fs = self.clients.get(u.scheme + "://")
        if fs is not None:
            return fs
        try:
            import fsspec

            fs = fsspec.filesystem(u.scheme, **{k: v for k, v in self.options.items() if k not in _OWN_KEYS})
        except ImportError as e:
            need = e.name or "its fsspec package"
            raise StorageError(f"{u}: reading or writing {u.scheme}:// needs {need}",
                               hint="pip install 'zckpt[fsspec]' and the package for the scheme",
                               path=str(u)) from None  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a bad option: one line
            raise StorageError(f"{u}: cannot configure the {u.scheme}:// client ({_first_line(e)})",
                               hint="check --storage-option keys", path=str(u)) from None  # fmt: skip
        with self.lock:
            self.clients[u.scheme + "://"] = fs
        return fs

    def client(self, u: Url) -> Any:
        """The ``s3://`` client for ``u``'s bucket, made once (with its credentials) per bucket."""
        with self.lock:
            st = self.clients.get(u.bucket)
            if st is not None:
                return st
        try:
            from obstore.store import S3Store  # imported here: local runs never load the client
        except ImportError:
            raise StorageError(f"{u}: reading or writing s3:// needs the obstore client",
                               hint="pip install 'zckpt[s3]'", path=str(u)) from None  # fmt: skip

        config = {k: v for k, v in self.options.items() if k not in _OWN_KEYS}
        ep = self._endpoint()
        if ep:
            config["endpoint"] = ep
        region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
        if region and "region" not in config:
            config["region"] = region
        pol = policy.Policy.from_options(self.options)
        client, retry = pol.client_options(ep), pol.retry_config()
        extra, provider = credentials.for_client(str(u), config, os.environ, endpoint=ep)
        config.update(extra)

        def make(client_options: dict[str, Any], retry_config: dict[str, Any]) -> Any:
            return S3Store(
                u.bucket,
                config=config,  # type: ignore[arg-type]
                client_options=client_options,  # type: ignore[arg-type]
                retry_config=retry_config,  # type: ignore[arg-type]
                credential_provider=provider,
            )

        try:
            st = make(client, retry)
        except Exception as e:  # noqa: BLE001 - a bad option: one line
            raise StorageError(
                f"{u}: cannot configure the S3 client ({_first_line(e)})",
                hint="check --storage-option keys and the AWS_* variables",
            ) from None
        policy.reach(make, u, pol, ep)  # a store that cannot be reached: one line now, not after the retries
        with self.lock:
            self.clients[u.bucket] = st
        return st


_CURRENT: contextvars.ContextVar[ObjectStore | None] = contextvars.ContextVar("zckpt_objects", default=None)
"""The ``ObjectStore`` of the operation running in this context (its thread, and the threads it starts
through ``zckpt.storage.threads``): set by ``bound``, never process-wide."""


def current() -> ObjectStore:
    """The running operation's ``ObjectStore``; outside any operation (an internal function called on its
    own), a fresh one that keeps nothing beyond the call."""
    st = _CURRENT.get()
    return st if st is not None else ObjectStore()


@contextlib.contextmanager
def bound(st: ObjectStore) -> Iterator[ObjectStore]:
    """Make ``st`` the current ``ObjectStore`` of this context while the block runs."""
    token = _CURRENT.set(st)
    try:
        yield st
    finally:
        _CURRENT.reset(token)
