"""Checksums verified while tensor bytes stream through: a flipped bit in a checkpoint becomes an error, not a
wrong weight in the output.

Formats that record a checksum over stored bytes attach it to their pieces (``Piece.check``): a zip record's
CRC-32 (DeepSpeed rank files, torch ``.bin``/``.pt`` files, DCP chunk archives), each block's CRC-32 (a
``<file>.crc32.json`` sidecar: a record per block) or sha256 (a ``.sha256.json`` sidecar, a native manifest's
block digests), or a whole file's sha256 (a ``<file>.sha256`` sidecar, an older native manifest). Inside a
``session`` every read of such bytes (``zckpt.stream.spans``, ``zckpt.stream.pipeline``) reports them here. A
record's CRC is computed from the bytes the operation reads anyway (``crc32``: ISA-L's where installed, else
zlib's), out-of-order pieces combined (``crc32_combine``), on the thread that read them, while the bytes are
still in its cache (CRC threads of their own cost ``diff`` more than they saved at 16 cores: RESULTS "14:44").
Bytes a caller found equal at several places (``consumed_same``: ``diff``'s bit-identical chunks) are CRC'd
once for all of them. A file's sha256 is fed in file order: bytes that arrive ahead of the hash are held (up
to ``HOLD_BYTES`` per file) or the gap before them is read from disk, so a file read in order is hashed from
the bytes already read plus its header.
``Session.finish`` reads what the operation did not need of each touched record or file (padding, headers, the
tail), then compares. Records no read touched are not checked (``verify`` checks every byte of every file).
Operations call ``finish`` before they publish anything. A session belongs to the operation that opened it
(a ``contextvars`` binding, carried into the threads it starts by ``zckpt.storage.threads``), never to the
process: two operations in two threads each check their own reads.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from zlib import crc32 as _zlib_crc32

from zckpt.errors import CorruptCheckpoint
from zckpt.model import Checked, Piece
from zckpt.storage import fileio

if TYPE_CHECKING:  # imported where pieces are read into tensors: opening a checkpoint needs none
    import numpy as np
    import torch

_BUF = 8 << 20
HOLD_BYTES = 64 << 20
"""Bytes of one file held while they wait for the sha256 to reach them; beyond, the gap is read."""
GAP_READ = 4 << 20
"""A gap this small (a safetensors header, padding) is read from disk at once rather than waited for."""


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


def py_crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's algorithm, in Python:
    ~2 ms a call, the fallback where ISA-L's C one is missing)."""
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


crc32: Callable[..., int]
crc32_combine: Callable[[int, int, int], int]
try:  # ISA-L's CRC-32 (same polynomial as zlib's) and its combine, in C: several times faster than zlib's
    from isal.isal_zlib import crc32, crc32_combine
except ImportError:  # pragma: no cover - platforms without an isal wheel
    crc32, crc32_combine = _zlib_crc32, py_crc32_combine


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


class _Digest:
    """A whole file's sha256, fed in order (see the module doc): bytes are hashed before ``add`` returns, held
    while they wait for the hash to reach them, or the gap before them read from disk."""

    def __init__(self, check: Checked) -> None:
        self.check = check
        self.sha = hashlib.sha256()
        self.at = 0
        self.held: dict[int, bytes] = {}
        self.held_bytes = 0
        self.lock = threading.Lock()

    def add(self, lo: int, data: memoryview) -> None:
        with self.lock:
            hi = lo + len(data)
            if hi <= self.at:
                return  # read twice: already hashed
            if lo > self.at:
                gap = lo - self.at
                if gap > GAP_READ and self.held_bytes + len(data) <= HOLD_BYTES:
                    if lo not in self.held or len(self.held[lo]) < len(data):
                        self.held_bytes += len(data) - len(self.held.get(lo, b""))
                        self.held[lo] = bytes(data)
                    return
                self._advance(lo)
            self.sha.update(data[self.at - lo :])
            self.at = hi
            self._advance(None)

    def _advance(self, to: int | None) -> None:
        """Hash held bytes that now continue the hash, then (``to`` given) read from disk up to ``to``."""
        while True:
            for start in sorted(self.held):
                if start > self.at:
                    break
                blob = self.held.pop(start)
                self.held_bytes -= len(blob)
                if start + len(blob) > self.at:
                    self.sha.update(memoryview(blob)[self.at - start :])
                    self.at = start + len(blob)
            if to is None or self.at >= to:
                return
            nxt = min([s for s in self.held if s > self.at] + [to])
            step = min(_BUF, nxt - self.at)
            import numpy as np  # the read path's buffers (imported by the reads that got here)

            buf = np.empty(step, dtype=np.uint8)
            fileio.read_into(self.check.file, self.check.start + self.at, buf)
            self.sha.update(buf.data)
            self.at += step

    def finish(self) -> None:
        with self.lock:
            self._advance(self.check.size)
            got = self.sha.hexdigest()
        if got != self.check.sha256:
            raise CorruptCheckpoint(
                f"{self.check.file}: does not match the sha256 in its {self.check.what} (recorded "
                f"{str(self.check.sha256)[:12]}..., read {got[:12]}...); the file changed after the save",
                hint="restore the file from a good copy, or pass --no-verify-data to read it anyway",
                path=self.check.file,
            )


def _segments(check: Checked, lo: int, n: int) -> Iterator[tuple[Checked, int, int, int]]:
    """The records that bytes ``[lo, lo + n)`` of ``check``'s range fall in: ``(record, offset in it, start,
    end)``, start and end counted from ``lo`` (each block of a block-digest file is a record of its own)."""
    if not check.blocks:
        yield check, lo, 0, n
        return
    pos, end, b = lo, lo + n, check.block
    while pos < end:
        i = pos // b
        stop = min(end, (i + 1) * b)
        yield _block(check, i), pos - i * b, pos - lo, stop - lo
        pos = stop


@functools.lru_cache(maxsize=4096)
def _block(check: Checked, i: int) -> Checked:
    """Block ``i`` of a file checked by block digests, as a range checked by its own CRC-32 (a record, its
    reads combined in any order) or sha256 (a stream, fed in order)."""
    lo = i * check.block
    n = min(check.block, check.size - lo)
    what = f"{check.what} (bytes [{lo}, {lo + n}), block {i})"
    if check.algorithm == "crc32":
        return Checked(check.file, check.start + lo, n, int(check.blocks[i], 16), what)
    return Checked(check.file, check.start + lo, n, None, what, sha256=check.blocks[i])


class Session:
    """The checksums of one operation's reads (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[Checked, _Record] = {}
        self._digests: dict[Checked, _Digest] = {}

    def consumed(self, check: Checked, byte_offset: int, data: memoryview) -> None:
        """``data`` was read from ``check.file`` at ``byte_offset`` (inside the record)."""
        self.consumed_same(((check, byte_offset),), data)

    def consumed_same(self, places: Sequence[tuple[Checked, int]], data: memoryview) -> None:
        """``data`` was read at each ``(check, byte_offset)`` of ``places``: the same bytes at several places,
        found equal byte for byte by the caller (``diff``'s bit-identical chunks). Each piece of ``data``
        between the places' block or record boundaries is CRC'd once and credited to every place; a place
        checked by a sha256 is fed the bytes (a hash stream has no shortcut)."""
        crcs: list[tuple[Checked, int, int, int]] = []  # (record, offset in it, start in data, end in data)
        for check, byte_offset in places:
            lo = byte_offset - check.start
            if lo < 0 or lo + len(data) > check.size or not len(data):
                continue
            for rec, at, a, z in _segments(check, lo, len(data)):
                if rec.sha256 is not None:
                    self._digest(rec).add(at, data[a:z])
                else:
                    crcs.append((rec, at, a, z))
        if crcs:  # each piece between the cuts CRC'd once, added to each record it lies in
            cuts = sorted({c for _, _, a, z in crcs for c in (a, z)})
            piece = {a: crc32(data[a:z]) for a, z in itertools.pairwise(cuts)}  # each byte CRC'd once
            with self._lock:
                for rec, at, a, z in crcs:
                    record = self._records.setdefault(rec, _Record())
                    for p, q in itertools.pairwise(cuts[cuts.index(a) : cuts.index(z) + 1]):
                        record.add(at + p - a, at + q - a, piece[p])

    def _digest(self, check: Checked) -> _Digest:
        with self._lock:
            return self._digests.get(check) or self._digests.setdefault(check, _Digest(check))

    def finish(self) -> None:
        """Read what no read covered of each touched record, then compare every record's CRC-32."""
        with self._lock:
            todo = list(self._records.items())
            digests = list(self._digests.values())
        for d in digests:
            d.finish()
        import numpy as np

        for check, rec in todo:
            for lo, hi in _gaps(rec, check.size):
                for a in range(lo, hi, _BUF):
                    buf = np.empty(min(_BUF, hi - a), dtype=np.uint8)
                    fileio.read_into(check.file, check.start + a, buf)
                    rec.add(a, a + buf.size, crc32(buf.data))
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


_ACTIVE: contextvars.ContextVar[Session | None] = contextvars.ContextVar("zckpt_checks", default=None)
"""The session of the operation running in this thread or task (and in the threads it starts:
``zckpt.storage.threads`` carries the context), as ``zckpt.storage.session`` binds its ``Storage``: two
operations in two threads each check their own reads."""


@contextlib.contextmanager
def session(enabled: bool = True) -> Iterator[Session | None]:
    """Verify the checksums of every checked byte read inside the block (``finish`` is the caller's, before
    it publishes). Disabled: a no-op."""
    if not enabled:
        yield None
        return
    s = Session()
    token = _ACTIVE.set(s)
    try:
        yield s
    finally:
        _ACTIVE.reset(token)


def consumed(check: Checked | None, byte_offset: int, data: torch.Tensor | np.ndarray | memoryview) -> None:
    """Report bytes just read (a no-op outside a session or for bytes without a checksum)."""
    s = _ACTIVE.get()
    if s is None or check is None:
        return
    buf: Any = data
    if isinstance(buf, memoryview):
        mv = buf
    elif type(buf).__module__ == "numpy":  # the torch-free write path's buffers (``zckpt.stream.fill``)
        mv = buf.data
    else:
        import torch

        mv = memoryview(buf.contiguous().view(torch.uint8).numpy())
    s.consumed(check, byte_offset, mv.cast("B"))


def consumed_same(places: Sequence[tuple[Checked | None, int]], data: memoryview) -> None:
    """Report bytes just read at several places that the caller found equal byte for byte (``Session.
    consumed_same``: their CRC is computed once; places without a checksum are skipped, as by
    ``consumed``)."""
    s = _ACTIVE.get()
    todo = [(c, at) for c, at in places if c is not None]
    if s is not None and todo:
        s.consumed_same(todo, data.cast("B"))


@contextlib.contextmanager
def verifying(enabled: bool = True) -> Iterator[None]:
    """A ``session`` whose checksums are compared (``finish``) when the block ends without an error: wrap
    the reads of a step that must not publish damaged bytes."""
    with session(enabled) as s:
        yield
        if s is not None:
            s.finish()


def record_end(piece: Piece) -> int | None:
    """The end of the checksummed record (a zip record, a file with a recorded sha256) that ``piece`` lies
    in: how far a reader of the piece goes on reading, so an object store may fetch ahead up to it (never
    past it: the bytes after a record are often ones the job does not need, such as Adam moments)."""
    c = piece.check
    if c is None or c.file != piece.file:
        return None
    return c.start + c.size
