#!/usr/bin/env python3
"""What a read-time checksum costs next to diff's comparison, by checksum (issue 42: "a checked read costs
<= 10 % more than an unchecked one"), in one process, no files: bytes in memory stand for the page cache.

    python bench/hash_speed.py [--gib 1]

``HASH <name> <size>: GB/s`` for ISA-L's CRC-32 (what zckpt uses), zlib's, and where importable (none is a
zckpt dependency) zlib-ng's CRC-32 (``zlib-ng``), CRC-32C (``crc32c``) and xxHash3 (``xxhash``), over a buffer
that fits the cache (64 KiB-4 MiB, hashed again and again) and over one that does not (256 MiB, once); then
``LOOP`` lines: diff's bit-identical fast path on two equal float32 arrays (``np.array_equal`` of each 4 MiB
chunk pair, then the dot product ``_scan_same`` takes), without a checksum and with each checksum of the chunk
right after, and the ratio to the unchecked loop.
"""

from __future__ import annotations

import argparse
import time
import zlib
from collections.abc import Callable

import numpy as np

try:
    from isal import isal_zlib
except ImportError:  # pragma: no cover - isal is a dependency
    isal_zlib = None
try:
    import xxhash
except ImportError:
    xxhash = None
try:
    from zlib_ng import zlib_ng
except ImportError:
    zlib_ng = None
try:
    import crc32c
except ImportError:
    crc32c = None

CHUNK = 4 << 20


def hashes() -> dict[str, Callable[[object], int]]:
    out: dict[str, Callable[[object], int]] = {"zlib crc32": zlib.crc32}
    if isal_zlib is not None:
        out["isal crc32"] = isal_zlib.crc32
    if zlib_ng is not None:
        out["zlib-ng crc32"] = zlib_ng.crc32
    if crc32c is not None:
        out["crc32c (icrar)"] = crc32c.crc32c
    if xxhash is not None:
        out["xxh3_64"] = xxhash.xxh3_64_intdigest
    return out


def speed(f: Callable[[object], int], size: int, total: int) -> float:
    b = np.random.default_rng(0).bytes(size)
    n = max(1, total // size)
    t = time.perf_counter()
    for _ in range(n):
        f(b)
    return n * size / (time.perf_counter() - t) / 1e9


def loop(a: np.ndarray, b: np.ndarray, f: Callable[[object], int] | None) -> float:
    ua, ub, step = a.view(np.uint32), b.view(np.uint32), CHUNK // 4
    t = time.perf_counter()
    for o in range(0, len(a), step):
        x, y = ua[o : o + step], ub[o : o + step]
        np.array_equal(x, y)
        v = a[o : o + step]
        np.einsum("i,i->", v, v)
        if f is not None:
            f(x)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    for name, f in hashes().items():
        for size in (64 << 10, 4 << 20, 256 << 20):
            print(f"HASH {name} {size >> 10} KiB: {speed(f, size, 2 << 30):.1f} GB/s", flush=True)
    n = int(args.gib * (1 << 30)) // CHUNK * CHUNK // 4
    a = np.random.default_rng(1).standard_normal(n, dtype=np.float32)
    b = a.copy()
    base = min(loop(a, b, None) for _ in range(args.repeat))
    print(f"LOOP unchecked: {base:.3f} s", flush=True)
    for name, f in hashes().items():
        t = min(loop(a, b, f) for _ in range(args.repeat))
        print(f"LOOP {name}: {t:.3f} s, {t / base:.2f}x", flush=True)


if __name__ == "__main__":
    main()
