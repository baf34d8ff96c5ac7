"""zckpt.stream.pipeline: ordered, bounded-memory streaming of tensors (pread + cast on workers, write in
order)."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest
import torch

from zckpt.errors import CorruptCheckpoint
from zckpt.model import Piece, Role, TensorEntry
from zckpt.storage import fileio
from zckpt.storage.sink import HashingSink
from zckpt.stream import pipeline
from zckpt.stream.items import WriteItem


def _file_entry(tmp: Path, name: str, t: torch.Tensor, cuts: list[int], gap: int = 24) -> TensorEntry:
    """``t`` stored as pieces ``[cuts[i], cuts[i+1])`` in one file, in reverse order with junk gaps."""
    flat = t.reshape(-1)
    path = tmp / f"{name}.bin"
    blob = bytearray(b"\xab" * gap)
    pieces = []
    bounds = list(zip(cuts[:-1], cuts[1:], strict=True))
    for lo, hi in reversed(bounds):
        off = len(blob)
        blob += flat[lo:hi].contiguous().view(torch.uint8).numpy().tobytes()
        blob += b"\xcd" * gap
        pieces.append(Piece(str(path), off, flat.dtype, lo, hi - lo, rank=0))
    path.write_bytes(bytes(blob))
    return TensorEntry(name, tuple(t.shape), t.dtype, Role.PARAM, tuple(pieces))


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_items_matches_torch(tmp_path: Path, workers: int, out_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(37, 11, generator=g)
    b = torch.randn(1001, generator=g)
    c = torch.arange(5, dtype=torch.int64)  # ints keep their dtype
    items = [
        WriteItem("a", _file_entry(tmp_path, "a", a, [0, 100, 101, 407]), out_dtype),
        WriteItem("b", _file_entry(tmp_path, "b", b, [0, 1001]), out_dtype),
        WriteItem(
            "c",
            TensorEntry("c", (5,), c.dtype, Role.BUFFER, (Piece("", 0, c.dtype, 0, 5, value=c),)),
            c.dtype,
        ),  # fmt: skip
    ]
    sink = io.BytesIO()
    # tiny chunks: many tasks per piece, every slot of the ring reused many times
    n = pipeline.write_items(sink, items, workers=workers, chunk_bytes=64)
    want = b"".join(
        x.reshape(-1).to(d).contiguous().view(torch.uint8).numpy().tobytes()
        for x, d in ((a, out_dtype), (b, out_dtype), (c, c.dtype))
    )
    assert n == len(want)
    assert sink.getvalue() == want


def test_truncated_file_raises(tmp_path: Path) -> None:
    e = _file_entry(tmp_path, "t", torch.ones(100), [0, 100])
    Path(e.pieces[0].file).write_bytes(b"\0" * 16)
    fileio.close_files()
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        pipeline.write_items(io.BytesIO(), [WriteItem("t", e, torch.float32)], workers=2)


def test_hashing_sink_overlapped_hash_is_sha256(tmp_path: Path) -> None:
    import hashlib

    data = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8).numpy().tobytes()
    sink = HashingSink(tmp_path / "f")
    sink.write(data[:10])  # small write: inline hash
    sink.write(memoryview(data)[10:])  # large write: hashed on the helper thread
    sink.close()
    assert sink.hexdigest() == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "f").read_bytes() == data


def test_prefetch_order_errors_and_early_close() -> None:
    assert list(pipeline.prefetch(iter(range(100)), depth=3)) == list(range(100))

    def boom():  # type: ignore[no-untyped-def]
        yield 1
        raise ValueError("x")

    it = pipeline.prefetch(boom())
    assert next(it) == 1
    with pytest.raises(ValueError, match="x"):
        next(it)

    produced = []

    def endless():  # type: ignore[no-untyped-def]
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    before = threading.active_count()
    it2 = pipeline.prefetch(endless(), depth=2)
    assert next(it2) == 0
    it2.close()  # the producer thread stops instead of running forever
    assert threading.active_count() <= before
    assert len(produced) <= 5


@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fill_matches_torch_at_every_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: str, workers: int, out_dtype: torch.dtype
) -> None:
    """``pipeline.fill`` through a real ``HashingSink`` with 8 KiB device pieces: pieces cut mid-element and
    mid-run, casts, zeros and in-memory values, written from the fill buffers (``O_DIRECT``) or copied
    (buffered), three records back to back (big, small, big: the sink's ring and buffer carry over); the
    file, its block CRC-32s and the records' CRC-32s equal torch's bytes and zlib's CRCs."""
    import zlib

    from zckpt.storage import direct_io
    from zckpt.stream.fill import Layout, Run

    monkeypatch.setenv("ZCKPT_DIRECT_IO", direct)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(9001, generator=g)  # fp32 on disk, in pieces stored out of order
    b = torch.randn(777, generator=g).to(torch.bfloat16)  # bf16 on disk: cast up when fp32 is asked for
    v = torch.randn(5, generator=g)
    ea = _file_entry(tmp_path, "a", a, [0, 1000, 1001, 9001])
    eb = _file_entry(tmp_path, "b", b, [0, 777])
    ev = TensorEntry("v", (5,), v.dtype, Role.PARAM, (Piece("", 0, v.dtype, 0, 5, value=v),))
    runs = [Run(ea, 7, 8990, out_dtype), Run(None, 0, 3, out_dtype), Run(eb, 0, 777, out_dtype),
            Run(ev, 1, 4, out_dtype), Run(ea, 0, 5, out_dtype)]  # fmt: skip
    want = b"".join(
        x.to(out_dtype).contiguous().view(torch.uint8).numpy().tobytes()
        for x in (a[7:8997], torch.zeros(3), b.float(), v[1:5], a[:5])
    )
    head = b"h" * 13  # the header written before: the first piece completes the device buffer
    opts = direct_io.WriteOptions(buf_bytes=8192, buffers=3)
    path = tmp_path / "out.bin"
    sink = HashingSink(path, opts, block=4096)
    small = Layout([Run(eb, 3, 50, out_dtype)])  # records back to back: big, small, big on one sink
    small_want = b[3:53].to(out_dtype).contiguous().view(torch.uint8).numpy().tobytes()
    try:
        sink.write(head)
        crcs = [
            pipeline.fill(sink, lay, workers=workers, crc=True) for lay in (Layout(runs), small, Layout(runs))
        ]
    finally:
        sink.close()
    data = path.read_bytes()
    assert data == head + want + small_want + want
    assert crcs == [zlib.crc32(want), zlib.crc32(small_want), zlib.crc32(want)]
    blocks = sink.digest().blocks
    assert list(blocks) == [f"{zlib.crc32(data[i : i + 4096]):08x}" for i in range(0, len(data), 4096)]


@pytest.mark.parametrize("remote", [False, True])
def test_fill_of_an_object_source_runs_on_one_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remote: bool
) -> None:
    """An object-store source is filled by ``REMOTE_WORKERS`` (1) threads when no count is asked for, a
    local one by ``default_workers()`` (here 4, ``ZCKPT_WORKERS``): with more fill threads, readers far
    apart in one record overflowed its read-ahead stream's windows, which were fetched again
    (``bench/s3_bench.py``: 1.02-1.35x the bytes needed, 2-4x the wall; RESULTS "18:50"). Oracle: the
    threads that ran ``Layout.fill``, and the bytes written against torch's."""
    from zckpt.storage import direct_io
    from zckpt.stream.fill import Layout, Run

    is_remote = remote

    class Source(Layout):
        remote = is_remote  # type: ignore[assignment]  # what an s3:// piece makes it (no server needed)

    monkeypatch.setenv("ZCKPT_WORKERS", "4")
    monkeypatch.setattr(fileio, "expect", lambda *a, **k: None)  # an object's stream start: none here
    ran: set[str] = set()
    real = Layout.fill

    def fill(self: Layout, dst: object, lo: int) -> None:
        ran.add(threading.current_thread().name)
        real(self, dst, lo)  # type: ignore[arg-type]

    monkeypatch.setattr(Layout, "fill", fill)
    a = torch.randn(64 << 10, generator=torch.Generator().manual_seed(2))  # 256 KiB: 32 pieces of 8 KiB
    e = _file_entry(tmp_path, "a", a, [0, 30000, 65536])
    sink = HashingSink(tmp_path / "out.bin", direct_io.WriteOptions(buf_bytes=8192, buffers=3), block=4096)
    try:
        pipeline.fill(sink, Source([Run(e, 0, a.numel(), torch.float32)]), crc=False)
    finally:
        sink.close()
    assert (tmp_path / "out.bin").read_bytes() == a.numpy().tobytes()
    fillers = {n for n in ran if n.startswith("zckpt-fill")}
    assert len(fillers) == 1 if remote else len(fillers) > 1, ran
