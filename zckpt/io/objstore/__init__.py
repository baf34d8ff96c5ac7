"""Object storage (``s3://bucket/key``): the one package that talks to a store, through ``obstore``.

``zckpt.io.storage`` and ``zckpt.io.staging`` route here on a URL's scheme (``is_url``); local paths never
reach it. Its modules, each importing only those above it:

- ``client``: URLs, configuration, the client per bucket, errors as one ``StorageError`` line naming the
  URL with a hint, retries, ``stats()``, the shared caches.
- ``paths``: ``RemotePath`` and the listings behind it, ``size``, ``kind``, ``as_path``, ``absolute``.
- ``ahead``: read-ahead streams for sequential readers (a few streamed GETs per record, on their own thread).
- ``read``: ranged reads (``read_into``: parts, read-ahead, the block cache, ``prefetch``), ``RemoteFile``.
- ``write``: ``Upload`` (multipart, visible only when it completes), ``upload_file``, ``put_bytes``,
  ``delete``, ``list_keys``.

Retries: the client retries 5xx, 503 SlowDown and dropped connections with exponential backoff and jitter
(``RetryConfig``); a GET whose body is cut off mid-way is retried here too (``client._retry``).

Configuration is the standard AWS chain as the client reads it (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``/``AWS_REGION``), plus
``configure(storage_options)`` (CLI ``--storage-option key=value``). An ``http://`` endpoint is allowed
because its URL says so. zckpt's own keys: ``in_flight`` (default 8), ``part_bytes`` (default 8 MiB),
``window_bytes`` (default 32 MiB), ``max_retries`` (default 10).
"""

from __future__ import annotations

from zckpt.io.objstore.ahead import MAX_WINDOWS
from zckpt.io.objstore.client import (
    SCHEMES,
    Url,
    configure,
    error,
    in_flight,
    is_url,
    parse,
    parse_options,
    part_bytes,
    reset_stats,
    stats,
)
from zckpt.io.objstore.client import _store as _store  # the benchmark streams through the client itself
from zckpt.io.objstore.paths import RemotePath, absolute, as_path, kind, size
from zckpt.io.objstore.read import (
    BLOCK,
    CACHE_BLOCKS,
    RemoteFile,
    cache_room,
    expect,
    open_read,
    prefetch,
    prefetch_ends,
    read_into,
    window_bytes,
)
from zckpt.io.objstore.write import Upload, delete, list_keys, put_bytes, upload_file

__all__ = [
    "BLOCK",
    "CACHE_BLOCKS",
    "MAX_WINDOWS",
    "SCHEMES",
    "RemoteFile",
    "RemotePath",
    "Upload",
    "Url",
    "absolute",
    "as_path",
    "cache_room",
    "configure",
    "delete",
    "error",
    "expect",
    "in_flight",
    "is_url",
    "kind",
    "list_keys",
    "open_read",
    "parse",
    "parse_options",
    "part_bytes",
    "prefetch",
    "prefetch_ends",
    "put_bytes",
    "read_into",
    "reset_stats",
    "size",
    "stats",
    "upload_file",
    "window_bytes",
]
