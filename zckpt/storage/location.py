"""Where an input or output is: ``Location``, a local ``Path`` or an object-store ``RemotePath``, said in the
type of every function that may be given either; ``location`` makes one of a user's string, ``absolute``
and ``resolved`` are ``os.path.abspath`` and ``Path.resolve`` of a local one, ``size`` its byte count.
Code that only works on the local disk takes ``Path``, and ``local`` is its boundary: a URL is refused there
in one line (``Unsupported``), never handed to ``open`` or ``os`` as a local name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeAlias

from zckpt.errors import Unsupported
from zckpt.storage.objstore.client import parse
from zckpt.storage.objstore.paths import RemotePath

Location: TypeAlias = Path | RemotePath
"""A local path or a location in an object store: what the formats' readers and writers take."""

LocationLike: TypeAlias = str | os.PathLike[str] | RemotePath
"""What names a ``Location``: a user's string (``s3://...`` or a local path), a ``Path``, a ``RemotePath``."""


def location(x: LocationLike) -> Location:
    """A ``RemotePath`` for a URL (or the ``s3:/`` a ``pathlib.Path`` made of one), else a local ``Path``."""
    if isinstance(x, RemotePath):
        return x
    u = parse(x)
    return Path(x) if u is None else RemotePath.of(u)


def absolute(x: LocationLike) -> Location:
    """``Path(os.path.abspath(x))`` for a local path; a URL is absolute already."""
    p = location(x)
    return p if isinstance(p, RemotePath) else Path(os.path.abspath(p))


def resolved(x: Location) -> Location:
    """``Path.resolve()`` of a local path (symbolic links followed); a URL as it is (a store has none)."""
    return x if isinstance(x, RemotePath) else x.resolve()


def ordered(xs: Iterable[Location], key: Callable[[Location], Any] | None = None) -> list[Location]:
    """``sorted`` for locations (of one kind, as ``x.iterdir()`` or ``x.glob(...)`` gives): by their parts,
    as ``Path`` sorts, or by ``key``."""
    return sorted(xs, key=key if key is not None else lambda x: str(x).split("/"))


def lexists(x: Location) -> bool:
    """``os.path.lexists``: something is there, a dangling symbolic link included (a store has none)."""
    return x.exists() if isinstance(x, RemotePath) else os.path.lexists(x)


def size(x: Location) -> int:
    """The byte count of a file or object."""
    return x.size() if isinstance(x, RemotePath) else x.stat().st_size


def local(x: LocationLike, what: str, hint: str = "give a local path") -> Path:
    """``x`` as a ``Path`` for code that reads or writes the local disk only (``what`` names it); a URL is
    refused in one line naming it (``Unsupported``), before anything is read or written."""
    p = location(x)
    if isinstance(p, RemotePath):
        raise Unsupported(f"{p}: {what} takes a local path, not an {p.scheme}:// URL", hint=hint, path=str(p))
    return p
