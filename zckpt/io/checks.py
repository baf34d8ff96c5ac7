"""Checksums verified while tensor bytes stream through: a flipped bit in a checkpoint becomes an error, not a
wrong weight in the output.

Formats that record a checksum over stored bytes attach it to their pieces (``Piece.check``: a zip record's
CRC-32 for DeepSpeed rank files, torch ``.bin``/``.pt`` files and DCP chunk archives). Inside a ``session``
every read of such bytes (``zckpt.io.spans``, ``zckpt.io.pipeline``) reports them here: each record's CRC
is computed from the bytes the operation reads anyway (``crc32``: ISA-L's where installed, else zlib's),
out-of-order pieces combined (``crc32_combine``), and ``Session.finish`` reads the parts of each touched
record the operation did not need (padding), then compares. Records no read touched are not checked
(``verify`` checks every byte of every file). Operations call ``finish`` before they publish anything.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

try:  # ISA-L's CRC-32 (same polynomial as zlib's) runs several times faster where it is installed
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - platforms without an isal wheel
    from zlib import crc32

from zckpt.errors import CorruptCheckpoint
from zckpt.io import storage
from zckpt.model import Checked

_BUF = 8 << 20


def _gf2_times(mat: list[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's algorithm)."""
    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]
    even = _gf2_square(odd)
    odd = _gf2_square(even)
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


@dataclass
class _Record:
    """What has been read of one checked record: disjoint segments ``start -> (end, crc)``."""

    segments: dict[int, tuple[int, int]] = field(default_factory=dict)

    def add(self, lo: int, hi: int, crc: int) -> None:
        for start, (end, _) in self.segments.items():
            if lo < end and start < hi:  # read twice (diff re-reads equal chunks): already counted
                return
        nxt = self.segments.pop(hi, None)
        if nxt is not None:  # [lo, hi) + [hi, end)
            crc, hi = crc32_combine(crc, nxt[1], nxt[0] - hi), nxt[0]
        prev = next((s for s, (e, _) in self.segments.items() if e == lo), None)
        if prev is not None:  # [prev, lo) + [lo, hi)
            _, pcrc = self.segments.pop(prev)
            crc, lo = crc32_combine(pcrc, crc, hi - lo), prev
        self.segments[lo] = (hi, crc)


class Session:
    """The checksums of one operation's reads (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[Checked, _Record] = {}

    def consumed(self, check: Checked, byte_offset: int, data: memoryview) -> None:
        """``data`` was read from ``check.file`` at ``byte_offset`` (inside the record)."""
        lo = byte_offset - check.start
        if lo < 0 or lo + len(data) > check.size or not len(data):
            return
        crc = crc32(data)
        with self._lock:
            self._records.setdefault(check, _Record()).add(lo, lo + len(data), crc)

    def finish(self) -> None:
        """Read what no read covered of each touched record, then compare every record's CRC-32."""
        with self._lock:
            todo = list(self._records.items())
        for check, rec in todo:
            for lo, hi in _gaps(rec, check.size):
                for a in range(lo, hi, _BUF):
                    buf = torch.empty(min(_BUF, hi - a), dtype=torch.uint8)
                    storage.read_into(check.file, check.start + a, buf)
                    rec.add(a, a + buf.numel(), crc32(buf.numpy().tobytes()))
            got = rec.segments.get(0, (0, 0))[1]
            if got != check.crc32:
                raise CorruptCheckpoint(
                    f"{check.file}: {check.what} fails its CRC-32 check (stored {check.crc32:08x}, read "
                    f"{got:08x}); the bytes were damaged after the save",
                    hint="restore the file from a good copy; `zckpt verify` lists every damaged file",
                    path=check.file,
                )


def _gaps(rec: _Record, size: int) -> Iterator[tuple[int, int]]:
    at = 0
    for start, (end, _) in sorted(rec.segments.items()):
        if start > at:
            yield at, start
        at = max(at, end)
    if at < size:
        yield at, size


_active: Session | None = None
_active_lock = threading.Lock()


@contextlib.contextmanager
def session(enabled: bool = True) -> Iterator[Session | None]:
    """Verify the checksums of every checked byte read inside the block (``finish`` is the caller's, before
    it publishes). Disabled: a no-op."""
    global _active
    if not enabled:
        yield None
        return
    s = Session()
    with _active_lock:
        outer, _active = _active, s
    try:
        yield s
    finally:
        with _active_lock:
            _active = outer


def consumed(check: Checked | None, byte_offset: int, data: torch.Tensor | memoryview) -> None:
    """Report bytes just read (a no-op outside a session or for bytes without a checksum)."""
    s = _active
    if s is None or check is None:
        return
    mv = data if isinstance(data, memoryview) else memoryview(data.contiguous().view(torch.uint8).numpy())  # type: ignore[arg-type]
    s.consumed(check, byte_offset, mv.cast("B"))


@contextlib.contextmanager
def verifying(enabled: bool = True) -> Iterator[None]:
    """A ``session`` whose checksums are compared (``finish``) when the block ends without an error: wrap
    the reads of a step that must not publish damaged bytes."""
    with session(enabled) as s:
        yield
        if s is not None:
            s.finish()
