#!/usr/bin/env python3
"""How fast the disk takes one sequential ``O_DIRECT`` file by the way it is written: request size,
requests in flight, and whether the file's blocks were allocated first (``fallocate``,
``zckpt.storage.direct_io.preallocate``) or each write extends it (on ext4 an extending or hole-filling
direct write holds the inode lock, so requests in flight run one at a time), or through the page cache
(``buffered``: the kernel's writeback, then ``fsync``). Random data, fsync included,
the file removed after each; ``--settle`` seconds of an idle disk (after ``sync``) before each, so that
every mode starts from the same state.

    python bench/write_modes.py DIR [--gb 6.23] [--modes append:16:1,falloc:16:8,...] [--settle 10]

One ``WRITE-MODE <mode> <MiB per request> x<depth>: <GB/s>`` line each, plus the filesystem.
"""

from __future__ import annotations

import argparse
import mmap
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from zckpt.storage.direct_io import preallocate  # noqa: E402


def write(path: str, total: int, bs: int, depth: int, mode: str, bufs: list[mmap.mmap]) -> float:
    direct = 0 if mode == "buffered" else os.O_DIRECT
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
    t = time.perf_counter()
    if mode == "falloc" and not preallocate(fd, total):
        print("WRITE-MODE falloc refused by this filesystem", flush=True)
    with ThreadPoolExecutor(depth) as pool:
        futs = []
        for i, off in enumerate(range(0, total, bs)):
            if len(futs) >= depth:
                futs.pop(0).result()
            view = memoryview(bufs[i % len(bufs)])[: min(bs, total - off)]
            futs.append(pool.submit(os.pwrite, fd, view, off))
        for f in futs:
            f.result()
    os.fsync(fd)
    os.close(fd)
    wall = time.perf_counter() - t
    os.unlink(path)
    return total / wall / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--gb", type=float, default=6.23)
    ap.add_argument(
        "--modes", default="append:64:1,append:16:1,append:16:8,falloc:16:1,falloc:16:8,falloc:64:4"
    )
    ap.add_argument("--settle", type=float, default=10.0)
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    fs = subprocess.run(["df", "-T", str(a.dir)], capture_output=True, text=True).stdout.splitlines()[-1]
    print(f"WRITE-MODE filesystem: {fs}", flush=True)
    modes = [(m, int(b) << 20, int(d)) for m, b, d in (x.split(":") for x in a.modes.split(","))]
    bufs = [mmap.mmap(-1, max(b for _, b, _ in modes)) for _ in range(max(d for _, _, d in modes))]
    for b in bufs:
        b.write(os.urandom(len(b)))
    total = int(a.gb * 1e9) // 4096 * 4096
    for mode, bs, depth in modes:
        os.sync()
        time.sleep(a.settle)
        gbs = write(str(a.dir / "write_modes.bin"), total, bs, depth, mode, bufs)
        print(f"WRITE-MODE {mode} {bs >> 20} MiB x{depth}, {total / 1e9:.2f} GB: {gbs:.3f} GB/s", flush=True)


if __name__ == "__main__":
    main()
