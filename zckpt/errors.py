"""Typed errors. Every message says what failed, where (file, key, rank) and what to try.

The CLI prints ``str(err)`` on one line and ``hint: ...`` when the error carries a hint; tracebacks
only with ``ZCKPT_DEBUG=1``.

Where a builtin exception means the same thing, the error also subclasses it (as huggingface_hub's
``LocalEntryNotFoundError`` is a ``FileNotFoundError``), so plain ``except`` clauses work: ``MissingKey``
is a ``KeyError`` (``Checkpoint`` is a ``Mapping``: ``ck.get(name, default)``), ``InvalidArgument`` a
``ValueError`` (bad dtype, size, format names), ``PathNotFound`` a ``FileNotFoundError`` and
``PermissionDenied`` (``OutputNotWritable`` for outputs) a ``PermissionError``. Messages stay plain text
(``MissingKey`` does not quote its message as ``KeyError`` does).
"""

from __future__ import annotations


class ZckptError(Exception):
    """Base class of every error zckpt raises on purpose."""

    def __init__(self, message: str, *, hint: str | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint
        self.path = path


class UnknownFormat(ZckptError):
    """No registered format recognises the path."""


class PathNotFound(ZckptError, FileNotFoundError):
    """The path given does not exist (a ``FileNotFoundError``)."""


class CorruptCheckpoint(ZckptError):
    """A file is truncated, malformed or inconsistent with its neighbours."""


class ShardMismatch(CorruptCheckpoint):
    """Rank files missing, extra, stale, or with sizes that disagree with the recorded shapes."""


class UnsafePickle(ZckptError):
    """A pickle asks for a global outside the allowlist; nothing from it was executed."""


class KeyMappingError(ZckptError):
    """A key or key mapping does not fit the checkpoint."""


class MissingKey(KeyMappingError, KeyError):
    """No tensor of that name (a ``KeyError``, as ``Mapping`` lookups raise)."""

    def __str__(self) -> str:
        return Exception.__str__(self)  # KeyError's str() would wrap the message in quotes


class InvalidArgument(ZckptError, ValueError):
    """An argument value zckpt cannot use: a dtype, a size, a format name (a ``ValueError``)."""


class OutputExists(ZckptError):
    """The output path exists and --overwrite was not given."""


class Unsupported(ZckptError):
    """A valid checkpoint using a feature zckpt does not handle (yet)."""


class PermissionDenied(ZckptError, PermissionError):
    """The operating system refused access to a path (a ``PermissionError``)."""


class WriteFailed(ZckptError):
    """Writing an output failed (disk full, file too large, I/O error); its temporary files were removed."""


class OutputNotWritable(WriteFailed, PermissionDenied):
    """The output's folder refuses the write (no permission); nothing was written (a ``PermissionError``)."""


class StorageError(ZckptError):
    """An object store refused or failed a request (no credentials, no such bucket or key, access denied)."""


class ObjectMissing(StorageError, CorruptCheckpoint):
    """No such key (or bucket) in an object store: what a missing file is locally."""
