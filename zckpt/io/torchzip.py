"""Reading ``torch.save`` zip archives without ``torch.load``: structure and byte offsets only.

A torch zip archive holds ``<prefix>/data.pkl`` (the pickled object, tensors as persistent ids) and
one uncompressed record ``<prefix>/data/<key>`` per storage. ``load_refs`` unpickles ``data.pkl``
through ``SafeUnpickler`` and fills every ``TensorRef`` with its file and absolute byte offset, so a
reader can later fetch any tensor's bytes (and only those) through ``zckpt.io.storage``.
"""

from __future__ import annotations

import os
import struct
import zipfile
from typing import Any

from zckpt.errors import CorruptCheckpoint, Unsupported
from zckpt.io.pickle_safe import TensorRef, _Record, safe_loads

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")


def is_torch_zip(path: str) -> bool:
    try:
        return zipfile.is_zipfile(path)
    except OSError:
        return False


def record_offsets(path: str) -> tuple[str, dict[str, tuple[int, int]], zipfile.ZipFile]:
    """(prefix, {record name: (data offset, size)}, open ZipFile) of a torch zip archive."""
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise CorruptCheckpoint(
            f"{path}: not a readable torch zip archive ({e}); the file may be truncated",
            hint="re-copy the file, or check the save finished",
            path=path,
        ) from None
    infos = zf.infolist()
    pkl = [i.filename for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
    if not pkl:
        raise CorruptCheckpoint(f"{path}: zip archive has no data.pkl; not a torch.save file", path=path)
    prefix = pkl[0][: -len("data.pkl")]
    out: dict[str, tuple[int, int]] = {}
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                raise Unsupported(f"{path}: record {info.filename} is compressed; torch never writes that")
            f.seek(info.header_offset)
            head = f.read(_LOCAL_HEADER.size)
            if len(head) < _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
                raise CorruptCheckpoint(f"{path}: broken zip record header for {info.filename}", path=path)
            fields = _LOCAL_HEADER.unpack(head)
            start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
            if start + info.file_size > size:
                raise CorruptCheckpoint(
                    f"{path}: record {info.filename} runs past the end of the file", path=path
                )
            out[info.filename] = (start, info.file_size)
    return prefix, out, zf


def load_refs(path: str, *, trust_pickle: bool = False) -> Any:
    """Unpickle a torch zip archive's object with tensors as ``TensorRef`` (no tensor bytes read)."""
    if not is_torch_zip(path):
        if os.path.exists(path) and os.path.getsize(path) > 0:
            raise Unsupported(
                f"{path}: not a zip-format torch file (legacy torch<1.6 format or truncated)",
                hint="re-save it with a recent torch.save, or check the copy is complete",
                path=path,
            )
        raise CorruptCheckpoint(f"{path}: empty or missing file", path=path)
    prefix, records, zf = record_offsets(path)
    with zf:
        try:
            data = zf.read(prefix + "data.pkl")
        except (zipfile.BadZipFile, OSError) as e:
            raise CorruptCheckpoint(f"{path}: cannot read data.pkl ({e})", path=path) from None
    obj = safe_loads(data, source=path, trust_pickle=trust_pickle)
    for ref in iter_refs(obj):
        name = f"{prefix}data/{ref.storage.key}"
        if name not in records:
            raise CorruptCheckpoint(f"{path}: tensor storage record {name} is missing", path=path)
        start, nbytes = records[name]
        if ref.storage.numel * ref.dtype.itemsize > nbytes:
            raise CorruptCheckpoint(f"{path}: storage record {name} is shorter than its tensor", path=path)
        ref.file = path
        ref.byte_offset = start + ref.offset * ref.dtype.itemsize
    return obj


def iter_refs(obj: Any) -> Any:
    """Every ``TensorRef`` inside a nest of dicts, lists, tuples and stand-in records."""
    stack = [obj]
    seen: set[int] = set()
    while stack:
        o = stack.pop()
        if isinstance(o, TensorRef):
            yield o
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            if id(o) not in seen:
                seen.add(id(o))
                stack.extend(o)
        elif isinstance(o, _Record):
            stack.extend(o.__dict__.values())
