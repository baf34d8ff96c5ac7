"""``zckpt.codecs.zipshape``: an archive recognised by its learned shape must parse as the full path parses
it.

The oracle is ``zckpt.codecs.zipdir`` itself (checked against ``zipfile`` in ``test_pickle_scan_zipdir.py``):
whenever ``known`` accepts an archive, ``zipdir.read``, ``data_start``, ``entry_problem`` and ``end_problem``
on the same bytes give the same records, CRC-32s included, and no finding, and every small record's bytes
match their CRC-32. Checked on real ``torch.save`` archives (big and small tensors) and on zckpt's own DCP
writer's, then on every single-byte change of an archive outside its tensor bytes: each is either refused
(None: the caller parses it in full) or one the full path reads the same way.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from zckpt.codecs import zipdir, zipshape
from zckpt.formats.dcp.metadata import load_metadata
from zckpt.storage.session import Storage


@pytest.fixture(autouse=True)
def _one_operation() -> Iterator[None]:
    """Each test is one operation: it learns its own shapes (they belong to the operation's Storage)."""
    st = Storage()
    with st.bound():
        yield
    st.close()


def _torch_archive(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _reader(data: bytes) -> zipdir.Pread:
    return lambda n, at: data[at : at + n]


def _full(data: bytes) -> dict[str, tuple[int, int, int]] | None:
    """The full path's records, or None where it refuses or finds anything."""
    try:
        d = zipdir.read(_reader(data), len(data))
        out = {}
        for name, e in d.entries.items():
            head = data[e.header_offset : e.header_offset + 30 + len(e.orig)]
            start = zipdir.data_start(e, head, len(data))
            if zipdir.entry_problem(_reader(data), len(data), e) is not None:
                return None
            out[name] = (start, e.file_size, e.CRC)
        if zipdir.end_problem(_reader(data), len(data), len(d.entries), d.start_dir) is not None:
            return None
    except zipdir.ZipError:
        return None
    return out


def _agrees(data: bytes, k: zipshape.Known) -> bool:
    full = _full(data)
    if full is None or full != k.records or list(full) != list(k.directory.entries):
        return False
    return all(zlib.crc32(b) == k.records[n][2] and data[k.records[n][0] :][: len(b)] == b
               for n, b in k.datas.items())  # fmt: skip


def _learned(first: bytes) -> None:
    d = zipdir.read(_reader(first), len(first))
    zipshape.learn(_reader(first), len(first), d)


@pytest.mark.parametrize("numel", [3, 5000])  # read whole, and a tensor record between two regions
def test_known_matches_the_full_parse_on_real_torch_archives(numel: int) -> None:
    a, b = _torch_archive(torch.arange(float(numel))), _torch_archive(torch.ones(numel))
    assert len(a) == len(b) and a != b
    _learned(a)
    for data in (a, b):
        k = zipshape.known(_reader(data), len(data))
        assert k is not None and _agrees(data, k)
        assert (k.gap is not None) == (numel * 4 > 4096)
    other = _torch_archive(torch.arange(float(numel + 1)))  # another length: not this shape
    assert zipshape.known(_reader(other), len(other)) is None


def test_every_byte_change_is_refused_or_read_as_the_full_path_reads_it() -> None:
    base = _torch_archive(torch.arange(3000.0))  # 12 kB of tensor bytes: two regions
    _learned(base)
    k0 = zipshape.known(_reader(base), len(base))
    assert k0 is not None and k0.gap is not None
    start, size, _ = k0.records[k0.gap]
    accepted = refused = 0
    for at in [*range(start), *range(start + size, len(base))]:
        for delta in (0x01, 0x80):
            data = bytearray(base)
            data[at] ^= delta
            k = zipshape.known(_reader(bytes(data)), len(data))
            if k is None:
                refused += 1
                continue
            accepted += 1
            assert _agrees(bytes(data), k), (at, delta)
    # the extra fields' padding and timestamps are free bytes no reader uses; everything else is structure
    assert refused > 0.9 * (refused + accepted)


def test_a_changed_crc_must_change_in_the_directory_and_descriptor_alike() -> None:
    base = _torch_archive(torch.arange(2000.0))
    _learned(base)
    k = zipshape.known(_reader(base), len(base))
    assert k is not None and k.gap is not None
    start, size, crc = k.records[k.gap]
    other = bytearray(base)
    other[start] ^= 1  # the tensor's bytes change: both CRC-32 copies must follow
    new = zlib.crc32(bytes(other[start : start + size]))
    stale = zipshape.known(_reader(bytes(other)), len(other))  # its bytes unread: the old CRC-32s agree
    assert stale is not None and stale.records[k.gap][2] == crc
    d = zipdir.read(_reader(base), len(base))
    at_cd = d.start_dir + bytes(base[d.start_dir :]).find(k.gap.encode()) - 46 + 16
    one = bytearray(other)
    one[at_cd : at_cd + 4] = new.to_bytes(4, "little")  # the directory alone
    assert zipshape.known(_reader(bytes(one)), len(one)) is None
    both = bytearray(one)
    desc = start + size + 4
    both[desc : desc + 4] = new.to_bytes(4, "little")
    k2 = zipshape.known(_reader(bytes(both)), len(both))
    assert k2 is not None and k2.records[k.gap][2] == new and _agrees(bytes(both), k2)


def test_a_damaged_first_archive_does_not_stop_its_shape_being_learned() -> None:
    good = _torch_archive(torch.arange(10.0))
    bad = bytearray(good)
    bad[31] ^= 1  # a letter of the first local header's name: data_start refuses it, the directory reads
    assert _full(bytes(bad)) is None
    _learned(bytes(bad))  # not learnable: counted, not remembered
    assert zipshape.known(_reader(good), len(good)) is None
    _learned(good)
    assert zipshape.known(_reader(good), len(good)) is not None
    assert zipshape.known(_reader(bytes(bad)), len(bad)) is None


def test_zckpt_written_dcp_archives(tmp_path: Path) -> None:
    """The archives zckpt's own DCP writer makes (``reshard --to dcp``) are learned and recognised too."""
    from zckpt.ops.reshard import reshard

    src = Path(__file__).parent.parent / "fixtures" / "dcp" / "fsdp2_bf16_w3" / "checkpoint"
    out = tmp_path / "w4"
    reshard(src, out, world=4, to="dcp")
    md = load_metadata(out)
    seen = hits = 0
    for info in sorted(md.storage.values(), key=lambda i: (i.file, i.offset)):
        data = (out / info.file).read_bytes()[info.offset : info.offset + info.length]
        k = zipshape.known(_reader(data), len(data))
        if k is None:
            d = zipdir.read(_reader(data), len(data))
            zipshape.learn(_reader(data), len(data), d)
        else:
            hits += 1
            assert _agrees(data, k)
        seen += 1
    assert hits > seen // 2, (hits, seen)


def test_local_extra_field_sizes_are_checked_and_its_padding_is_not() -> None:
    """Torch pads each record's data to 64 bytes with a local extra field (id ``FB``, size, ``Z`` bytes).
    Readers that walk the extra field's parts (libzip) refuse an archive whose part sizes do not fill it, so
    verify (``entry_problem``) reports every flip of the size; the id and the padding are read by no reader
    of torch archives (zipfile and torch's miniz skip the field by the header's length), so flips there are
    no finding (found by the hostile-input suite, seed 440: verify said OK on a flipped size)."""
    data = _torch_archive(torch.arange(40, dtype=torch.float32))
    d = zipdir.read(_reader(data), len(data))
    e = next(e for e in d.entries.values() if "/data/" in e.filename)
    h = zipdir.LOCAL_HEADER.unpack_from(data, e.header_offset)
    nlen, xlen = h[9], h[10]
    at = e.header_offset + zipdir.LOCAL_HEADER.size + nlen
    assert xlen >= 4 and data[at : at + 2] == b"FB", data[at : at + 4]
    assert _full(data) is not None
    for i in range(xlen):
        for bit in range(8):
            bad = bytearray(data)
            bad[at + i] ^= 1 << bit
            problem = zipdir.entry_problem(_reader(bytes(bad)), len(bad), e)
            if 2 <= i < 4:  # the size
                assert problem is not None and "extra field malformed" in problem, (i, bit)
            else:
                assert problem is None, (i, bit, problem)
