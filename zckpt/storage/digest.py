"""File digests, computed off the writer's thread as the bytes stream out: ``FileDigest`` (what is recorded)
and ``StreamHasher`` (what computes it, with the CRC-32s of byte regions on the way); the block sidecars.

A file's digest is the sha256 of the whole file (``sha256``: what ``sha256sum`` prints, ``.sha256``
sidecars) or one checksum per ``block``-byte block (``blocks``, the last one short), of one ``algorithm``:

- ``crc32`` (zlib's CRC-32, ISA-L's code: ~10 GB/s a core, 7x sha256 on the 2-core machine): the block
  sidecar ``<file>.crc32.json`` zckpt writes beside its model files (``write_block_sidecar``; format in
  docs/checksums.md). The sidecar lies next to the file, so whoever can rewrite the file can rewrite it:
  it guards against accidents (bit rot, a partial copy), where a cryptographic hash adds only cost.
- ``sha256``: the native format's rank files (its manifest records them), and the ``<file>.sha256.json``
  sidecars of earlier zckpt versions, still read and checked.

``StreamHasher`` computes block digests (CRC-32 or sha256) on several threads at once: block ``i``'s bytes go
to lane ``i % lanes`` (one thread each, so each block is fed in order) and hashlib and ISA-L release the GIL
while they hash. ``block_digests`` recomputes a file's block digests the same way, for ``verify``.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zckpt.storage import env, fileio, scan
from zckpt.storage.checks import crc32
from zckpt.storage.location import Location
from zckpt.storage.threads import Pool

BLOCK_BYTES = 16 << 20
"""Block size of block digests. Small enough that consecutive write buffers (16-64 MiB) fall in different
blocks, so even copied writes hash on several threads; a 1 TB checkpoint's manifests then list ~60,000
digests (about 4 MB of JSON)."""
_READ = 8 << 20
CRC_SIDECAR = ".crc32.json"
"""The block sidecar zckpt writes: ``<file>.crc32.json``, the CRC-32 of each block (``write_block_sidecar``).
Model files zckpt writes carry one instead of a ``sha256sum`` line: a whole-file sha256 is one stream on one
core (1.1-1.5 GB/s), slower than the disk; a block CRC-32 costs a tenth of reading the bytes."""
CRC_SIDECAR_FORMAT = "zckpt-block-crc32"
CRC_SIDECAR_VERSION = 1
BLOCK_SIDECAR = ".sha256.json"
"""The block sidecar of zckpt before ``.crc32.json``: the sha256 of each block; still read and checked."""
WHOLE_SIDECAR = ".sha256"
"""A ``sha256sum`` line (``<hex>  <name>``): written for small files (``zckpt.storage.sink``), and by
others."""
SIDECARS = (WHOLE_SIDECAR, BLOCK_SIDECAR, CRC_SIDECAR)
"""Every sidecar suffix zckpt reads (and removes with the file it describes)."""
SIDECAR_PATTERN = r"(?:\.sha256|\.sha256\.json|\.crc32\.json)"
"""A regular expression for any of ``SIDECARS`` (for the file-name patterns of outputs)."""
ALGORITHMS = ("crc32", "sha256")
"""Block digest algorithms: ``crc32`` for sidecars, ``sha256`` for native rank files and old sidecars."""


class _Crc32:
    """A CRC-32 with hashlib's ``update``/``hexdigest`` (8 hex digits: ``f"{zlib.crc32(data):08x}"``)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def new_hash(algorithm: str) -> Any:
    """A fresh hash of ``algorithm`` (``ALGORITHMS``)."""
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown block digest algorithm {algorithm!r}")


def lanes() -> int:
    """Threads a block digest is computed on: enough to outrun a fast disk, not the whole machine
    (``ZCKPT_WORKERS`` overrides, ``zckpt.storage.env``); from the cores this process may run on."""
    return env.workers(min(4, env.cores()))


@dataclass(frozen=True)
class FileDigest:
    """A file's digest: the sha256 of the whole file (``sha256``), or the ``algorithm`` digest of each
    ``block``-byte block (``blocks``, hex)."""

    sha256: str | None = None
    block: int = 0
    blocks: tuple[str, ...] = ()
    algorithm: str = "sha256"
    """Of ``blocks``: ``crc32`` or ``sha256`` (``ALGORITHMS``)."""

    def describe(self) -> str:
        if self.sha256 is not None:
            return f"sha256 {self.sha256[:12]}..."
        return f"{len(self.blocks)} block {self.algorithm}s ({self.block >> 20} MiB blocks)"


class StreamHasher:
    """The digest (whole-file sha256 when ``block`` is None, else the ``algorithm`` digest of each block) and
    the CRC-32 of each region ``[begin, end)`` (sorted, disjoint) of a byte stream fed in order through
    ``queue``."""

    def __init__(
        self, block: int | None = None, regions: Sequence[tuple[int, int]] = (), algorithm: str = "crc32"
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown block digest algorithm {algorithm!r}")
        self.block = block
        self.algorithm = algorithm
        self._regions = list(regions)
        self.crcs = [0] * len(self._regions)
        self._region = 0
        self._at = 0  # bytes queued so far
        self._crc_at = 0  # bytes the CRC lane has seen
        self._whole = hashlib.sha256() if block is None else None
        self._blocks: list[Any] = []
        # blocks spread over several threads: on one lane, a CRC-32 was the writer's bottleneck on the
        # 16-core GPU host (its thread busy for 160 of a 3.8 s consolidate's 197 profile samples, 6.2 GB out)
        hashing = 1 if block is None else lanes()
        n = hashing if block is None else hashing + (1 if self._regions else 0)
        self._lanes = [Pool(1, thread_name_prefix="zckpt-hash") for _ in range(n)]
        self._last: list[Future[None] | None] = [None] * n  # each lane's last job (lanes run in order)
        self._lock = threading.Lock()
        self.busy_s = 0.0
        """Seconds spent hashing, summed over threads (statistics)."""

    def queue(self, mv: memoryview) -> Future[None]:
        """Hash ``mv`` (the next bytes of the stream) on the hash threads; the future completes once every
        byte of it is hashed. ``mv`` must stay unchanged until then."""
        return _all([self._submit(lane, fn, piece) for lane, fn, piece in self._jobs(mv)])

    def update(self, mv: memoryview) -> None:
        """Hash ``mv`` before returning: on this thread when nothing queued is still being hashed."""
        if all(f is None or f.done() for f in self._last):
            for _, fn, piece in self._jobs(mv):
                self._timed(fn, piece)
        else:
            self.queue(mv).result()

    def _jobs(self, mv: memoryview) -> list[tuple[int, Callable[[memoryview], Any], memoryview]]:
        """``mv``'s work as ``(lane, function, bytes)``: the whole digest on lane 0; else the CRCs on the
        last lane (in stream order) and each block's piece on its block's lane."""
        lo = self._at
        self._at += len(mv)
        if self._whole is not None:
            return [(0, self._update_whole, mv)]
        assert self.block is not None
        jobs: list[tuple[int, Callable[[memoryview], Any], memoryview]] = []
        if self._regions:
            jobs.append((len(self._lanes) - 1, self._crc, mv))
        pos, n = lo, len(self._lanes) - (1 if self._regions else 0)
        while pos < self._at:
            i = pos // self.block
            end = min(self._at, (i + 1) * self.block)
            while len(self._blocks) <= i:
                self._blocks.append(new_hash(self.algorithm))
            jobs.append((i % n, self._blocks[i].update, mv[pos - lo : end - lo]))
            pos = end
        return jobs

    def _submit(self, lane: int, fn: Callable[[memoryview], Any], mv: memoryview) -> Future[None]:
        f = self._lanes[lane].submit(self._timed, fn, mv)
        self._last[lane] = f
        return f

    def _update_whole(self, mv: memoryview) -> None:
        assert self._whole is not None
        self._whole.update(mv)
        self._crc(mv)

    def _timed(self, fn: Any, mv: memoryview) -> None:
        t0 = time.perf_counter()
        fn(mv)
        dt = time.perf_counter() - t0
        with self._lock:
            self.busy_s += dt

    def _crc(self, mv: memoryview) -> None:
        """Fold ``mv`` (the bytes at ``_crc_at``) into the CRC-32 of each region it overlaps."""
        lo, hi = self._crc_at, self._crc_at + len(mv)
        self._crc_at = hi
        while self._region < len(self._regions):
            b, e = self._regions[self._region]
            if b >= hi:
                return
            s, t = max(b, lo), min(e, hi)
            if s < t:
                self.crcs[self._region] = crc32(mv[s - lo : t - lo], self.crcs[self._region])
            if e > hi:
                return
            self._region += 1

    def close(self, wait: bool = True) -> None:
        """Wait for queued hashes (``wait``) and stop the threads; else drop what is queued."""
        for pool in self._lanes:
            pool.shutdown(wait=wait, cancel_futures=not wait)

    def digest(self) -> FileDigest:
        """The digest of everything queued (call after ``close``)."""
        if self._whole is not None:
            return FileDigest(sha256=self._whole.hexdigest())
        assert self.block is not None
        blocks = tuple(h.hexdigest() for h in self._blocks)
        return FileDigest(block=self.block, blocks=blocks, algorithm=self.algorithm)


def _all(futures: list[Future[None]]) -> Future[None]:
    """One future for several: done when all are (with the first error, if any)."""
    if len(futures) == 1:
        return futures[0]
    out: Future[None] = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def done(f: Future[None]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last and not out.done():
            errors = [e for e in (g.exception() for g in futures) if e is not None]
            if errors:
                out.set_exception(errors[0])
            else:
                out.set_result(None)

    if not futures:
        out.set_result(None)
    for f in futures:
        f.add_done_callback(done)
    return out


def block_digests(f: Location, block: int, size: int, algorithm: str = "sha256") -> list[str]:
    """The ``algorithm`` digest (hex) of each ``block``-byte block of the first ``size`` bytes of ``f`` (a
    file shorter than ``size``: ``EOFError``), on ``lanes()`` threads, fewer when several files are checked
    side by side (``scan.sharing``): lane ``j`` reads blocks ``j, j + n, ...`` in ``_READ`` pieces and
    hashes each as it reads. Memory: one ``_READ`` buffer per lane, whatever the block size."""
    count = -(-size // block) if size else 0
    n = max(1, min(count, lanes() // scan.sharing()))
    out = [""] * count
    fd = fileio.open_fd(str(f))

    def lane(j: int) -> None:
        mv = memoryview(bytearray(min(_READ, block, max(size, 1))))
        for i in range(j, count, n):
            h, lo, end = new_hash(algorithm), i * block, min(size, (i + 1) * block)
            for a in range(lo, end, len(mv)):
                part = mv[: min(len(mv), end - a)]
                if fileio.pread_into(fd, part, a) != len(part):
                    raise EOFError(f"{f}: ends inside block {i}")
                h.update(part)
            out[i] = h.hexdigest()

    try:
        if n == 1:
            lane(0)
        else:
            with Pool(n, thread_name_prefix="zckpt-verify") as pool:
                for r in [pool.submit(lane, j) for j in range(n)]:
                    r.result()
        return out
    finally:
        fileio.close_fd(fd)


def write_block_sidecar(path: Path, digest: FileDigest, size: int, durable: bool = True) -> Path:
    """Write the block sidecar of ``path``: ``<path>.crc32.json`` for a CRC-32 digest, ``{"format":
    "zckpt-block-crc32", "version": 1, "file", "size", "block", "crc32": [8 hex digits per block]}`` (each
    entry is ``zlib.crc32`` of that byte range, docs/checksums.md); ``<path>.sha256.json`` for a sha256 one
    (the earlier format: ``{"file", "size", "block", "sha256": [...]}``, each what ``sha256sum`` prints)."""
    if digest.algorithm == "crc32":
        side = path.with_name(path.name + CRC_SIDECAR)
        doc: dict[str, Any] = {"format": CRC_SIDECAR_FORMAT, "version": CRC_SIDECAR_VERSION}
        doc |= {"file": path.name, "size": size, "block": digest.block, "crc32": list(digest.blocks)}
    else:
        side = path.with_name(path.name + BLOCK_SIDECAR)
        doc = {"file": path.name, "size": size, "block": digest.block, "sha256": list(digest.blocks)}
    with open(side, "x") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
        f.flush()
        if durable:
            os.fsync(f.fileno())
    return side
