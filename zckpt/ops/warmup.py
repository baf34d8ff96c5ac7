"""Read-ahead of a local input checkpoint while the command line imports torch.

``import torch`` takes 1-2 s warm and several more on a cold page cache (a CUDA build reads its libraries
from disk), and holds the GIL for most of it: the disk would sit idle meanwhile. ``advise_model`` runs in a
child process that ``zckpt.storage.preopen`` forks before that import: it opens the checkpoint (metadata
only, no torch), lists the byte ranges of its model tensors (the fp32 masters of trainable parameters, as
``consolidate`` reads them), and asks the kernel to start reading the first of them
(``posix_fadvise(WILLNEED)``, ``zckpt.storage.willneed``), up to a budget of a quarter of the memory the
kernel reports available (at most 8 GiB). The command then finds those bytes in the page cache.

Nothing here changes a byte read or decides anything: the child returns nothing, the command reads and
checks its input as always; a child that fails in any way only leaves the cache colder. Memory: clean page
cache the kernel may drop, within the budget.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

from zckpt.formats import open_checkpoint
from zckpt.model import TensorEntry
from zckpt.storage import willneed

MAX_BUDGET = 8 << 30


def budget() -> int:
    """Bytes worth reading ahead: a quarter of ``MemAvailable`` (``/proc/meminfo``), at most ``MAX_BUDGET``;
    0 where unknown."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return min(MAX_BUDGET, int(line.split()[1]) * 1024 // 4)
    return 0


def ranges(entries: Iterable[TensorEntry], limit: int) -> list[tuple[str, int, int]]:
    """``(file, offset, nbytes)`` of the entries' stored pieces in their order, adjacent ones of one file
    merged, until ``limit`` bytes."""
    out: list[tuple[str, int, int]] = []
    total = 0
    for e in entries:
        for p in e.pieces:
            if not p.file or total >= limit:
                continue
            n = min(p.nbytes, limit - total)
            total += n
            if out and out[-1][0] == p.file and out[-1][1] + out[-1][2] == p.byte_offset:
                out[-1] = (p.file, out[-1][1], out[-1][2] + n)
            else:
                out.append((p.file, p.byte_offset, n))
        if total >= limit:
            break
    return out


def advise_model(path: str) -> bytes:
    """Queue reads of the first model-tensor bytes of the local checkpoint at ``path`` (see the module doc);
    returns ``b""`` once they are queued. Runs in ``preopen``'s child."""
    limit = budget()
    if limit <= 0:
        return b""
    with open_checkpoint(path, model_only=True) as ckpt:
        todo = ranges(ckpt.model_entries(), limit)
    fds: dict[str, int] = {}
    try:
        for file, offset, n in todo:
            if file not in fds:
                fds[file] = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
            step = willneed.call_bytes(os.fstat(fds[file]).st_dev)
            willneed.advise_now(fds[file], offset, n, step)
    finally:
        for fd in fds.values():
            os.close(fd)
    return b""


__all__ = ["MAX_BUDGET", "advise_model", "budget", "ranges"]
