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
import zlib
from pathlib import Path
from typing import Any, BinaryIO

from zckpt.errors import CorruptCheckpoint, Unsupported, ZckptError
from zckpt.io import storage
from zckpt.io.integrity import Problem, VerifyContext, problem_from
from zckpt.io.pickle_safe import TensorRef, _Record, safe_loads
from zckpt.model import Checked

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")


def is_torch_zip(path: str) -> bool:
    try:
        with storage.open_regular(path) as f:
            return zipfile.is_zipfile(f)
    except (OSError, ZckptError):
        return False


_ZIP_ERRORS = (
    zipfile.BadZipFile,
    OSError,
    EOFError,
    ValueError,
    OverflowError,
    struct.error,
    NotImplementedError,
    UnicodeDecodeError,
    zlib.error,
    KeyError,
)
"""What ``zipfile`` raises on a damaged archive (a flipped bit in a name, a bad CRC, a short record)."""


def _records(path: str, f: BinaryIO, size: int) -> tuple[str, dict[str, Checked], zipfile.ZipFile]:
    zf = zipfile.ZipFile(f)
    infos = zf.infolist()
    pkl = [i.filename for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
    if len(pkl) != 1:
        raise CorruptCheckpoint(
            f"{path}: zip archive has {len(pkl)} data.pkl records; not a torch.save file", path=path
        )
    prefix = pkl[0][: -len("data.pkl")]
    out: dict[str, Checked] = {}
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise Unsupported(
                f"{path}: record {info.filename!r:.80} is compressed; torch never writes that", path=path
            )
        f.seek(info.header_offset)
        head = f.read(_LOCAL_HEADER.size)
        if len(head) < _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
            raise CorruptCheckpoint(f"{path}: broken zip record header for {info.filename!r:.80}", path=path)
        fields = _LOCAL_HEADER.unpack(head)
        start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        if start + info.file_size > size:
            raise CorruptCheckpoint(
                f"{path}: record {info.filename!r:.80} runs past the end of the file", path=path
            )
        out[info.filename] = Checked(path, start, info.file_size, info.CRC, f"zip record {info.filename}")
    return prefix, out, zf


def record_offsets(path: str) -> tuple[str, dict[str, tuple[int, int]]]:
    """(prefix, {record name: (data offset, size)}) of a torch zip archive."""
    with storage.open_regular(path) as f:
        try:
            prefix, recs, zf = _records(path, f, os.fstat(f.fileno()).st_size)
            zf.close()
            out = {name: (c.start, c.size) for name, c in recs.items()}
        except _ZIP_ERRORS as e:
            raise _damaged(path, e) from None
    return prefix, out


def _damaged(path: str, e: BaseException) -> CorruptCheckpoint:
    return CorruptCheckpoint(
        f"{path}: damaged torch zip archive ({type(e).__name__}: {str(e)[:120]})",
        hint="re-copy the file, or check the save finished",
        path=path,
    )


def load_archive(path: str, *, trust_pickle: bool = False) -> tuple[str, Any]:
    """(archive name, object) of a torch zip archive, with tensors as ``TensorRef`` (no tensor bytes read).
    The archive name is what ``torch.save`` called the root folder: the stem of the file it saved to."""
    with storage.open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise CorruptCheckpoint(
                f"{path}: empty file (0 bytes)", hint="the save or copy did not finish", path=path
            )
        if not zipfile.is_zipfile(f):
            raise Unsupported(
                f"{path}: not a zip-format torch file (a legacy torch<1.6 file, or damaged)",
                hint="re-save it with a recent torch.save, or check the copy is complete",
                path=path,
            )
        try:
            prefix, records, zf = _records(path, f, size)
            with zf:
                info = zf.getinfo(prefix + "data.pkl")
                if info.file_size > size:
                    raise CorruptCheckpoint(f"{path}: data.pkl claims {info.file_size} bytes", path=path)
                data = zf.read(info)
        except _ZIP_ERRORS as e:
            raise _damaged(path, e) from None
    obj = safe_loads(data, source=path, trust_pickle=trust_pickle, max_bytes=size)
    for ref in iter_refs(obj):
        name = f"{prefix}data/{ref.storage.key}"
        if name not in records:
            raise CorruptCheckpoint(f"{path}: tensor storage record {name!r:.80} is missing", path=path)
        rec = records[name]
        _check_view(path, name, ref, rec.size)
        ref.file = path
        ref.byte_offset = rec.start + ref.offset * ref.dtype.itemsize
        ref.check = rec
    return prefix.rstrip("/"), obj


def _check_view(path: str, name: str, ref: TensorRef, nbytes: int) -> None:
    """The tensor's view (offset, shape, stride) must lie inside its storage, and the storage inside its
    record: a view past the end would read another tensor's bytes."""
    if ref.storage.numel < 0 or ref.storage.numel * ref.dtype.itemsize > nbytes:
        raise CorruptCheckpoint(f"{path}: storage record {name!r:.80} is shorter than its tensor", path=path)
    if ref.offset < 0 or any(d < 0 for d in ref.shape) or any(s < 0 for s in ref.stride):
        raise CorruptCheckpoint(
            f"{path}: tensor in {name!r:.80} has a negative offset, size or stride", path=path
        )
    if ref.numel == 0:
        return
    last = ref.offset + sum((d - 1) * s for d, s in zip(ref.shape, ref.stride, strict=False))
    if len(ref.shape) != len(ref.stride) or last >= ref.storage.numel:
        raise CorruptCheckpoint(
            f"{path}: tensor in {name!r:.80} reaches past its storage "
            f"(offset {ref.offset}, shape {list(ref.shape)}, stride {list(ref.stride)}, "
            f"{ref.storage.numel} elements)",
            path=path,
        )


def load_refs(path: str, *, trust_pickle: bool = False) -> Any:
    """Unpickle a torch zip archive's object with tensors as ``TensorRef`` (no tensor bytes read)."""
    return load_archive(path, trust_pickle=trust_pickle)[1]


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


def check_file(f: Path, ctx: VerifyContext) -> list[Problem]:
    """Every record's CRC-32 recomputed and the pickle parsed through the safe unpickler (remembered in
    ``ctx.pickles`` for cross-file checks), every storage record present and long enough."""
    if not is_torch_zip(str(f)):
        why = "not a readable zip archive (truncated, or a legacy pre-1.6 torch file)"
        return [Problem(str(f), why, "truncated", "re-copy the file, or check the save finished")]
    try:
        with storage.open_regular(f) as fh, zipfile.ZipFile(fh) as zf:
            bad = zf.testzip()
    except ZckptError as e:
        return [problem_from(e, f)]
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return [Problem(str(f), f"zip records unreadable ({e})", "truncated")]
    except Exception as e:  # zlib.error and friends: a damaged record, not a bug of ours
        return [Problem(str(f), f"zip records unreadable ({type(e).__name__}: {e})", "corrupt")]
    if bad is not None:
        return [Problem(str(f), f"zip record {bad} fails its CRC-32 check", "corrupt", "the file is damaged")]
    try:
        ctx.pickles[str(f)] = load_refs(str(f), trust_pickle=ctx.trust)
    except ZckptError as e:
        return [problem_from(e, f)]
    return []
