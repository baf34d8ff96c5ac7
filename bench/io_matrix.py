#!/usr/bin/env python3
"""Which write shape the disk wants, and what the page cache gives a reader thread: the measurements behind
``zckpt.stream``'s piece size and writes in flight (issue 22). Prints one ``IOM {json}`` line per figure.

    python bench/io_matrix.py DIR [--gib 4] [--sizes 4,16,64] [--depths 1,2,4,8]

- ``write``: sequential ``O_DIRECT`` ``pwrite`` of ``--gib`` GiB in requests of each size (MiB), ``depth``
  of them in flight on as many threads, fsync included; ``load=1`` repeats a few shapes while 4 other threads
  ``pread`` a cached file and sha256 what they read (what a consolidate's fill and hash lanes do meanwhile).
- ``pread``: a cached (just written, buffered) file read back with ``pread`` into page-aligned buffers of
  16 MiB on 1, 4 and 8 threads: the page cache's speed per reader.
- ``cold``: the same file read after the page cache is dropped (root only; skipped otherwise), 16 MiB
  requests: buffered on 1 and 4 threads (the kernel's readahead alone, what zckpt's readers get today),
  buffered with ``POSIX_FADV_WILLNEED`` 64 MiB ahead of the reader, and ``O_DIRECT`` at depth 1 and 4; with
  the device's ``read_ahead_kb``. Which of them reaches the probe's ``O_DIRECT`` read speed says how a cold
  consolidate should read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from disk_probe import sweep  # bench/ is on sys.path when run as a script


def emit(**kw: object) -> None:
    print("IOM " + json.dumps(kw), flush=True)


def write(path: str, total: int, bs: int, depth: int, bufs: list[mmap.mmap]) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    t = time.perf_counter()
    sweep(fd, total, bs, depth, bufs)
    os.fsync(fd)
    os.close(fd)
    return total / (time.perf_counter() - t) / 1e9


def preader(path: str, stop: threading.Event, k: int, n: int) -> None:
    buf = mmap.mmap(-1, 16 << 20)
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    off = k * (16 << 20)
    while not stop.is_set():
        got = os.preadv(fd, [buf], off % max(size - (16 << 20), 1))
        hashlib.sha256(memoryview(buf)[:got]).digest()
        off += n * (16 << 20)
    os.close(fd)


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return True
    except OSError:
        return False


def read_ahead_kb(path: str) -> str:
    dev = os.stat(path).st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for q in (sysfs / "queue/read_ahead_kb", sysfs / "../queue/read_ahead_kb"):
        if q.exists():
            return q.read_text().strip()
    return "unknown"


def cold_read(path: str, total: int, threads: int, *, direct: bool = False, ahead: int = 0) -> float:
    """Read ``path`` cold in 16 MiB requests, ``threads`` readers interleaved (reader k takes requests k,
    k + threads, ...); ``ahead``: each reader asks ``WILLNEED`` for that many bytes past its request."""
    bs = 16 << 20

    def rd(k: int) -> int:
        buf = mmap.mmap(-1, bs)  # page-aligned, as O_DIRECT needs
        fd, n = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0)), 0
        for off in range(k * bs, total, threads * bs):
            if ahead:
                os.posix_fadvise(fd, off + bs, ahead, os.POSIX_FADV_WILLNEED)
            n += os.preadv(fd, [buf], off)
        os.close(fd)
        return n

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        n = sum(pool.map(rd, range(threads)))
    return n / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--gib", type=int, default=4)
    ap.add_argument("--sizes", default="4,16,64")
    ap.add_argument("--depths", default="1,2,4,8")
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    total = a.gib << 30
    sizes = [int(s) << 20 for s in a.sizes.split(",")]
    depths = [int(d) for d in a.depths.split(",")]
    bufs = [mmap.mmap(-1, max(sizes)) for _ in range(max(depths))]
    for b in bufs:
        b.write(os.urandom(len(b)))
    out = str(a.dir / "iom.bin")
    for bs in sizes:
        for depth in depths:
            emit(
                what="write",
                mib=bs >> 20,
                depth=depth,
                load=0,
                gbs=round(write(out, total, bs, depth, bufs), 3),
            )
    cached = str(a.dir / "cached.bin")  # buffered, so it stays in the page cache
    with open(cached, "wb") as f:
        for _ in range(total // len(bufs[0])):
            f.write(bufs[0])
    for threads in (1, 4, 8):
        t = time.perf_counter()

        def rd(k: int, threads: int = threads) -> int:
            buf, fd, n = mmap.mmap(-1, 16 << 20), os.open(cached, os.O_RDONLY), 0
            for off in range(k * (16 << 20), total, threads * (16 << 20)):
                n += os.preadv(fd, [buf], off)
            os.close(fd)
            return n

        with ThreadPoolExecutor(threads) as pool:
            n = sum(pool.map(rd, range(threads)))
        emit(what="pread cached", threads=threads, mib=16, gbs=round(n / (time.perf_counter() - t) / 1e9, 3))
    ra = read_ahead_kb(cached)
    for name, threads, direct, ahead in (
        ("buffered", 1, False, 0),
        ("buffered", 4, False, 0),
        ("buffered, WILLNEED 64 MiB ahead", 1, False, 64 << 20),
        ("O_DIRECT", 1, True, 0),
        ("O_DIRECT", 4, True, 0),
    ):
        if not drop_caches():
            emit(what="cold", skipped="cannot drop the page cache (not root)")
            break
        gbs = cold_read(cached, total, threads, direct=direct, ahead=ahead)
        emit(what="cold", how=name, threads=threads, mib=16, read_ahead_kb=ra, gbs=round(gbs, 3))
    with open(cached, "rb") as f:  # cached again for the loaded writes below
        while f.read(64 << 20):
            pass
    for bs, depth in ((16 << 20, 1), (16 << 20, 4), (64 << 20, 1), (64 << 20, 2)):
        if bs not in sizes:
            continue
        stop = threading.Event()
        ths = [threading.Thread(target=preader, args=(cached, stop, k, 4)) for k in range(4)]
        for th in ths:
            th.start()
        g = write(out, total, bs, depth, bufs)
        stop.set()
        for th in ths:
            th.join()
        emit(what="write", mib=bs >> 20, depth=depth, load=1, gbs=round(g, 3))
    os.unlink(out)
    os.unlink(cached)


if __name__ == "__main__":
    main()
