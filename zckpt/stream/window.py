"""``Window``: a read-only, seekable file over a byte range of an open descriptor, for parsing an archive
embedded in a larger file (a DCP chunk archive) with ``zipfile`` without copying it out."""

from __future__ import annotations

import io
from typing import Any

from zckpt.storage import fileio

_EDGE = 16 << 10
"""Bytes of an embedded archive's head and tail a ``Window`` reads at once: a tensor archive's pickle, small
records and local headers lie in the first, its central directory and end records in the last, so parsing it
costs two reads instead of a dozen (a DCP checkpoint has thousands of chunk archives)."""


class Window(io.RawIOBase):
    """Read-only, seekable file over bytes ``[offset, offset + length)`` of the open file ``fd`` (a
    ``fileio.Handle``; reads are ``pread``: several windows may share one handle). The first and last
    ``_EDGE`` bytes (all of a window up to twice that) are read once, at the first read that needs them, and
    served from memory after that."""

    def __init__(self, fd: fileio.Handle, offset: int, length: int) -> None:
        super().__init__()
        self.fd, self.base, self.length, self.pos = fd, offset, length, 0
        self._edges: list[tuple[int, bytes]] = []  # (window offset, bytes) read so far

    def pread(self, n: int, at: int) -> bytes:
        """Up to ``n`` bytes at window offset ``at`` (fewer at the end of the window)."""
        n = max(0, min(n, self.length - at))
        if not n:
            return b""
        for lo, data in self._edges:
            if lo <= at and at + n <= lo + len(data):
                return data[at - lo : at + n - lo]
        if not self._edges and self.length <= 2 * _EDGE:  # a small archive: all of it in one read
            self._edges.append((0, fileio.pread(self.fd, self.length, self.base)))
            return self._edges[0][1][at : at + n]
        if n <= _EDGE and len(self._edges) < 2:
            lo = 0 if at + n <= _EDGE else max(0, self.length - _EDGE)
            if lo <= at and at + n <= lo + min(_EDGE, self.length - lo):
                data = fileio.pread(self.fd, min(_EDGE, self.length - lo), self.base + lo)
                self._edges.append((lo, data))
                return data[at - lo : at + n - lo]
        return fileio.pread(self.fd, n, self.base + at)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, pos if whence == 0 else (self.pos + pos if whence == 1 else self.length + pos))
        return self.pos

    def readinto(self, b: Any) -> int:
        data = self.pread(len(b), self.pos)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)
