"""Object storage (``s3://bucket/key``): the one module that talks to a store, through ``obstore``.

``zckpt.io.storage`` and ``zckpt.io.staging`` route here on a URL's scheme (``is_url``); local paths never
reach this module. What it owns:

- ``RemotePath``: a ``PurePosixPath`` that keeps its ``s3://`` and answers the few ``pathlib`` questions the
  formats ask (``is_dir``, ``is_file``, ``exists``, ``iterdir``, ``glob``, ``stat().st_size``) from one
  delimiter listing per folder, cached (``as_path`` turns a user's string, or the ``s3:/...`` a
  ``pathlib.Path`` makes of it, into one).
- Reads: ``read_into`` fetches exactly ``[offset, offset + n)`` with ranged GETs, cut into parts of at most
  ``part_bytes`` that go out ``in_flight`` at a time. A reader that says how far it reads on (``limit``: the
  end of the checksummed record it is in) is served from read-ahead windows of ``window_bytes`` that tile the
  record and never pass its end (``_from_window``). Reads under ``BLOCK`` bytes (headers, pickles, small
  tensors) come from a small cache of aligned ``BLOCK``-byte blocks, so neighbouring small reads coalesce
  into one request. Memory: the caller's buffer, at most ``MAX_WINDOWS`` windows and ``CACHE_BLOCKS``
  blocks.
- Retries: the client retries 5xx, 503 SlowDown and dropped connections with exponential backoff and
  jitter (``RetryConfig``); a GET whose body is cut off mid-way is retried here too (``_retry``).
- Writes: ``Upload``, one object streamed as a multipart upload (parts of ``part_bytes``) that becomes
  visible only when it completes; ``abort()`` leaves nothing. ``upload_file`` (create-if-absent for the
  objects that complete a checkpoint), ``put_bytes``, ``delete``, ``list_keys``.
- Errors: every client error becomes one ``StorageError`` line naming the URL, with a hint.
- ``stats()``: requests and bytes fetched by this process (the benchmark's figures).

Configuration is the standard AWS chain as the client reads it (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``/``AWS_REGION``), plus
``configure(storage_options)`` (CLI ``--storage-option key=value``). An ``http://`` endpoint is allowed
because its URL says so. zckpt's own keys: ``in_flight`` (default 8), ``part_bytes`` (default 8 MiB),
``window_bytes`` (default 32 MiB), ``max_retries`` (default 10).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import Any, cast

from zckpt.errors import ObjectMissing, StorageError

SCHEMES = ("s3",)
"""Schemes served (the store client is built for S3 and S3-compatible stores; tested against one)."""

BLOCK = 256 << 10
"""Reads smaller than this are served from aligned cached blocks of this size (one request per block)."""
CACHE_BLOCKS = 32
"""Blocks kept (LRU, whole process): 8 MiB at most."""

_OWN_KEYS = frozenset({"in_flight", "part_bytes", "window_bytes", "max_retries", "endpoint_url"})
"""Storage options zckpt reads itself; every other key goes to the client."""
_URL = re.compile(r"^([a-z][a-z0-9+.-]*):/(/?)(.*)$")
_lock = threading.Lock()
_options: dict[str, str] = {}
_stores: dict[str, Any] = {}
_listings: dict[str, _Listing] = {}
_cache: OrderedDict[tuple[str, int], bytes] = OrderedDict()
_sizes: dict[str, int] = {}
_pool: ThreadPoolExecutor | None = None
_counts = {"requests": 0, "bytes": 0, "retries": 0, "uploads": 0, "bytes_up": 0}


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
    if m is None or m.group(1) not in SCHEMES:
        return None
    bucket, _, key = m.group(3).partition("/")
    if not bucket:
        return None
    return Url(m.group(1), bucket, key.strip("/"))


def is_url(x: object) -> bool:
    return parse(x) is not None


def configure(options: Mapping[str, str] | None) -> None:
    """Set the storage options for this process (``--storage-option``, the library's ``storage_options=``);
    clients already built are rebuilt with them."""
    with _lock:
        _options.clear()
        _options.update({k: str(v) for k, v in (options or {}).items()})
        _stores.clear()
        _listings.clear()
        _cache.clear()
        _sizes.clear()
        _windows.clear()


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


def in_flight() -> int:
    return max(1, int(_options.get("in_flight", os.environ.get("ZCKPT_S3_IN_FLIGHT", "8"))))


def part_bytes() -> int:
    return max(5 << 20, int(_options.get("part_bytes", os.environ.get("ZCKPT_S3_PART_BYTES", str(8 << 20)))))


def stats() -> dict[str, int]:
    """Requests made, bytes fetched and uploaded, retries, by this process so far."""
    with _lock:
        return dict(_counts)


def reset_stats() -> None:
    with _lock:
        for k in _counts:
            _counts[k] = 0


def _count(key: str, n: int = 1) -> None:
    with _lock:
        _counts[key] += n


def _endpoint() -> str | None:
    return (
        _options.get("endpoint")
        or _options.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )


def _store(u: Url) -> Any:
    with _lock:
        st = _stores.get(u.bucket)
        if st is not None:
            return st
    try:
        from obstore.store import S3Store  # imported here: local runs never load the client
    except ImportError:
        raise StorageError(f"{u}: reading or writing s3:// needs the obstore client",
                           hint="pip install 'zckpt[s3]'", path=str(u)) from None  # fmt: skip

    config = {k: v for k, v in _options.items() if k not in _OWN_KEYS}
    ep = _endpoint()
    if ep:
        config["endpoint"] = ep
    region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
    if region and "region" not in config:
        config["region"] = region
    client: dict[str, Any] = {"connect_timeout": timedelta(seconds=10), "timeout": timedelta(seconds=120)}
    if ep and ep.startswith("http://"):
        client["allow_http"] = True  # the endpoint's URL says http: that is the user's choice
    retry = {
        "max_retries": int(_options.get("max_retries", "10")),
        "retry_timeout": timedelta(seconds=180),
        "backoff": {
            "init_backoff": timedelta(milliseconds=50),
            "max_backoff": timedelta(seconds=5),
            "base": 2,
        },
    }
    provider = None
    keyed = config.get("access_key_id") or os.environ.get("AWS_ACCESS_KEY_ID")
    if not keyed and _has_profile():
        provider = _profile_provider()
    if not keyed and provider is None and not _other_chain(config):
        raise StorageError(
            f"{u}: no credentials for the store",
            hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or "
            "--storage-option skip_signature=true for a public bucket",
            path=str(u),
        )
    try:
        st = S3Store(
            u.bucket,
            config=config,  # type: ignore[arg-type]
            client_options=client,  # type: ignore[arg-type]
            retry_config=retry,  # type: ignore[arg-type]
            credential_provider=provider,
        )
    except Exception as e:  # noqa: BLE001 - a bad option: one line
        raise StorageError(
            f"{u}: cannot configure the S3 client ({_first_line(e)})",
            hint="check --storage-option keys and the AWS_* variables",
        ) from None
    with _lock:
        _stores[u.bucket] = st
    return st


def _other_chain(config: Mapping[str, str]) -> bool:
    """Credentials the client finds by itself: anonymous access asked for, web identity, a container's
    credentials endpoint, or the instance metadata service (unless ``AWS_EC2_METADATA_DISABLED``)."""
    env = os.environ
    return (
        config.get("skip_signature", "").lower() == "true"
        or bool(env.get("AWS_WEB_IDENTITY_TOKEN_FILE"))
        or bool(
            env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
        )
        or env.get("AWS_EC2_METADATA_DISABLED", "").lower() != "true"
    )


def _has_profile() -> bool:
    home = os.path.expanduser("~")
    return bool(os.environ.get("AWS_PROFILE")) or any(
        os.path.exists(os.path.join(home, ".aws", n)) for n in ("credentials", "config")
    )


def _profile_provider() -> Any:
    """Credentials from an AWS profile (``AWS_PROFILE``, ``~/.aws``), through boto3 when it is installed."""
    try:
        import boto3  # noqa: F401
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None
    return Boto3CredentialProvider()


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0][:200] if s else type(e).__name__


def error(e: BaseException, url: object) -> StorageError:
    """One line for a client error: no credentials, no such bucket or key, access denied, or other."""
    from obstore import exceptions as ox

    msg = str(e)
    if isinstance(e, (FileNotFoundError, ox.NotFoundError)) or "NoSuchKey" in msg or "NoSuchBucket" in msg:
        if "NoSuchBucket" in msg or "bucket does not exist" in msg:
            return ObjectMissing(
                f"{url}: no such bucket",
                path=str(url),
                hint="check the bucket name and the endpoint (AWS_ENDPOINT_URL)",
            )
        return ObjectMissing(
            f"{url}: no such key",
            hint="check the URL: list the prefix, e.g. `aws s3 ls` on its folder",
            path=str(url),
        )
    if isinstance(e, ox.UnauthenticatedError) or any(
        s in msg for s in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken")
    ):
        return StorageError(
            f"{url}: the store rejected the credentials",
            path=str(url),
            hint="check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)",
        )
    if isinstance(e, (PermissionError, ox.PermissionDeniedError)) or "AccessDenied" in msg:
        return StorageError(
            f"{url}: access denied",
            path=str(url),
            hint="the credentials lack permission for this bucket or key (s3:GetObject, "
            "s3:ListBucket, s3:PutObject)",
        )
    low = msg.lower()
    if "credential" in low or "missing access key" in low:
        return StorageError(
            f"{url}: no credentials for the store",
            path=str(url),
            hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
        )
    if "http" in low and "allow_http" in low.replace(" ", "_"):
        return StorageError(
            f"{url}: plain http refused",
            path=str(url),
            hint="give the endpoint as http://... in AWS_ENDPOINT_URL",
        )
    return StorageError(
        f"{url}: {_first_line(e)}",
        path=str(url),
        hint="check the endpoint (AWS_ENDPOINT_URL), the network and the credentials",
    )


_TRANSIENT = (
    "connection",
    "reset",
    "closed",
    "timed out",
    "timeout",
    "body",
    "incomplete",
    "eof",
    "broken pipe",
    "500",
    "502",
    "503",
    "504",
    "slowdown",
    "service unavailable",
)


def _retry(fn: Any, url: object, tries: int = 6) -> Any:
    """``fn()`` retried with exponential backoff on what the client lets through as a transient failure (a
    response body cut off after its headers); anything else, or the last failure, as ``error``."""
    from obstore import exceptions as ox

    delay = 0.05
    for k in range(tries):
        try:
            return fn()
        except StorageError:
            raise
        except (
            FileNotFoundError,
            PermissionError,
            ox.NotFoundError,
            ox.PermissionDeniedError,
            ox.UnauthenticatedError,
            ox.AlreadyExistsError,
            ox.PreconditionError,
        ) as e:
            raise error(e, url) from None
        except Exception as e:  # noqa: BLE001 - classified below
            if k == tries - 1 or not any(s in str(e).lower() for s in _TRANSIENT):
                raise error(e, url) from None
            _count("retries")
            time.sleep(delay)
            delay = min(2.0, delay * 2)
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------- listing


@dataclass(frozen=True)
class _Listing:
    """One folder (key prefix) listed with a delimiter: its sub-folders and its objects' sizes."""

    dirs: frozenset[str]
    files: Mapping[str, int]


def _list(u: Url) -> _Listing:
    key = str(u)
    with _lock:
        hit = _listings.get(key)
    if hit is not None:
        return hit
    import obstore

    prefix = u.key + "/" if u.key else None
    _count("requests")
    res = _retry(lambda: obstore.list_with_delimiter(_store(u), prefix), u)
    dirs = frozenset(p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"])
    files = {m["path"].rsplit("/", 1)[-1]: int(m["size"]) for m in res["objects"]}
    out = _Listing(dirs, files)
    with _lock:
        _listings[key] = out
        for name, size in files.items():
            _sizes[f"{key}/{name}"] = size
    return out


def _forget(u: Url) -> None:
    """Drop what is cached about ``u`` and its folder (after a write or delete)."""
    parent = Url(u.scheme, u.bucket, u.key.rpartition("/")[0])
    with _lock:
        _sizes.pop(str(u), None)
        for k in [k for k in _listings if str(u).startswith(k) or k.startswith(str(u))]:
            _listings.pop(k)
        _listings.pop(str(parent), None)
        for ck in [ck for ck in _cache if ck[0] == str(u)]:
            _cache.pop(ck)
        for wk in [wk for wk, w in _windows.items() if w.url == str(u)]:
            _windows.pop(wk)


def size(x: object) -> int:
    """The object's size in bytes (from a listing when one is cached, else one HEAD)."""
    u = _url(x)
    with _lock:
        hit = _sizes.get(str(u))
    if hit is not None:
        return hit
    if u.key:  # the folder's listing answers (one request per folder, cached), else one HEAD
        name = u.key.rsplit("/", 1)[-1]
        listing = _list(Url(u.scheme, u.bucket, u.key.rpartition("/")[0]))
        if name in listing.files:
            return listing.files[name]
        if name not in listing.dirs:
            raise ObjectMissing(f"{u}: no such key", hint="check the URL: list its folder", path=str(u))
    import obstore

    _count("requests")
    meta = _retry(lambda: obstore.head(_store(u), u.key), u)
    n = int(meta["size"])
    with _lock:
        _sizes[str(u)] = n
    return n


def kind(x: object) -> str | None:
    """``"file"``, ``"dir"`` or None (nothing there)."""
    u = _url(x)
    if not u.key:
        _list(u)  # the bucket itself: raises when it does not exist
        return "dir"
    name = u.key.rsplit("/", 1)[-1]
    listing = _list(Url(u.scheme, u.bucket, u.key.rpartition("/")[0]))
    if name in listing.files:
        return "file"
    if name in listing.dirs:
        return "dir"
    return None


def _url(x: object) -> Url:
    u = parse(x)
    if u is None:
        raise ValueError(f"{x!r} is not an object-store URL")
    return u


class RemotePath(PurePosixPath):
    """A path in a bucket (``s3://bucket/key``): pure path arithmetic, plus the stat-like questions zckpt's
    formats ask, answered from cached folder listings. It opens nothing itself: reads go through
    ``zckpt.io.storage``."""

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
        return kind(self) is not None

    def is_file(self) -> bool:
        return kind(self) == "file"

    def is_dir(self) -> bool:
        return kind(self) == "dir"

    def is_symlink(self) -> bool:
        return False

    def resolve(self, strict: bool = False) -> RemotePath:
        return self

    def absolute(self) -> RemotePath:
        return self

    def iterdir(self) -> Iterator[RemotePath]:
        listing = _list(self.url)
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
        return os.stat_result((0o100644, 0, 0, 1, 0, 0, size(self), 0, 0, 0))


def as_path(x: str | os.PathLike[str]) -> Path:
    """A ``RemotePath`` for a URL (or the ``s3:/`` a ``pathlib.Path`` made of one), else a local ``Path``.
    Typed as ``Path``: a ``RemotePath`` answers the ``Path`` methods zckpt's readers call on inputs."""
    if isinstance(x, RemotePath):
        return cast(Path, x)
    u = parse(x)
    return Path(x) if u is None else cast(Path, RemotePath(str(u)))


# ------------------------------------------------------------------------------------------------ reads


def _get(u: Url, a: int, b: int) -> memoryview:
    import obstore

    def once() -> memoryview:
        _count("requests")
        got = memoryview(obstore.get_range(_store(u), u.key, start=a, end=b))
        if len(got) != b - a:
            raise OSError(f"connection closed: {len(got)} of {b - a} bytes")
        _count("bytes", b - a)
        return got

    return _retry(once, u)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(in_flight(), 1), thread_name_prefix="zckpt-s3")
        return _pool


def _block(u: Url, i: int, total: int) -> bytes:
    key = (str(u), i)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    data = bytes(_get(u, i * BLOCK, min(total, (i + 1) * BLOCK)))
    with _lock:
        _cache[key] = data
        while len(_cache) > CACHE_BLOCKS:
            _cache.popitem(last=False)
    return data


@dataclass
class _Window:
    """Bytes ``[start, end)`` of one object, fetched (or being fetched) ahead of a sequential reader."""

    url: str
    start: int
    end: int
    data: Future[bytearray]


_windows: OrderedDict[int, _Window] = OrderedDict()
_window_ids = iter(range(1 << 62))


def window_bytes() -> int:
    return max(
        BLOCK, int(_options.get("window_bytes", os.environ.get("ZCKPT_S3_WINDOW_BYTES", str(32 << 20))))
    )


def _from_window(u: Url, offset: int, out: memoryview, limit: int) -> None:
    """Serve ``out`` from windows of ``[offset, limit)`` fetched ahead: one sequential reader's small or
    medium reads (a ZeRO partition read param by param) become few large ranged GETs that tile the record,
    never past ``limit`` (the end of the record being read). Once a read passes the middle of a window, the
    next one is fetched in the background, so the network overlaps the reader's work. At most
    ``MAX_WINDOWS`` windows are held."""
    done, n = 0, len(out)
    while done < n:
        at = offset + done
        w, mine = _window_at(u, at, max(window_bytes(), n - done), limit)
        if mine:
            _fill(u, w)
        data = w.data.result()
        k = min(n - done, w.end - at)
        out[done : done + k] = memoryview(data)[at - w.start : at - w.start + k]
        done += k
        if w.end < limit and at + k > (w.start + w.end) // 2:
            nxt, new = _window_at(u, w.end, window_bytes(), limit)
            if new:
                threading.Thread(target=_fill, args=(u, nxt, False), name="zckpt-ahead", daemon=True).start()


def _held(u: Url, at: int) -> bool:
    """A window already holds byte ``at`` of ``u`` (a reader's last read of a record comes from it too)."""
    key = str(u)
    with _lock:
        return any(w.url == key and w.start <= at < w.end for w in _windows.values())


def _window_at(u: Url, at: int, size: int, limit: int) -> tuple[_Window, bool]:
    """The window holding byte ``at`` of ``u``, or a new one ``[at, at + size)`` (clipped to ``limit``) that
    the caller must fill (then True)."""
    key = str(u)
    with _lock:
        w = next((w for w in _windows.values() if w.url == key and w.start <= at < w.end), None)
        if w is not None:
            return w, False
        w = _Window(key, at, min(limit, at + size), Future())
        _windows[next(_window_ids)] = w
        while len(_windows) > MAX_WINDOWS:
            _windows.popitem(last=False)
        return w, True


def _fill(u: Url, w: _Window, raise_: bool = True) -> None:
    buf = bytearray(w.end - w.start)
    try:
        _read_parts(u, w.start, memoryview(buf))
    except BaseException as e:
        w.data.set_exception(e)
        with _lock:
            for k in [k for k, v in _windows.items() if v is w]:
                _windows.pop(k)
        if raise_:
            raise
        return
    w.data.set_result(buf)


MAX_WINDOWS = 4
"""Windows held at once (whole process), prefetched ones included: memory ``MAX_WINDOWS * window_bytes`` at
most (128 MiB)."""


def read_into(x: object, offset: int, out: memoryview, limit: int | None = None) -> None:
    """Fill ``out`` with the object's bytes ``[offset, offset + len(out))``: ranged GETs of at most
    ``part_bytes``, ``in_flight`` at a time; a read under ``BLOCK`` bytes comes from the block cache.
    ``limit``: the caller reads on sequentially up to this byte (a checksummed record's end), so a window
    up to it may be fetched ahead (``_from_window``)."""
    u = _url(x)
    n = len(out)
    total = size(u)
    if offset < 0 or offset + n > total:
        from zckpt.errors import CorruptCheckpoint

        raise CorruptCheckpoint(
            f"{u}: needs bytes [{offset}, {offset + n}) but the object has {total} bytes (truncated?)",
            path=str(u),
        )
    if n == 0:
        return
    if (
        limit is not None
        and min(limit, total) >= offset + n
        and (min(limit, total) > offset + n or _held(u, offset))
    ):
        _from_window(u, offset, out, min(limit, total))
        return
    if n < BLOCK:
        done = 0
        while done < n:
            i = (offset + done) // BLOCK
            blk = _block(u, i, total)
            at = offset + done - i * BLOCK
            k = min(n - done, len(blk) - at)
            out[done : done + k] = blk[at : at + k]
            done += k
        return
    _read_parts(u, offset, out)


def _read_parts(u: Url, offset: int, out: memoryview) -> None:
    """``out`` from ``[offset, offset + len(out))`` in parts of ``part_bytes``, ``in_flight`` at a time."""
    n = len(out)
    step = part_bytes()
    cuts = [(a, min(n, a + step)) for a in range(0, n, step)]
    if len(cuts) == 1 or threading.current_thread().name.startswith("zckpt-s3"):
        for a, b in cuts:
            out[a:b] = _get(u, offset + a, offset + b)
        return

    def part(ab: tuple[int, int]) -> None:
        a, b = ab
        out[a:b] = _get(u, offset + a, offset + b)

    for f in [_executor().submit(part, c) for c in cuts]:
        f.result()


class RemoteFile(io.RawIOBase):
    """A read-only, seekable file over an object: small reads through the block cache, large ones direct
    (``zipfile``, the safetensors header, pickles read it like a local file)."""

    def __init__(self, x: object) -> None:
        super().__init__()
        self.url = _url(x)
        self.size = size(self.url)
        self.pos = 0
        self.name = str(self.url)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = max(0, min(len(mv), self.size - self.pos))
        if n:
            read_into(self.url, self.pos, mv[:n])
            self.pos += n
        return n

    def readall(self) -> bytes:
        buf = bytearray(max(0, self.size - self.pos))
        self.readinto(buf)
        return bytes(buf)


def open_read(x: object) -> io.BufferedReader:
    return io.BufferedReader(RemoteFile(x), buffer_size=BLOCK // 4)


def absolute(x: str | os.PathLike[str]) -> Path:
    """``Path(os.path.abspath(x))`` for a local path; a URL is absolute already."""
    p = as_path(x)
    return p if is_url(p) else Path(os.path.abspath(p))


# ----------------------------------------------------------------------------------------------- writes


class Upload:
    """One object written as a stream: a multipart upload in parts of ``part_bytes`` (``in_flight`` parts
    uploading at once), a single PUT when it stays under one part. The object appears only at ``close()``;
    ``abort()`` (or an error) leaves nothing, not even the parts."""

    def __init__(self, x: object) -> None:
        import obstore

        self.url = _url(x)
        self._w = _retry(
            lambda: obstore.open_writer(
                _store(self.url), self.url.key, buffer_size=part_bytes(), max_concurrency=in_flight()
            ),
            self.url,
            tries=1,
        )
        self._w.__enter__()
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
            self._w.__exit__(None, None, None)
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
            self._w.__exit__(RuntimeError, RuntimeError("aborted"), None)


def upload_file(local: str | os.PathLike[str], x: object, *, create: bool = False) -> None:
    """Upload the local file to ``x``: one PUT under a part, else a multipart upload. ``create``: fail with
    ``OutputExists`` if the object exists (``If-None-Match: *``: of two writers, one wins)."""
    import obstore

    u = _url(x)
    n = os.path.getsize(local)
    if n <= part_bytes() or create:
        if n > (256 << 20):
            raise StorageError(f"{u}: {n} bytes for a create-if-absent object", path=str(u))
        with open(local, "rb") as f:
            data = f.read()
        try:
            _count("requests")
            _retry(lambda: obstore.put(_store(u), u.key, data, mode="create" if create else "overwrite"), u)
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
    import obstore

    by_bucket: dict[str, list[Url]] = {}
    for s in urls:
        u = _url(s)
        by_bucket.setdefault(u.bucket, []).append(u)
    for us in by_bucket.values():
        for i in range(0, len(us), 1000):
            part = us[i : i + 1000]
            _count("requests")
            _retry(lambda part=part: obstore.delete(_store(part[0]), [u.key for u in part]), part[0])
            for u in part:
                _forget(u)


def list_keys(x: object, *, recursive: bool = True) -> list[str]:
    """The URLs of every object under the folder ``x`` (its whole subtree unless not ``recursive``)."""
    import obstore

    u = _url(x)
    prefix = u.key + "/" if u.key else None
    if not recursive:
        return [f"{u}/{n}" for n in sorted(_list(u).files)]
    out: list[str] = []
    _count("requests")
    for batch in _retry(lambda: list(obstore.list(_store(u), prefix)), u):
        out += [f"{u.scheme}://{u.bucket}/{m['path']}" for m in batch]
    return sorted(out)


def put_bytes(x: object, data: bytes) -> None:
    """One small object, written whole by one PUT (it replaces what was there)."""
    import obstore

    u = _url(x)
    _count("requests")
    _retry(lambda: obstore.put(_store(u), u.key, data), u)
    _count("uploads")
    _count("bytes_up", len(data))
    _forget(u)
