"""``HostStaging``: the reusable host memory an asynchronous save snapshots a rank file into.

The snapshot is the rank file itself, laid out by ``zckpt.formats.native.write.rank_plan``: header at byte 0,
each tensor's bytes at its offset. The memory is a list of ``BLOCK``-byte blocks, page-aligned (so the
writer sends them to the device with ``O_DIRECT`` straight from here, no copy) and, when CUDA is in use,
pinned (device-to-host copies at full PCIe speed, issued asynchronously and waited for once). Blocks are
allocated once -- at ``Engine`` start-up from ``predict_bytes``, or by the first save that needs more --
and reused by every later save; ``release()`` frees them. Host memory held: the rank file's size rounded up
to whole blocks (at most 256 MiB each).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import time

import torch

from zckpt.storage.direct_io import aligned_buffer

log = logging.getLogger(__name__)

BLOCK = 256 << 20
"""Largest block: blocks are powers of two (torch's pinned allocator rounds requests up to one), about an
eighth of the first reservation, between 1 MiB and this."""


class HostStaging:
    """Page-aligned (and, with ``pinned``, page-locked) host blocks holding one rank file's bytes."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._blocks: list[torch.Tensor] = []
        self._maps: list[mmap.mmap] = []  # keep the unpinned blocks' memory alive
        self.block = 0
        """Bytes per block, fixed by the first reservation."""
        self.alloc_s = 0.0
        """Seconds spent allocating blocks so far."""

    @property
    def nbytes(self) -> int:
        return len(self._blocks) * self.block

    def reserve(self, size: int) -> None:
        """Hold at least ``size`` bytes (whole blocks are added; nothing is freed)."""
        if not self.block:
            self.block = min(BLOCK, max(1 << 20, 1 << max(0, size // 8 - 1).bit_length()))
        missing = -(-size // self.block) - len(self._blocks)
        if missing <= 0:
            return
        t0 = time.perf_counter()
        for _ in range(missing):
            if self.pinned:
                self._blocks.append(torch.empty(self.block, dtype=torch.uint8, pin_memory=True))
            else:
                m = aligned_buffer(self.block)
                self._maps.append(m)
                self._blocks.append(torch.frombuffer(m, dtype=torch.uint8))
        self.alloc_s += time.perf_counter() - t0
        kind = "pinned" if self.pinned else "pageable"
        took = time.perf_counter() - t0
        log.info(
            "checkpoint snapshot buffer: %.2f GiB of %s host memory (%.1f s)", self.nbytes / 2**30, kind, took
        )

    def put_bytes(self, offset: int, data: bytes) -> None:
        """Copy ``data`` to byte ``offset``."""
        self.put(offset, torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def put(self, offset: int, src: torch.Tensor) -> None:
        """Copy the bytes of the flat, contiguous tensor ``src`` (any device) to byte ``offset``; copies from
        a GPU are asynchronous until ``settle()``."""
        if not src.numel():
            return
        raw = src.view(torch.uint8) if src.dtype != torch.uint8 else src
        async_ = raw.device.type == "cuda"
        pos, end = 0, raw.numel()
        while pos < end:
            b, at = divmod(offset + pos, self.block)
            take = min(end - pos, self.block - at)
            self._blocks[b][at : at + take].copy_(raw[pos : pos + take], non_blocking=async_)
            pos += take

    def settle(self) -> None:
        """Wait for the asynchronous device-to-host copies of ``put``."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def views(self, size: int) -> list[memoryview]:
        """The first ``size`` bytes, as one memoryview per block."""
        out = []
        for b in range(-(-size // self.block)):
            n = min(self.block, size - b * self.block)
            out.append(memoryview(self._blocks[b].numpy()).cast("B")[:n])  # type: ignore[arg-type]
        return out

    def release(self) -> None:
        self._blocks.clear()
        for m in self._maps:
            with contextlib.suppress(BufferError):  # a view still alive keeps its block until it dies
                m.close()
        self._maps.clear()
        self.block = 0
