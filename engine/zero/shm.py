"""Shared-memory exchange for ranks on one host: the engine's gloo collectives without the loopback sockets.

Gloo moves every byte between two ranks of one host through a TCP socket: a copy into the kernel, a copy out,
and the syscalls and wake-ups between. ``ShmPeers`` gives each rank named *segments* in ``/dev/shm`` that
every other rank of the group maps too, so an exchange becomes: write my part into my segment (the copy the
collective needs anyway), one barrier, read the others' parts straight from their segments. The barrier is a
one-element gloo all-reduce, which also orders the exchange with the group's other collectives.

Each exchange has a *slot* (one segment per rank), reused by the slot's next exchange: before a rank
writes into it again, a barrier makes sure every rank has read the previous exchange (each rank reads an
exchange before it starts the next one on the same slot). That costs one more tiny all-reduce per exchange
instead of a second set of segments, so the segments add no more memory than gloo's own buffers. A segment
grows when an exchange needs more bytes; growing is collective (every rank asks for the same sizes in the
same order, as for any collective), and each file is unlinked as soon as every rank has mapped it, so
nothing is left in ``/dev/shm`` even if the job is killed.

Used only when every rank of a gloo group runs on this host (same hostname and boot id) and ``/dev/shm`` is
writable; ``ZCKPT_ENGINE_SHM=0`` turns it off.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SHM_DIR = Path("/dev/shm")
_ALIGN = 1 << 20


def _host_id() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def usable(world: int) -> bool:
    """Collective: whether the ranks of the default (gloo) group can exchange through ``/dev/shm``."""
    if os.environ.get("ZCKPT_ENGINE_SHM", "1") == "0":
        return False
    ok = SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)
    ids: list[Any] = [None] * world
    dist.all_gather_object(ids, (_host_id(), ok))
    return all(i[1] for i in ids) and len({i[0] for i in ids}) == 1


class ShmPeers:
    """The segments of every rank of the default group, mapped into this process."""

    def __init__(self, world: int, rank: int) -> None:
        self.world = world
        self.rank = rank
        box = [secrets.token_hex(6) if rank == 0 else None]
        dist.broadcast_object_list(box, 0)
        self._job = box[0]
        self._segs: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self._gen = 0

    def next(self, slot: str, nbytes: int) -> list[torch.Tensor]:
        """The segments (one ``uint8`` tensor per rank, ``nbytes`` long) for the next exchange on ``slot``,
        once every rank has read the previous one: this rank may write its own segment now."""
        have = self._segs.get(slot)
        if have is None or have[0] < nbytes:
            size = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
            self._segs[slot] = (size, self._map(size))  # its barriers also order it after the last reads
        else:
            self.barrier()
        return [s[:nbytes] for s in self._segs[slot][1]]

    def _map(self, size: int) -> list[torch.Tensor]:
        self._gen += 1
        names = [SHM_DIR / f"zckpt-engine-{self._job}-{r}-{self._gen}" for r in range(self.world)]
        mine = names[self.rank]
        segs: list[torch.Tensor | None] = [None] * self.world
        segs[self.rank] = torch.from_file(str(mine), shared=True, size=size, dtype=torch.uint8)
        try:
            self.barrier()  # every file exists
            for r, name in enumerate(names):
                if r != self.rank:
                    segs[r] = torch.from_file(str(name), shared=True, size=size, dtype=torch.uint8)
            self.barrier()  # every rank has mapped every file
        finally:
            mine.unlink(missing_ok=True)  # the mappings stay valid; no file outlives the job
        return [s for s in segs if s is not None]

    def barrier(self) -> None:
        dist.all_reduce(torch.zeros(1, dtype=torch.int32))

    def start_barrier(self) -> Any:
        """A barrier to ``wait()`` on later: the caller writes, starts it, and reads after the wait."""
        return dist.all_reduce(torch.zeros(1, dtype=torch.int32), async_op=True)
