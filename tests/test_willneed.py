"""Read-ahead of local inputs on a cold page cache (``zckpt.storage.willneed``) and the write pipeline's use
of it: the calls the kernel gets, the pages it reads, and the bytes written (unchanged)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import time
from pathlib import Path

import pytest
import torch

from zckpt.model import Piece, Role, TensorEntry
from zckpt.storage import direct_io, willneed
from zckpt.storage.sink import HashingSink
from zckpt.stream import pipeline
from zckpt.stream.fill import Layout, Run


def _calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Every ``posix_fadvise`` call made from now on, as (offset, length, advice)."""
    seen: list[tuple[int, int, int]] = []
    monkeypatch.setattr(willneed.os, "posix_fadvise", lambda fd, a, n, adv: seen.append((a, n, adv)))
    return seen


def test_advisor_covers_each_range_in_calls_the_kernel_queues_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each advised range is covered exactly, in order, by WILLNEED calls of at most the device's cap, on the
    cap's grid (a 64 MiB call queues only the cap's bytes); objects and files that do not open are skipped."""
    f = tmp_path / "x.bin"
    f.write_bytes(b"\0" * 4096)
    monkeypatch.setattr(willneed, "call_bytes", lambda dev: 1 << 20)
    seen = _calls(monkeypatch)
    with willneed.Advisor() as adv:
        adv.advise(str(f), 300_000, 3 << 20)
        adv.advise("s3://bucket/key", 0, 1 << 20)
        adv.advise(str(tmp_path / "missing.bin"), 0, 1 << 20)
        adv.advise(str(f), 10, 0)
        deadline = time.monotonic() + 10  # the calls run on the advisor's thread; leaving drops the rest
        while sum(n for _, n, _ in seen) < 3 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert {a for _, _, a in seen} == {os.POSIX_FADV_WILLNEED}
    ranges = [(a, n) for a, n, _ in seen]
    assert ranges[0] == (300_000, (1 << 20) - 300_000)
    assert all(
        n <= 1 << 20 and (a + n) % (1 << 20) in (0, (300_000 + (3 << 20)) % (1 << 20)) for a, n in ranges
    )
    assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:], strict=False))
    assert ranges[-1][0] + ranges[-1][1] == 300_000 + (3 << 20)


def test_call_bytes_reads_the_devices_queue() -> None:
    """The cap is ``max(read_ahead_kb, max_sectors_kb)`` of the device's queue, where sysfs has it."""
    dev = os.stat("/").st_dev
    got = willneed.call_bytes(dev)
    q = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    q = q / "queue" if (q / "queue").is_dir() else q / ".." / "queue"
    if (q / "read_ahead_kb").is_file():
        kb = max(int((q / f).read_text()) for f in ("read_ahead_kb", "max_sectors_kb"))
        assert got == min(8 << 20, max(128 << 10, kb << 10))
    else:
        assert got == 128 << 10
    assert willneed.call_bytes(os.makedev(4095, 4095)) == 128 << 10  # no such device: the smallest cap


def _resident(path: Path) -> list[bool]:
    """Which pages of ``path`` are in the page cache (``mincore`` on a private mapping, never touched)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            head = ctypes.c_char.from_buffer(mm)
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(head)), ctypes.c_size_t(size), vec)
            del head
            if rc != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            mm.close()
    return [bool(v & 1) for v in vec]


def _evicted(path: Path) -> bool:
    """Drop ``path``'s clean pages from the page cache; True when none is left (a disk filesystem: tmpfs
    keeps them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return not any(_resident(path))


def _disk_folder(tmp_path: Path) -> Path:
    """A folder on a disk filesystem: ``tmp_path``, or the repository's own (CI's /tmp may be tmpfs)."""
    probe = tmp_path / "probe.bin"
    probe.write_bytes(os.urandom(1 << 16))
    if _evicted(probe):
        return tmp_path
    here = Path(__file__).resolve().parent / ".willneed-scratch"
    here.mkdir(exist_ok=True)
    return here


def test_advised_pages_are_read_and_the_others_are_not(tmp_path: Path) -> None:
    """On a real file whose pages were dropped, the advised range comes into the page cache without a byte
    being read by this process, and the pages past it stay out."""
    folder = _disk_folder(tmp_path)
    f = folder / "cold.bin"
    try:
        f.write_bytes(os.urandom(8 << 20))
        assert _evicted(f), f"{f}: the page cache keeps its pages (not a disk filesystem)"
        with willneed.Advisor() as adv:
            adv.advise(str(f), 1 << 20, 2 << 20)
            deadline = time.monotonic() + 10
            while not all(_resident(f)[256:768]) and time.monotonic() < deadline:
                time.sleep(0.02)
        res = _resident(f)
        assert all(res[256:768])  # pages of [1 MiB, 3 MiB)
        assert not any(res[1024:])  # nothing of the last 4 MiB (the kernel's own read-ahead reads none)
    finally:
        f.unlink(missing_ok=True)
        if folder != tmp_path:
            folder.rmdir()


def test_fill_advises_the_sources_ahead_and_writes_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pipeline.fill`` of a local fp32 tensor cast to bf16, with 8 KiB pieces and a 32 KiB read-ahead: the
    advised ranges are the whole pieces' source bytes (twice the output: fp32 for bf16; the last partial
    piece is filled in place, unadvised), each byte advised once; the file is torch's bytes."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(40_000, generator=g)
    src = tmp_path / "a.bin"
    src.write_bytes(a.numpy().tobytes())
    entry = TensorEntry(
        "a", (40_000,), torch.float32, Role.PARAM, (Piece(str(src), 0, torch.float32, 0, 40_000),)
    )
    monkeypatch.setattr(pipeline, "READ_AHEAD_BYTES", 32 << 10)
    advised: list[tuple[str, int, int]] = []
    real = willneed.Advisor.advise
    monkeypatch.setattr(
        willneed.Advisor, "advise", lambda self, p, o, n: (advised.append((p, o, n)), real(self, p, o, n))
    )
    sink = HashingSink(tmp_path / "out.bin", direct_io.WriteOptions(buf_bytes=8192, buffers=3))
    try:
        pipeline.fill(sink, Layout([Run(entry, 0, 40_000, torch.bfloat16)]), workers=2)
    finally:
        sink.close()
    assert (tmp_path / "out.bin").read_bytes() == a.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    assert {p for p, _, _ in advised} == {str(src)}
    cover = sorted((o, o + n) for _, o, n in advised)
    assert all(b == c for (_, b), (c, _) in zip(cover, cover[1:], strict=False))  # no byte advised twice
    assert cover[0][0] == 0 and cover[-1][1] == 80_000 // 8192 * 8192 * 2
