#!/usr/bin/env python3
"""What one host's cores do for zckpt's CPU work, per thread and with several at once: ISA-L's and zlib's
CRC-32 (GB/s), a page-cache-sized memcpy (GB/s), and the numpy float32 -> bfloat16 / float16 casts of
``zckpt.stream.cast`` (ns per element). For reading the GPU host's profiles: a cost that grows with the
thread count points at shared cores (SMT) or memory, not at the code.

    python bench/cpu_probe.py [--threads 1,4,8,16] [--mib 256] [--blocks 65536,262144]

``--blocks``: the bf16 cast again at each of these elements-per-numpy-pass (``cast.BLOCK``, set here for the
probe only): a cost per pass that grows with the thread count is the GIL handed between threads.
"""

from __future__ import annotations

import argparse
import threading
import time
import zlib

import numpy as np

from zckpt.dtypes import DType
from zckpt.stream import cast


def _dtype(name: str) -> DType:
    import zckpt.dtypes as d

    return next(v for v in vars(d).values() if isinstance(v, DType) and v.name == name)


def timed(k: int, fn) -> float:  # type: ignore[no-untyped-def]
    ths = [threading.Thread(target=fn, args=(i,)) for i in range(k)]
    t = time.perf_counter()
    for x in ths:
        x.start()
    for x in ths:
        x.join()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,4,8,16")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--blocks", default="")
    a = ap.parse_args()
    ks = [int(x) for x in a.threads.split(",")]
    n = a.mib << 20
    kmax = max(ks)
    bufs = [
        np.random.default_rng(i).standard_normal(n // 4, dtype=np.float32).view(np.uint8) for i in range(kmax)
    ]
    outs = [np.empty(n, np.uint8) for _ in range(kmax)]
    try:
        from isal.isal_zlib import crc32 as icrc
    except ImportError:
        icrc = None
    f32, bf16, f16 = _dtype("float32"), _dtype("bfloat16"), _dtype("float16")
    ch = 16 << 20
    jobs = {
        "crc32 isal GB/s": (lambda i: [icrc(bufs[i][o : o + ch]) for o in range(0, n, ch)]) if icrc else None,
        "crc32 zlib GB/s": lambda i: [zlib.crc32(bufs[i][o : o + ch]) for o in range(0, n, ch)],
        "memcpy GB/s": lambda i: np.copyto(outs[i], bufs[i]),
        "cast bf16 ns/elem": lambda i: [
            cast.numpy_cast(outs[i][o // 2 : (o + ch) // 2], bf16, bufs[i][o : o + ch], f32)
            for o in range(0, n, ch)
        ],
        "cast fp16 ns/elem": lambda i: [
            cast.numpy_cast(outs[i][o // 2 : (o + ch) // 2], f16, bufs[i][o : o + ch], f32)
            for o in range(0, n, ch)
        ],
    }
    default_block = cast.BLOCK
    runs = [(name, fn, default_block) for name, fn in jobs.items() if fn is not None]
    runs += [("cast bf16 ns/elem", jobs["cast bf16 ns/elem"], int(b)) for b in a.blocks.split(",") if b]
    for name, fn, block in runs:
        cast.BLOCK = block
        if "cast" in name:
            name = f"{name} (block {block})"
        row = []
        for k in ks:
            timed(k, fn)  # first touch of the outputs, caches
            dt = timed(k, fn)
            row.append(f"{k}t {n / dt / 1e9:.2f}" if "GB/s" in name else f"{k}t {dt / (n // 4) * 1e9:.2f}")
        print(f"CPU {name}: per thread, " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
