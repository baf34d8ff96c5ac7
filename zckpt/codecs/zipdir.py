"""A zip archive's directory, parsed with ``struct``: the end record (and its zip64 locator and record), every
central-directory entry (zip64 extra fields included), and a record's local header, checked against them.

This is what ``zipfile.ZipFile`` gives a reader of a ``torch.save`` archive, without its per-archive cost: a
DCP checkpoint holds tens of thousands of small archives, one per tensor chunk and per value, and opening each
through ``zipfile`` cost ~0.4 ms of Python. Stricter than ``zipfile`` where torch's own writer leaves no
choice: no bytes before the archive, one disk, every entry where the end record says, no duplicate names.
Damage raises ``ZipError`` with a short reason (``zckpt.codecs.torchzip`` turns it into one error line).
``entry_problem`` and ``end_problem`` are verify's field-by-field comparisons (a finding as text, no raise).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

_EOCD = struct.Struct("<4s4H2LH")
_LOC64 = struct.Struct("<4sLQL")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_CDIR = struct.Struct("<4s4B4HL2L5H2L")
LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_MAX_COMMENT = 0xFFFF
_U32, _U16 = 0xFFFFFFFF, 0xFFFF

Pread = Callable[[int, int], bytes]
"""``pread(n, at)``: up to ``n`` bytes at offset ``at`` of the archive (fewer at its end)."""


class ZipError(ValueError):
    """The bytes are not a readable zip archive (the message says why, briefly)."""


class Entry(NamedTuple):
    """One central-directory entry (field names as ``zipfile.ZipInfo``'s, sizes and offset zip64-resolved; a
    named tuple: tens of thousands are built per checkpoint)."""

    filename: str
    orig: bytes
    header_offset: int
    compress_size: int
    file_size: int
    CRC: int  # noqa: N815 - zipfile's name
    compress_type: int
    flag_bits: int
    extract_version: int
    volume: int
    comment: bytes


@dataclass(frozen=True, slots=True)
class Directory:
    entries: dict[str, Entry]
    """By name, in directory order."""
    start_dir: int
    """Where the central directory starts."""


def read(pread: Pread, length: int) -> Directory:
    """The directory of the zip archive of ``length`` bytes read through ``pread``."""
    if length < _EOCD.size:
        raise ZipError("no zip end record")
    end = length - _EOCD.size
    rec = pread(_EOCD.size, end)
    if rec[:4] != b"PK\x05\x06":  # a comment after the end record: look back for its signature
        lo = max(0, length - _EOCD.size - _MAX_COMMENT)
        tail = pread(length - lo, lo)
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or len(tail) - at < _EOCD.size:
            raise ZipError("File is not a zip file")
        end, rec = lo + at, tail[at : at + _EOCD.size]
    _, disk, disk_cd, n_disk, count, size_cd, start_dir, comment = _EOCD.unpack(rec)
    if end + _EOCD.size + comment != length:
        raise ZipError("zip end record comment length does not match the archive's end")
    cd_end = end
    loc = end - _LOC64.size
    if loc >= _EOCD64.size and pread(4, loc) == b"PK\x06\x07":
        _, d64, at64, disks = _LOC64.unpack(pread(_LOC64.size, loc))
        if d64 or disks != 1 or at64 != loc - _EOCD64.size:
            raise ZipError("zip64 end locator damaged")
        z = _EOCD64.unpack(pread(_EOCD64.size, at64))
        if z[0] != b"PK\x06\x06" or z[1] != _EOCD64.size - 12 or z[4] or z[5]:
            raise ZipError("zip64 end record damaged")
        for v32, v64, full in (
            (n_disk, z[6], _U16),
            (count, z[7], _U16),
            (size_cd, z[8], _U32),
            (start_dir, z[9], _U32),
        ):
            if v32 not in (v64, full):
                raise ZipError("the zip end record and its zip64 record disagree")
        n_disk, count, size_cd, start_dir = z[6], z[7], z[8], z[9]
        cd_end = at64
    if disk or disk_cd or n_disk != count:
        raise ZipError("multi-disk zip archives are not supported")
    if start_dir + size_cd != cd_end:
        raise ZipError("the central directory is not where the end record says (bytes before the archive?)")
    cd = pread(size_cd, start_dir)
    if len(cd) != size_cd:
        raise ZipError("central directory truncated")
    return Directory(_entries(cd, count), start_dir)


def _entries(cd: bytes, count: int) -> dict[str, Entry]:
    out: dict[str, Entry] = {}
    p = 0
    for _ in range(count):
        if p + _CDIR.size > len(cd):
            raise ZipError("central directory truncated")
        f = _CDIR.unpack_from(cd, p)
        if f[0] != b"PK\x01\x02":
            raise ZipError("bad magic number for central directory")
        nlen, xlen, clen = f[12], f[13], f[14]
        q = p + _CDIR.size
        if q + nlen + xlen + clen > len(cd):
            raise ZipError("central directory entry runs past the directory")
        orig = cd[q : q + nlen]
        flags = f[5]
        csize, usize, offset = _zip64(cd[q + nlen : q + nlen + xlen], f[10], f[11], f[18])
        try:
            name = orig.decode("utf-8") if flags & 0x800 or orig.isascii() else orig.decode("cp437")
        except UnicodeDecodeError:
            raise ZipError("record name is not valid UTF-8") from None
        if name in out:
            raise ZipError(f"two records named {name!r:.60}")
        out[name] = Entry(
            name,
            orig,
            offset,
            csize,
            usize,
            f[9],
            f[6],
            flags,
            f[3],
            f[15],
            cd[q + nlen + xlen : q + nlen + xlen + clen],
        )
        p = q + nlen + xlen + clen
    if p != len(cd):
        raise ZipError("central directory holds more than its entry count")
    return out


def _zip64(extra: bytes, csize: int, usize: int, offset: int) -> tuple[int, int, int]:
    """Sizes and local header offset, the ones at 0xFFFFFFFF taken from the zip64 extra field (in the order
    the format gives: uncompressed size, compressed size, offset)."""
    if _U32 not in (csize, usize, offset):
        return csize, usize, offset
    p = 0
    while p + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, p)
        if p + 4 + n > len(extra):
            break
        if tag == 1:
            vals = list(struct.unpack_from(f"<{n // 8}Q", extra, p + 4))
            try:
                if usize == _U32:
                    usize = vals.pop(0)
                if csize == _U32:
                    csize = vals.pop(0)
                if offset == _U32:
                    offset = vals.pop(0)
            except IndexError:
                raise ZipError("Corrupt extra field 0001 (too short)") from None
            return csize, usize, offset
        p += 4 + n
    raise ZipError("a size or offset is 0xFFFFFFFF but the record has no zip64 extra field")


def data_start(e: Entry, head: bytes, length: int) -> int:
    """Where ``e``'s bytes start in its archive of ``length`` bytes, from ``head``: at least the local header
    and its name, read at ``e.header_offset``. The header must carry ``e``'s name, and a CRC-32 and size that
    are ``e``'s or the 0s/0xFFFFFFFF torch writes there (a data descriptor, zip64 sizes)."""
    if len(head) < LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
        raise ZipError(f"broken zip record header for {e.filename!r:.80}")
    h = LOCAL_HEADER.unpack_from(head)
    nlen, xlen = h[9], h[10]
    if head[LOCAL_HEADER.size : LOCAL_HEADER.size + nlen] != e.orig:
        shown = head[LOCAL_HEADER.size : LOCAL_HEADER.size + min(nlen, 60)]
        raise ZipError(f"local header name {shown!r} differs from the directory")
    crc, size = h[6], h[8]
    if crc not in (0, e.CRC) or size not in (0, _U32, e.file_size):
        raise ZipError(
            f"zip record {e.filename!r:.80}: its local header disagrees with the central directory "
            "(size or CRC-32)"
        )
    start = e.header_offset + LOCAL_HEADER.size + nlen + xlen
    if start + e.compress_size > length:
        raise ZipError(f"record {e.filename!r:.80} runs past the end of its archive")
    return start


# ---- verify: every field a reader may use, compared (a finding, not an exception) ----------------------
def entry_problem(pread: Pread, length: int, info: Entry) -> str | None:
    """A directory entry and its local header (and data descriptor, which torch writes) agree on everything a
    reader may use (version needed, flags, method, CRC-32, sizes, name) and describe a plain stored record
    (no comment, disk 0); ``zipfile`` reads only some of these. Timestamps, "version made by" and file
    attributes are not checked (no reader uses them)."""
    if info.header_offset + LOCAL_HEADER.size > length:
        return "local header outside the archive"
    h = LOCAL_HEADER.unpack(pread(LOCAL_HEADER.size, info.header_offset))
    _, needed, flags, method, _, _, crc, csize, usize, nlen, xlen = h
    tail = pread(nlen + xlen, info.header_offset + LOCAL_HEADER.size)
    name, extra = tail[:nlen], tail[nlen:]
    if info.compress_type != 0 or info.compress_size != info.file_size:
        return "not a stored record (compression method or sizes damaged)"
    if info.comment or info.volume or info.flag_bits & ~0x808:
        return "directory entry damaged (comment, disk number or flags)"
    if (needed, flags, method) != (info.extract_version, info.flag_bits, info.compress_type):
        return "directory entry and local header disagree (version needed, flags or method)"
    if name != info.orig:
        return "directory entry and local header name different records"
    if flags & 0x8:  # CRC-32 and sizes follow the data, in a data descriptor; the local fields are 0
        if crc or csize or usize:
            return "local header CRC-32 or sizes set beside a data descriptor"
        at = info.header_offset + LOCAL_HEADER.size + nlen + xlen + info.compress_size
        raw = pread(24, at)
        raw = raw[4:] if raw[:4] == b"PK\x07\x08" else raw
        crc = int.from_bytes(raw[:4], "little")
        wide = info.file_size >= 0xFFFFFFFF or info.header_offset >= 0xFFFFFFFF
        w = 8 if wide else 4
        csize, usize = (
            int.from_bytes(raw[4 : 4 + w], "little"),
            int.from_bytes(raw[4 + w : 4 + 2 * w], "little"),
        )
    if not _extra_well_formed(extra):
        return "local header's extra field malformed (its fields' sizes do not add up)"
    if not flags & 0x8 and csize == usize == 0xFFFFFFFF:  # zip64: the sizes live in the local extra field
        csize, usize = info.compress_size, info.file_size
    if (crc, csize, usize) != (info.CRC, info.compress_size, info.file_size):
        return "directory entry and local header disagree (CRC-32 or sizes)"
    return None


def _extra_well_formed(extra: bytes) -> bool:
    """Whether an extra field's parts (header id, size, data: torch writes its alignment padding as one, id
    ``FB``) fill it exactly, as readers that walk the parts (libzip) require; up to 3 zero bytes at the end
    are allowed, as libzip allows zipalign's padding."""
    at = 0
    while at + 4 <= len(extra):
        at += 4 + int.from_bytes(extra[at + 2 : at + 4], "little")
    return at == len(extra) or (at < len(extra) and not any(extra[at:]))


def end_problem(pread: Pread, length: int, entries: int, start_dir: int) -> str | None:
    """The end records of an archive that ends exactly at ``offset + length`` (as each DCP item does): every
    field a reader may use (disk numbers, entry counts, directory size and offset, the zip64 locator) agrees
    with the directory actually found; ``zipfile`` ignores most of them, other readers do not."""
    if length < _EOCD.size:
        return "no zip end record"
    sig, disk, disk_cd, n1, n2, size32, off32, comment = _EOCD.unpack(pread(_EOCD.size, length - _EOCD.size))
    if sig != b"PK\x05\x06" or disk or disk_cd or comment:
        return "zip end record damaged (signature, disk numbers or comment length)"
    end, loc = length - _EOCD.size, length - _EOCD.size - _LOC64.size
    if loc >= _EOCD64.size and pread(4, loc) == b"PK\x06\x07":
        _, d, at64, disks = _LOC64.unpack(pread(_LOC64.size, loc))
        if d or disks != 1 or at64 != loc - _EOCD64.size:
            return "zip64 end locator damaged"
        z = _EOCD64.unpack(pread(_EOCD64.size, at64))
        if z[0] != b"PK\x06\x06" or z[1] != _EOCD64.size - 12 or z[4] or z[5]:
            return "zip64 end record damaged (signature, size or disk numbers)"
        if z[6] != entries or z[7] != entries or z[8] != at64 - start_dir or z[9] != start_dir:
            return "zip64 end record disagrees with the central directory (entries, size or offset)"
        end = at64
        counts_ok = n1 in (entries, 0xFFFF) and n2 in (entries, 0xFFFF)
        dir_ok = size32 in (end - start_dir, 0xFFFFFFFF) and off32 in (start_dir, 0xFFFFFFFF)
    else:
        counts_ok, dir_ok = n1 == n2 == entries, size32 == end - start_dir and off32 == start_dir
    if not (counts_ok and dir_ok):
        return "zip end record disagrees with the central directory (entries, size or offset)"
    return None


__all__ = [
    "LOCAL_HEADER", "Directory", "Entry", "Pread", "ZipError",
    "data_start", "end_problem", "entry_problem", "read",
]  # fmt: skip
