"""Byte maps of checkpoint files: which byte ranges of a file are what, and which a checksum covers.

Owns the parsing the mutators aim with: a torch zip archive splits into local headers (fixed part, name,
extra/padding), records (``data.pkl``, storages, small text records), the central directory (entries and
their names) and the end records; a safetensors file into its length word, JSON header and one range per
tensor; anything else is one ``text`` range. Coverage follows the format: every zip record payload has a
CRC-32 in the directory; a whole-file checksum (native ``manifest.json`` sha256, a ``.sha256`` sidecar)
covers every byte. Tensor payload ranges are marked ``value``: damage there changes numbers, not structure.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")


@dataclass(frozen=True)
class Region:
    """Bytes ``[start, end)`` of one file: what they are and whether a checksum covers them."""

    start: int
    end: int
    kind: str
    name: str = ""
    checksummed: bool = False
    value: bool = False

    @property
    def size(self) -> int:
        return self.end - self.start


def is_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def file_regions(path: Path, *, whole_file_checksum: bool = False) -> list[Region]:
    """The regions of ``path`` in file order, gaps included; ``whole_file_checksum`` marks them all."""
    data = path.read_bytes()
    if data[:4] == b"PK\x03\x04":
        regs = zip_regions(path, data)
    elif path.suffix == ".safetensors":
        regs = safetensors_regions(data)
    else:
        regs = [Region(0, len(data), "text")]
    regs = _fill_gaps(regs, len(data))
    if whole_file_checksum:
        regs = [dataclasses.replace(r, checksummed=True) for r in regs]
    return regs


def _fill_gaps(regs: list[Region], size: int) -> list[Region]:
    out: list[Region] = []
    pos = 0
    for r in sorted(regs, key=lambda r: r.start):
        if r.start > pos:
            out.append(Region(pos, r.start, "gap"))
        out.append(r)
        pos = max(pos, r.end)
    if pos < size:
        out.append(Region(pos, size, "gap"))
    return [r for r in out if r.size > 0]


# ---- torch zip archives ------------------------------------------------------------------------------
def zip_regions(path: Path, data: bytes) -> list[Region]:
    regs: list[Region] = []
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        start_dir = zf.start_dir
    for info in infos:
        regs += _local_regions(data, info)
    regs += _central_regions(data, start_dir)
    return regs


def _local_regions(data: bytes, info: zipfile.ZipInfo) -> list[Region]:
    at = info.header_offset
    fields = _LOCAL.unpack_from(data, at)
    n, m = fields[9], fields[10]
    name_at, extra_at, data_at = at + _LOCAL.size, at + _LOCAL.size + n, at + _LOCAL.size + n + m
    is_storage = "/data/" in info.filename and not info.filename.endswith(".pkl")
    return [
        Region(at, name_at, "zip-local-header", info.filename),
        Region(name_at, extra_at, "zip-local-name", info.filename),
        Region(extra_at, data_at, "zip-local-extra", info.filename),
        Region(data_at, data_at + info.file_size, "zip-record", info.filename, True, is_storage),
    ]


def _central_regions(data: bytes, start_dir: int) -> list[Region]:
    regs: list[Region] = []
    at = start_dir
    while data[at : at + 4] == b"PK\x01\x02":
        f = _CENTRAL.unpack_from(data, at)
        n, m, k = f[10], f[11], f[12]
        name = data[at + _CENTRAL.size : at + _CENTRAL.size + n].decode("utf-8", "replace")
        regs.append(Region(at, at + _CENTRAL.size, "zip-dir-entry", name))
        regs.append(Region(at + _CENTRAL.size, at + _CENTRAL.size + n, "zip-dir-name", name))
        end = at + _CENTRAL.size + n + m + k
        if m + k:
            regs.append(Region(at + _CENTRAL.size + n, end, "zip-dir-extra", name))
        at = end
    if at < len(data):
        regs.append(Region(at, len(data), "zip-end"))
    return regs


# ---- safetensors -------------------------------------------------------------------------------------
def safetensors_header(data: bytes) -> tuple[dict[str, object], int]:
    """(parsed header, data start) of a well-formed safetensors file."""
    (n,) = struct.unpack_from("<Q", data, 0)
    return json.loads(data[8 : 8 + n]), 8 + n


def safetensors_regions(data: bytes) -> list[Region]:
    header, start = safetensors_header(data)
    regs = [Region(0, 8, "st-length"), Region(8, start, "st-header")]
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        lo, hi = info["data_offsets"]
        regs.append(Region(start + lo, start + hi, "st-tensor", name, False, True))
    return regs


def pack_safetensors(header: dict[str, object], payload: bytes) -> bytes:
    """A safetensors file from a header (any JSON, written as is) and the data section."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + payload
