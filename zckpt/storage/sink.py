"""``HashingSink``: the one way an output file is written.

A write-only, non-seekable file wrapper that computes the digest of every byte written
(``zckpt.storage.digest``: the whole file's sha256, or with ``block`` one per block, on several threads) and
makes the file durable: at ``close()`` (fsync), or, inside an active ``zckpt.storage.staging.Staging`` folder
of this process, at that folder's ``commit()``, which fsyncs every staged file at once before anything is
renamed. A whole-file digest can become a sidecar ``F.sha256`` in ``sha256sum`` format (``<hex>  <name>``).
The bytes go to the device with ``O_DIRECT`` where the filesystem allows (``zckpt.storage.direct_io``, tuned
by ``WriteOptions``), not through the page cache. A data file of an ``s3://`` output's staging folder
(``zckpt.storage.remote_staging.streamed``) is not written locally: its bytes stream to the object as a
multipart upload that completes at ``close()``.

``write(b, stable=True)`` is for callers whose bytes stay unchanged until ``close()`` (a snapshot): the
hash is queued on the hash threads without waiting and aligned memory goes to the device without a copy,
so hashing and device writes run side by side over the whole file, not chunk by chunk. ``reserve()`` /
``commit(n)`` let a filler read the file's next bytes straight into the device buffer, and ``fill_ring()``
keeps ``zckpt.stream.pipeline.fill``'s buffers (``FillRing``) across records. ``stats()``: where the time
went.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from zckpt.storage import direct_io, interrupts, objstore, remote_staging, scan, session
from zckpt.storage.digest import FileDigest, StreamHasher, lanes, write_block_sidecar

_OVERLAP_BYTES = 1 << 20
"""Writes at least this large hash on a helper thread concurrently with the file write (both release
the GIL, so the sha256 costs no wall time on a machine with a spare core)."""


def defer_fsync(folder: Path) -> None:
    """Files the running operation creates under ``folder`` from now on are fsynced by whoever publishes it,
    not at close (``Storage.deferred``; outside an operation, nothing is deferred)."""
    st = session.bound_storage()
    if st is not None:
        with st.lock:
            st.deferred.add(folder)


def undefer_fsync(folder: Path) -> None:
    st = session.bound_storage()
    if st is not None:
        with st.lock:
            st.deferred.discard(folder)


def _fsync_deferred(path: Path) -> bool:
    """``path`` lies in a staging folder of the running operation whose ``commit()`` will fsync it."""
    st = session.bound_storage()
    if st is None:
        return False
    with st.lock:
        return any(d in path.parents for d in st.deferred)


class FillRing:
    """A file's reusable fill buffers (page-aligned, ``piece`` bytes each, at most ``cap``) and, per buffer,
    the writes and hashes still reading it: ``take`` hands out the least recently used one once they end."""

    def __init__(self) -> None:
        self.bufs: list[memoryview] = []
        self._busy: list[list[Future[None]]] = []
        self._next = 0

    def take(self, cap: int, nbytes: int) -> int:
        """The index of a free buffer of ``nbytes`` (a new one while fewer than ``cap`` exist)."""
        if self.bufs and len(self.bufs[0]) != nbytes:
            self.wait()
            self.bufs, self._busy, self._next = [], [], 0
        if len(self.bufs) < cap and self._next == len(self.bufs):
            self.bufs.append(memoryview(direct_io.aligned_buffer(nbytes)))
            self._busy.append([])
        i = self._next % len(self.bufs)
        self._next = i + 1
        for w in self._busy[i]:
            w.result()
        self._busy[i] = []
        return i

    def busy(self, i: int, waits: list[Future[None]]) -> None:
        """Buffer ``i`` is read by ``waits`` until they end."""
        self._busy[i] = waits

    def wait(self) -> None:
        for ws in self._busy:
            for w in ws:
                w.result()

    def release(self) -> None:
        self.bufs, self._busy, self._next = [], [], 0


class HashingSink(io.RawIOBase):
    """Write-only, non-seekable file that hashes what it writes, is fsynced at close (or at its staging
    folder's commit) and writes the sidecar. ``size``: the file's final size, when the writer knows it, is
    allocated at open (``direct_io.preallocate``: a full disk fails before the first byte)."""

    def __init__(
        self,
        path: Path,
        opts: direct_io.WriteOptions | None = None,
        crc_regions: Sequence[tuple[int, int]] = (),
        block: int | None = None,
        algorithm: str = "crc32",
        size: int | None = None,
    ) -> None:
        super().__init__()
        self.path = path
        self._size = size
        """The file's final size when the writer knows it up front: allocated at open (``preallocate``)."""
        self._hasher = StreamHasher(block, crc_regions, algorithm)
        """The file's digest (whole, or per ``block`` bytes) and the CRC-32 of each ``crc_regions`` range."""
        self._url = remote_staging.streamed(path)
        """The object this file stands for, streamed there (a data file of an ``s3://`` output)."""
        self._aborted = False
        self._durable_now = self._url is None and not _fsync_deferred(Path(os.path.abspath(path)))
        self._f: Any = None
        self._f = open(path, "xb") if self._url is None else objstore.upload(self._url)  # noqa: SIM115
        self._allocated = False
        if self._url is None and size:
            try:  # a full disk fails here, before a byte is written
                self._allocated = direct_io.preallocate(self._f.fileno(), size)
            except BaseException:
                self._f.close()
                raise
        self._direct: direct_io.DirectWriter | None = None
        self._pos = 0
        if opts is None:  # block digests: a buffer per hash lane, so blocks hash side by side while written;
            # files written side by side (``scan.sharing``) keep two each: together they fill the device
            one = block is None or scan.sharing() > 1
            opts = direct_io.WriteOptions(buffers=2 if one else lanes() + 2)
        self._opts = opts
        if self._url is None and opts.direct and direct_io.enabled():
            try:
                self._direct = direct_io.DirectWriter(str(path), self._f.fileno(), opts, self._hasher.queue)
            except OSError:  # no O_DIRECT on this filesystem: plain buffered writes
                self._direct = None
        self._hashing: list[Future[None]] = []  # queued hashes of stable writes
        self._ring = FillRing()  # ``fill_ring``
        self._scratch: memoryview | None = None  # ``reserve`` without O_DIRECT
        self._t_open = time.perf_counter()
        self._fsync_s = 0.0
        self._wall_s = 0.0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, b: object, stable: bool = False) -> int:
        """Append ``b``. ``stable``: ``b`` stays unchanged until ``close()`` (see the module doc)."""
        mv = memoryview(b).cast("B")  # type: ignore[arg-type]
        if self._direct is not None:  # it hands every byte to the hash threads itself (``_hasher.queue``)
            self._direct.write(mv, stable)
        elif len(mv) >= _OVERLAP_BYTES:  # hash on a helper thread while the bytes go to the file
            done = self._hasher.queue(mv)
            if stable:  # the hash thread runs on through the queue; close() waits for it
                self._hashing.append(done)
                self._put(mv)
            else:
                try:
                    self._put(mv)
                finally:
                    done.result()
        else:
            self._put(mv)
            self._hasher.update(mv)
        self._pos += len(mv)
        return len(mv)

    def write_owned(self, mv: memoryview) -> list[Future[None]]:
        """Append ``mv`` (memory of the caller's that it reuses later, such as
        ``zckpt.stream.pipeline.fill``'s buffers): page-aligned memory at an aligned offset goes to the
        device from where it lies, hashed meanwhile; returns what must finish before ``mv`` may change
        (empty: its bytes were copied)."""
        if self._direct is None:
            self.write(mv)
            return []
        busy = self._direct.write_owned(mv)
        self._pos += len(mv)
        return busy

    @property
    def piece_bytes(self) -> int:
        """The size of the pieces ``write_owned`` writes best: a device write."""
        return self._opts.buf_bytes

    @property
    def head_room(self) -> int:
        """Bytes that complete the device buffer being filled (0: the next byte starts a fresh one)."""
        return self._direct.head_room if self._direct is not None else 0

    @property
    def in_flight(self) -> int:
        """Device writes this file keeps outstanding."""
        return self._direct.opts.in_flight if self._direct is not None else 1

    def fill_ring(self) -> FillRing:
        """The page-aligned buffers ``zckpt.stream.pipeline.fill`` fills for ``write_owned``, kept until
        ``close()`` with what still reads each: one ring serves every fill of the file, so a record's end
        never waits for its own writes."""
        return self._ring

    def reserve(self) -> memoryview:
        """Memory for the file's next bytes (at least one byte): fill it, then ``commit`` how many. With
        ``O_DIRECT`` it is the free rest of the device buffer being filled (no copy); else a scratch
        buffer that ``commit`` writes."""
        if self._direct is not None:
            return self._direct.reserve()
        if self._scratch is None:
            self._scratch = memoryview(bytearray(self._opts.buf_bytes))
        return self._scratch

    def commit(self, n: int) -> None:
        """``n`` bytes of the last ``reserve`` are the file's next bytes."""
        if self._direct is None:
            assert self._scratch is not None
            self.write(self._scratch[:n])
            return
        self._direct.commit(n)
        self._pos += n

    @property
    def crcs(self) -> list[int]:
        """The CRC-32 of each ``crc_regions`` range (valid after ``close()``)."""
        return self._hasher.crcs

    def _flush_hashes(self) -> None:
        """Wait for the queued hashes of stable writes (at close)."""
        while self._hashing:
            self._hashing.pop(0).result()

    def _put(self, mv: memoryview) -> None:
        self._f.write(mv)

    def stats(self) -> dict[str, Any]:
        """Where the time of this file went (valid after ``close()``): bytes, wall seconds from open to
        closed, seconds spent hashing, in device writes (summed over writer threads) and in fsync."""
        return {
            "bytes": self._pos,
            "wall_s": round(self._wall_s, 4),
            "hash_s": round(self._hasher.busy_s, 4),
            "device_write_s": round(self._direct.busy_s, 4) if self._direct is not None else None,
            "fsync_s": round(self._fsync_s, 4),
            "direct": self._direct is not None and self._direct._direct,
            "copied_bytes": self._direct.copied if self._direct is not None else self._pos,
        }

    def tell(self) -> int:
        return self._pos

    def seek(self, *args: object) -> int:
        raise io.UnsupportedOperation("HashingSink is write-only and sequential")

    def digest(self) -> FileDigest:
        """What was written: its sha256, whole or per block (valid after ``close()``)."""
        return self._hasher.digest()

    def hexdigest(self) -> str:
        """The whole file's sha256 (a sink made without ``block``)."""
        d = self._hasher.digest()
        assert d.sha256 is not None, "a block digest has no single hex digest"
        return d.sha256

    def close(self) -> None:
        try:
            if not self.closed and not self._f.closed:
                try:
                    if self._direct is not None:
                        self._direct.close()
                    self._flush_hashes()
                    self._f.flush()
                    if self._allocated and self._pos != self._size:  # never zeros past what was written
                        os.ftruncate(self._f.fileno(), self._pos)
                    if self._durable_now:
                        t0 = time.perf_counter()
                        os.fsync(self._f.fileno())
                        self._fsync_s = time.perf_counter() - t0
                finally:  # a failed flush (disk full) must still release the file
                    if self._url is None:
                        self._f.close()
                    else:  # an object appears only when its whole file was written, its output still wanted
                        # Ctrl-C waits while it lands and is noted (an abort then deletes it)
                        with remote_staging.completing(self.path) as wanted, interrupts.held():
                            if self._aborted or not wanted:
                                self._f.abort()
                            else:
                                self._f.close()
                                remote_staging.record(self.path, self._url)
                    self._hasher.close()  # waits for queued hashes, even after an error
                    self._hashing.clear()
                    self._ring.release()
                    self._scratch = None
                    self._wall_s = time.perf_counter() - self._t_open
        finally:
            super().close()

    def abort(self) -> None:
        """Give the file up (an error while writing it): an object's upload is aborted, nothing appears; a
        local file is released (its staging folder's removal deletes it). Never raises for the file itself."""
        self._aborted = True
        with contextlib.suppress(Exception):
            self.close()

    def __exit__(self, et: object, ev: object, tb: object) -> None:
        if ev is not None:
            self.abort()
        else:
            self.close()

    def __del__(self) -> None:
        """A sink dropped unclosed (an error path) is released without flushing, fsyncing or waiting on its
        threads: the garbage collector may run this after the pools' worker threads have exited, when
        ``close()`` would wait forever on work none of them will do."""
        if self.closed:
            return
        with contextlib.suppress(Exception):
            self._hasher.close(wait=False)
            if self._direct is not None:
                self._direct.drop()
            getattr(self._f, "abort", self._f.close)()  # an upload dropped unclosed is aborted
        io.RawIOBase.close(self)

    def write_sidecar(self) -> Path:
        """Write the sidecar next to the file (call after ``close()``): ``<file>.crc32.json`` for a sink
        made with ``block`` (``zckpt.storage.digest.write_block_sidecar``), else ``<file>.sha256``
        (``sha256sum`` format)."""
        d = self._hasher.digest()
        if d.sha256 is None:
            return write_block_sidecar(self.path, d, self._pos, durable=self._durable_now)
        side = self.path.with_name(self.path.name + ".sha256")
        with open(side, "x") as f:
            f.write(f"{self.hexdigest()}  {self.path.name}\n")
            f.flush()
            if self._durable_now:
                os.fsync(f.fileno())
        return side
