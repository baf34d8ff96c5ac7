"""``zckpt.storage.fileio.release``: the pages of a consumed range of a file's mapping leave the process (its
RSS does not grow by what a diff streams), the bytes stay readable and unchanged, and a release is made
without the GIL (libc's ``madvise`` through ctypes: ``mmap.madvise`` holds it for the whole call)."""

from __future__ import annotations

import contextvars
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from zckpt.storage import fileio, session

MIB = 1 << 20


def _mapped_rss(path: Path) -> int:
    """Bytes of ``path``'s mappings resident in this process (``/proc/self/smaps``)."""
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            rss += int(head[1]) << 10
    return rss


def test_release_drops_the_pages_and_keeps_the_bytes(tmp_path: Path) -> None:
    f = tmp_path / "blob.bin"
    data = np.random.default_rng(0).integers(0, 255, 32 * MIB, dtype=np.uint8)
    f.write_bytes(data.tobytes())
    with session.operation() as st, st.bound():
        view = np.frombuffer(fileio.view_bytes(str(f), 0, data.size), dtype=np.uint8)
        assert int(view[::4096].sum()) == int(data[::4096].sum())  # every page faulted in
        assert _mapped_rss(f) >= 30 * MIB
        fileio.release(str(f), 4 * MIB, 16 * MIB)  # the middle half: [4, 20) MiB
        left = _mapped_rss(f)
        assert 14 * MIB <= left <= 18 * MIB, left  # 16 MiB stay, give or take the 64 KiB rounding
        fileio.release(str(f), 0, data.size)
        assert _mapped_rss(f) <= 1 * MIB
        assert np.array_equal(view, data)  # read again from the file: the same bytes


def test_release_lets_other_threads_run(tmp_path: Path) -> None:
    """While one thread releases a large mapped range again and again, another runs Python all along (with
    ``mmap.madvise`` it would wait for each call to end: ~28 ms per GiB of pages on the 2-core VM)."""
    f = tmp_path / "big.bin"
    n = 512 * MIB
    f.write_bytes(bytes(n))  # written, not sparse: a hole's pages are never mapped
    with session.operation() as st, st.bound():
        view = np.frombuffer(fileio.view_bytes(str(f), 0, n), dtype=np.uint8)
        stop = threading.Event()
        calls: list[float] = []

        def releaser() -> None:
            while not stop.is_set():
                int(view[::4096].sum())  # fault the pages in (numpy: the GIL let go)
                t = time.perf_counter()
                fileio.release(str(f), 0, n)
                calls.append(time.perf_counter() - t)

        th = threading.Thread(target=contextvars.copy_context().run, args=(releaser,))  # the bound storage
        th.start()
        gaps, last, end = [], time.perf_counter(), time.perf_counter() + 1.5
        while time.perf_counter() < end:  # Python work: the longest wait for the GIL between two steps
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        stop.set()
        th.join()
    assert len(calls) >= 5, calls
    typical = statistics.median(calls)
    assert typical > 0.002, f"a release took {typical * 1e3:.1f} ms: too short to tell"
    # with the GIL held through each release, the loop above would stall once per call for about that long;
    # without, only when the OS runs something else (a busy CI machine: now and then, not every call)
    stalls = sum(g > typical / 2 for g in gaps)
    assert stalls < len(calls) / 2, (stalls, len(calls), typical, max(gaps))
