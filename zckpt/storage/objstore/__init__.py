"""Object storage (``s3://bucket/key``): the one package that talks to a store, through ``obstore`` (or an
fsspec filesystem for other schemes).

``zckpt.storage.fileio`` and ``zckpt.storage.staging`` route here on a URL's scheme (``is_url``); local paths
never reach it. Its modules, each importing only those above it:

- ``failures``, ``policy``, ``credentials``: error lines, retries and timeouts, the credential chain.
- ``client``: URLs, ``ObjectStore`` (one operation's options, clients per bucket with their credentials,
  caches and figures), errors as one ``StorageError`` line naming the URL with a hint, retries, ``current``
  / ``bound`` (the running operation's ``ObjectStore``).
- ``backend``: the client contract (``S3`` through obstore, ``Fsspec``), bound to one ``ObjectStore``.
- ``paths``: ``RemotePath`` (a ``Url`` with path arithmetic, never a ``Path``) and the listings behind it,
  ``size``, ``kind``.
- ``ahead``: read-ahead streams for sequential readers (a few streamed GETs per record, on their own thread).
- ``read``: ranged reads (``read_into``: parts, read-ahead, the block cache, ``prefetch``), ``RemoteFile``.
- ``write``: ``Upload`` (multipart, visible only when it completes), ``upload_file``, ``put_bytes``,
  ``delete``, ``list_keys``.

Nothing is process-wide. Each operation (a library call, a CLI command, an engine save or load, an open
``Checkpoint``) owns one ``ObjectStore``, made by its ``zckpt.storage.session.Storage`` from the operation's
storage options, and binds it for its own thread and the threads it starts (``client.bound``). The
functions below act on that one (``current()``); the modules' own functions take it explicitly.

Failures: ``failures`` classifies a client error (by type and the fields of obstore's error chain, never
its text) and words it as one line; ``policy`` says who retries what (obstore: 5xx, SlowDown, connection
errors, cut-off GET bodies; zckpt: only a listing's body cut off) within ``max_retries`` and
``retry_timeout``, and makes one no-retry request when a store is first built, so an unreachable store is
said at once; ``credentials`` finds the credentials as the AWS SDKs do before any request.

Configuration is the standard AWS chain as the client reads it (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``/``AWS_REGION``), plus the
operation's ``storage_options`` (CLI ``--storage-option key=value``). An ``http://`` endpoint is allowed
because its URL says so. zckpt's own keys: ``in_flight`` (default 8), ``part_bytes`` (default 8 MiB),
``window_bytes`` (default 32 MiB), ``max_retries`` (default 10), ``retry_timeout`` (seconds, default 180),
``connect_timeout`` (seconds, default 2).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator, Sequence

from zckpt.storage.objstore import paths, read, write
from zckpt.storage.objstore.ahead import MAX_WINDOWS
from zckpt.storage.objstore.client import (
    SCHEMES,
    ObjectStore,
    Url,
    bound,
    current,
    error,
    is_url,
    parse,
    parse_options,
)
from zckpt.storage.objstore.paths import RemotePath
from zckpt.storage.objstore.read import BLOCK, CACHE_BLOCKS, RemoteFile

# -- the running operation's ObjectStore ---------------------------------------------------------------


def size(x: object) -> int:
    """The object's size in bytes."""
    return paths.size(current(), x)


def kind(x: object) -> str | None:
    """``"file"``, ``"dir"`` or None (nothing there)."""
    return paths.kind(current(), x)


def read_into(x: object, offset: int, out: memoryview, limit: int | None = None) -> None:
    read.read_into(current(), x, offset, out, limit)


def expect(x: object, offset: int, limit: int) -> None:
    read.expect(current(), x, offset, limit)


def prefetch(x: object, spans: list[tuple[int, int]]) -> None:
    read.prefetch(current(), x, spans)


def prefetch_ends(xs: Sequence[object]) -> None:
    read.prefetch_ends(current(), xs)


@contextlib.contextmanager
def cache_room(nbytes: int) -> Iterator[None]:
    with read.cache_room(current(), nbytes):
        yield


def open_read(x: object) -> io.BufferedReader:
    return read.open_read(current(), x)


def upload(x: object) -> write.Upload:
    """A multipart ``Upload`` of ``x`` (see ``write.Upload``)."""
    return write.Upload(current(), x)


def upload_file(local: str | os.PathLike[str], x: object, *, create: bool = False) -> None:
    write.upload_file(current(), local, x, create=create)


def delete(urls: list[str]) -> None:
    write.delete(current(), urls)


def list_keys(x: object, *, recursive: bool = True) -> list[str]:
    return write.list_keys(current(), x, recursive=recursive)


def put_bytes(x: object, data: bytes) -> None:
    write.put_bytes(current(), x, data)


def stats() -> dict[str, int]:
    """Requests made, bytes fetched and uploaded, retries, by the running operation's ``ObjectStore``."""
    return current().stats()


__all__ = [
    "BLOCK",
    "CACHE_BLOCKS",
    "MAX_WINDOWS",
    "SCHEMES",
    "ObjectStore",
    "RemoteFile",
    "RemotePath",
    "Url",
    "bound",
    "cache_room",
    "current",
    "delete",
    "error",
    "expect",
    "is_url",
    "kind",
    "list_keys",
    "open_read",
    "parse",
    "parse_options",
    "prefetch",
    "prefetch_ends",
    "put_bytes",
    "read_into",
    "size",
    "stats",
    "upload",
    "upload_file",
]
