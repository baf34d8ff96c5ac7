#!/usr/bin/env python3
"""The copy floor: what any tool must at least pay for an operation, measured as a plain copy.

Imports torch (the start-up every tool here pays), then reads exactly the byte ranges listed in the
plan (``[[path, offset, nbytes], ...]``, in order) with large ``readinto`` calls into one reusable
64 MiB buffer, and writes ``write_bytes`` bytes to ``out`` with plain large sequential writes
(the buffer's bytes, scaled when the output is smaller than the input, e.g. fp32 -> bf16), then
fsyncs (every zckpt output is fsynced). No parsing, no casting, no hashing.

    python bench/floor.py PLAN.json
"""

from __future__ import annotations

import json
import os
import sys

import torch  # noqa: F401  (start-up cost every tool pays)

BUF = 64 << 20


def main() -> None:
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    reads, write_bytes, out = plan["reads"], int(plan["write_bytes"]), plan.get("out")
    total_read = sum(n for _, _, n in reads) or 1
    ratio = write_bytes / total_read
    buf = bytearray(BUF)
    mv = memoryview(buf)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if out and write_bytes else -1
    written = 0
    files: dict[str, int] = {}
    for path, off, n in reads:
        src = files.get(path)
        if src is None:
            src = files[path] = os.open(path, os.O_RDONLY)
            os.posix_fadvise(src, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n > 0:
            k = os.preadv(src, [mv[: min(n, BUF)]], off)
            if k <= 0:
                raise SystemExit(f"short read in {path} at {off}")
            off += k
            n -= k
            if fd >= 0:
                w = min(int(k * ratio), write_bytes - written)
                written += os.write(fd, mv[:w]) if w > 0 else 0
    if fd >= 0:
        while written < write_bytes:  # header bytes etc. beyond the scaled payload
            written += os.write(fd, mv[: min(BUF, write_bytes - written)])
        os.fsync(fd)
        os.close(fd)
    for src in files.values():
        os.close(src)


if __name__ == "__main__":
    main()
