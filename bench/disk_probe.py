#!/usr/bin/env python3
"""The disk probe every GPU-host benchmark records beside its figures: sequential O_DIRECT write then read
of random data (64 MiB requests, ``--depths`` requests in flight, the page cache dropped before each read;
needs root for that), then the concurrent probe (the file just read is read again while as many bytes are
written to a second file, both O_DIRECT at that depth, at once: what a cold job that reads and writes gets
from a disk whose reads and writes share its bandwidth), then sha256 on one core and on 4 threads (the
block digest's lanes).

    python bench/disk_probe.py DIR [--gib 4] [--depths 1,2] [--json OUT.json]

One ``PROBE ...`` line per figure; with ``--json`` the figures as ``{"write_gbs": .., "read_gbs": ..,
"rw_gbs": .., "write_gbs_d2": .., "read_gbs_d2": .., "rw_gbs_d2": .., "sha256_1_gbs": ..,
"sha256_4_gbs": ..}`` (depth 1 unsuffixed; ``rw_gbs``: the bytes read plus the bytes written over the time
until both ended).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _drop() -> None:
    os.sync()
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def sweep(fd: int, total: int, bs: int, depth: int, bufs: list[mmap.mmap], mode: str = "write") -> None:
    """``total`` bytes of ``fd`` written (or read) in order: ``bs`` per request, ``depth`` in flight."""
    with ThreadPoolExecutor(depth) as pool:
        futs = []
        for i, off in enumerate(range(0, total, bs)):
            if len(futs) >= depth:
                futs.pop(0).result()
            buf = memoryview(bufs[i % len(bufs)])[:bs]
            if mode == "write":
                futs.append(pool.submit(os.pwrite, fd, buf, off))
            else:
                futs.append(pool.submit(os.preadv, fd, [buf], off))
        for f in futs:
            f.result()


def concurrent(path: str, total: int, bs: int, depth: int, bufs: list[mmap.mmap]) -> float:
    """GB/s of ``path`` read (its pages dropped first) while ``total`` bytes are written to a second file,
    both ``O_DIRECT`` with ``depth`` requests in flight each, at once: (read + written bytes) / the time
    until both ended. The writer has buffers of its own (the reader's are filled by it)."""
    _drop()
    wpath = path + ".w"
    wbufs = [mmap.mmap(-1, bs) for _ in range(depth)]
    for b in wbufs:
        b.write(os.urandom(bs))
    rfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    wfd = os.open(wpath, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    ends: dict[str, float] = {}

    def side(fd: int, mode: str, use: list[mmap.mmap]) -> None:
        sweep(fd, total, bs, depth, use, mode)
        if mode == "write":
            os.fsync(fd)
        ends[mode] = time.perf_counter() - t

    t = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(side, rfd, "read", bufs[:depth]), pool.submit(side, wfd, "write", wbufs)]:
            f.result()
    wall = time.perf_counter() - t
    os.close(rfd)
    os.close(wfd)
    os.unlink(wpath)
    gbs = 2 * total / wall / 1e9
    print(f"PROBE read+write at once depth {depth}: {gbs:.3f} GB/s together "
          f"(read ended at {ends['read']:.2f} s, write at {ends['write']:.2f} s)", flush=True)  # fmt: skip
    return round(gbs, 3)


def probe(folder: Path, gib: int, depths: list[int]) -> dict[str, float]:
    folder.mkdir(parents=True, exist_ok=True)
    path, total, bs = str(folder / "probe.bin"), gib << 30, 64 << 20
    bufs = [mmap.mmap(-1, bs) for _ in range(max(depths))]
    for b in bufs:
        b.write(os.urandom(bs))
    out: dict[str, float] = {}
    for depth in depths:
        for mode in ("write", "read"):
            if mode == "read":
                _drop()
            flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if mode == "write" else os.O_RDONLY
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
            t = time.perf_counter()
            sweep(fd, total, bs, depth, bufs, mode)
            if mode == "write":
                os.fsync(fd)
            os.close(fd)
            gbs = total / (time.perf_counter() - t) / 1e9
            out[f"{mode}_gbs" + ("" if depth == 1 else f"_d{depth}")] = round(gbs, 3)
            print(f"PROBE {mode} depth {depth}: {gbs:.3f} GB/s", flush=True)
        out["rw_gbs" + ("" if depth == 1 else f"_d{depth}")] = concurrent(path, total, bs, depth, bufs)
    os.unlink(path)
    h, b = hashlib.sha256(), os.urandom(256 << 20)
    t = time.perf_counter()
    for _ in range(8):
        h.update(b)
    out["sha256_1_gbs"] = round(8 * len(b) / (time.perf_counter() - t) / 1e9, 3)
    print(f"PROBE sha256 one core: {out['sha256_1_gbs']:.3f} GB/s", flush=True)
    t = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:  # zckpt.storage.digest's lanes: 4 threads, one sha256 per block each
        list(pool.map(lambda i: hashlib.sha256(b).digest(), range(8)))
    out["sha256_4_gbs"] = round(8 * len(b) / (time.perf_counter() - t) / 1e9, 3)
    print(f"PROBE sha256 4 threads: {out['sha256_4_gbs']:.3f} GB/s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--gib", type=int, default=4)
    ap.add_argument("--depths", default="1,2")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    res = probe(a.dir, a.gib, [int(d) for d in a.depths.split(",")])
    if a.json:
        a.json.write_text(json.dumps(res))


if __name__ == "__main__":
    main()
