"""Zip archives that repeat the structure of one already checked: recognised with a few C calls each.

A DCP file holds one ``torch.save`` archive per tensor chunk, and every chunk of one size is written by the
same code: its end record, central directory, local headers, names and data descriptors are the same bytes,
but for each record's CRC-32 and the small records' contents (the pickle, the serialization id). Parsing
each through ``zckpt.codecs.zipdir`` costs ~70 µs of Python, and a world-64 checkpoint holds over 100k of
them.

``learn`` takes an archive that ``zipdir.read`` parsed and that passes every check of ``zipdir.data_start``,
``entry_problem`` and ``end_problem``, and records its *shape*: the archive's bytes as fields of one
``struct`` per region read (the head, and the tail after its one big record, if it has one), each field a
constant (every structural byte), a CRC-32 (of the central directory or a data descriptor) or a small
record's bytes. ``known`` reads an archive of the same length and end record, unpacks those regions and
accepts it only when every constant is equal, every descriptor's CRC-32 equals its directory entry's and
every small record's bytes have their CRC-32: then ``zipdir``'s parse and checks would give the learned
archive's answers with these CRC-32s, which ``Known`` carries (the end records, zip64 ones included, are
constants). Anything else (another writer's layout, zip64 sizes, damage) is None: the caller parses it in
full, and so reports damage exactly as before.
"""

from __future__ import annotations

import operator
import struct
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from zckpt.codecs import zipdir
from zckpt.storage import session

_EOCD = 22
_CD_CRC = 16
"""Where a central-directory entry's CRC-32 field lies, from the entry's start."""
_DESCRIPTOR = b"PK\x07\x08"
_REGION = 16 << 10
"""Longest region (head or tail) a shape reads; an archive with more bytes outside its one big record is not
learned."""
_SMALL = 4 << 10
"""Records up to this size are read with their region (and CRC-checked by ``known``); one bigger record (the
tensor's storage) is the gap between the two regions."""


@dataclass(frozen=True, slots=True)
class Known:
    """An archive of a learned shape: its records as ``(data start, size, CRC-32)`` in directory order (the
    CRC-32s its own), and the bytes of every record but ``gap``, each checked against its CRC-32."""

    directory: zipdir.Directory
    """The learned archive's directory: names, offsets and sizes are this one's too, CRC-32s are not."""
    records: dict[str, tuple[int, int, int]]
    datas: dict[str, bytes]
    gap: str | None
    """The one record whose bytes were not read (None when the archive was read whole)."""


def _getter(idx: list[int]) -> Callable[[tuple[object, ...]], tuple[object, ...]]:
    if not idx:
        return lambda v: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda v: (v[i],)
    return operator.itemgetter(*idx)


@dataclass(frozen=True, slots=True)
class _Region:
    at: int
    size: int
    fields: struct.Struct
    constants: Callable[[tuple[object, ...]], tuple[object, ...]]
    expected: tuple[object, ...]


@dataclass(frozen=True, slots=True)
class _Shape:
    directory: zipdir.Directory
    regions: tuple[_Region, ...]
    names: tuple[str, ...]
    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    cd_crcs: Callable[[tuple[object, ...]], tuple[object, ...]]
    """Each entry's central-directory CRC-32, from the regions' fields (concatenated)."""
    descriptor_crcs: Callable[[tuple[object, ...]], tuple[object, ...]]
    small: tuple[tuple[str, int, int], ...]
    """(name, field of its bytes, entry index) of every record read with a region."""
    gap: str | None


def _shapes() -> dict[tuple[int, bytes], _Shape | int]:
    """The running operation's learned shapes (its ``Storage.cache("zipshape")``), by the archive's length
    and end record (which fix the central directory's size and place); for one not learnable, how many
    archives with that key failed (one damaged archive does not stop the next from being learned;
    ``_TRIES`` failures do)."""
    return session.current().cache("zipshape")


_TRIES = 8
_MAX = 512
_LOCK = threading.Lock()
"""Serialises updates of a shapes cache between the threads of one operation."""


def known(pread: zipdir.Pread, length: int) -> Known | None:
    """The archive of ``length`` bytes read through ``pread`` when it has a learned shape (see the module
    doc), else None."""
    if length < _EOCD:
        return None
    s = _shapes().get((length, pread(_EOCD, length - _EOCD)))
    if s is None or isinstance(s, int):
        return None
    vals: tuple[object, ...] = ()
    for r in s.regions:
        try:
            got = r.fields.unpack_from(pread(r.size, r.at))
        except struct.error:  # fewer bytes than the shape's
            return None
        if r.constants(got) != r.expected:
            return None
        vals += got
    crcs = s.cd_crcs(vals)
    if s.descriptor_crcs(vals) != crcs:
        return None
    datas = {}
    for name, field, k in s.small:
        data = vals[field]
        if zlib.crc32(data) != crcs[k]:  # type: ignore[arg-type]
            return None
        datas[name] = data
    records = {n: (a, z, c) for n, a, z, c in zip(s.names, s.starts, s.sizes, crcs, strict=True)}
    return Known(s.directory, records, datas, s.gap)  # type: ignore[arg-type]


def learn(pread: zipdir.Pread, length: int, d: zipdir.Directory) -> None:
    """Remember the shape of the archive read through ``pread`` (``d``: ``zipdir.read``'s parse of it) for
    ``known``, if it passes every check in full and is laid out as torch writes (each record's CRC-32 and
    sizes in a signed data descriptor after it, no zip64 extra fields, no comment, at most one record over
    4 KiB); else count a failure for its key."""
    if length < _EOCD:
        return
    key = (length, pread(_EOCD, length - _EOCD))
    shapes = _shapes()
    failed = shapes.get(key, 0)
    if not isinstance(failed, int) or failed >= _TRIES:
        return
    try:
        shape: _Shape | int | None = _shape(pread, length, d)
    except (zipdir.ZipError, struct.error, ValueError):
        shape = None
    with _LOCK:
        while len(shapes) >= _MAX:
            del shapes[next(iter(shapes))]
        shapes[key] = shape if shape is not None else failed + 1


def _shape(pread: zipdir.Pread, length: int, d: zipdir.Directory) -> _Shape | None:
    entries = list(d.entries.values())
    end = length - _EOCD
    if pread(4, end) != b"PK\x05\x06" or zipdir.end_problem(pread, length, len(entries), d.start_dir):
        return None
    cd = pread(end - d.start_dir, d.start_dir)  # (and the zip64 end records torch writes after it)
    # variable spans: (offset, size, kind, entry index); kind "c": directory CRC-32, "d": descriptor CRC-32,
    # "b": a small record's bytes
    spans: list[tuple[int, int, str, int]] = []
    starts, big = [], []
    p = 0
    for k, e in enumerate(entries):
        if not e.flag_bits & 0x8 or e.file_size >= 0xFFFFFFFF or e.header_offset >= 0xFFFFFFFF:
            return None
        start = zipdir.data_start(e, pread(zipdir.LOCAL_HEADER.size + len(e.orig), e.header_offset), length)
        if zipdir.entry_problem(pread, length, e) is not None:
            return None
        if pread(4, start + e.compress_size) != _DESCRIPTOR:
            return None
        starts.append(start)
        spans.append((d.start_dir + p + _CD_CRC, 4, "c", k))
        spans.append((start + e.compress_size + 4, 4, "d", k))
        if e.file_size > _SMALL:
            big.append(k)
        else:
            spans.append((start, e.file_size, "b", k))
        f = struct.unpack_from("<28xHHH", cd, p)
        p += 46 + f[0] + f[1] + f[2]
    if len(big) > 1:
        return None
    if big:
        g = entries[big[0]]
        cut = (starts[big[0]], starts[big[0]] + g.file_size)
        bounds = [(0, cut[0]), (cut[1], length)]
    else:
        bounds = [(0, length)]
    if any(hi - lo > _REGION for lo, hi in bounds):
        return None
    spans.sort()
    regions, field_of = [], {}
    n_fields = 0
    for lo, hi in bounds:
        fmt, constants, pos = ["<"], [], lo
        mine = [s for s in spans if lo <= s[0] < hi]
        for at, size, kind, k in mine:
            if at < pos or at + size > hi:  # overlapping spans: not a layout torch writes
                return None
            if at > pos:
                fmt.append(f"{at - pos}s")
                constants.append(n_fields + len(fmt) - 2)
            fmt.append("I" if kind != "b" else f"{size}s")
            field_of[(kind, k)] = n_fields + len(fmt) - 2
            pos = at + size
        if pos < hi:
            fmt.append(f"{hi - pos}s")
            constants.append(n_fields + len(fmt) - 2)
        st = struct.Struct("".join(fmt))
        local = [c - n_fields for c in constants]
        got = st.unpack_from(pread(hi - lo, lo))
        regions.append(_Region(lo, hi - lo, st, _getter(local), _getter(local)(got)))
        n_fields += len(fmt) - 1
    names = tuple(e.filename for e in entries)
    small = tuple((entries[k].filename, field_of[("b", k)], k) for k in range(len(entries)) if k not in big)
    return _Shape(
        d,
        tuple(regions),
        names,
        tuple(starts),
        tuple(e.file_size for e in entries),
        _getter([field_of[("c", k)] for k in range(len(entries))]),
        _getter([field_of[("d", k)] for k in range(len(entries))]),
        small,
        entries[big[0]].filename if big else None,
    )


__all__ = ["Known", "known", "learn"]
