"""Bytes items (``BytesStorageMetadata``): non-tensor values, each a ``torch.save(obj)`` archive in a
``.distcp`` file.

Plain values (param-group fields, scheduler fields, ints, lists of floats or FQNs) need no pickle global and
are decoded through the bounded safe unpickler. Values that are themselves serialized objects are kept
opaque, described, and never parsed unless ``trust_pickle``: ``bytes`` (torchtitan's
``dataloader.dp_rank_<r>``: a ``pickle.dumps``), ``io.BytesIO`` (torchtitan's ``train_state`` lists: a
``torch.save``), and anything asking for a global outside the allowlist. With ``trust_pickle`` those go
through the same bounded unpickler, unknown globals resolved. Tensors inside a bytes item become entries.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass, replace
from typing import Any

from zckpt.codecs.pickle_safe import BytesIOValue, TensorRef, safe_loads
from zckpt.codecs.torchzip import archive_at
from zckpt.errors import CorruptCheckpoint, UnsafePickle, Unsupported
from zckpt.formats.dcp.chunks import ZIP_MAGIC, Files, unsupported_transform
from zckpt.formats.dcp.metadata import StorageInfo
from zckpt.model import Piece, Role, TensorEntry

MAX_DECODED = 16 << 20
"""Bytes items larger than this are listed, not decoded (real param-group/scheduler values are ~1.3 KB)."""


@dataclass(frozen=True)
class Value:
    """A decoded bytes item: ``value`` (JSON-like, tensors as entries) or, when ``opaque``, why not."""

    key: str
    info: StorageInfo
    file: str
    """The item's file (its path as opened)."""
    value: Any = None
    opaque: str | None = None
    inner: bool = False
    """``value`` was parsed from a pickled ``bytes``/``io.BytesIO`` value (``trust_pickle``): shown, but
    written back verbatim, never re-pickled."""

    def describe(self) -> str:
        if self.opaque is not None:
            return self.opaque
        text = repr(self.value)
        return text if len(text) <= 120 else text[:117] + "..."


def decode(files: Files, key: str, info: StorageInfo, *, trust_pickle: bool) -> Value:
    """The value of bytes item ``key`` (see the module doc)."""
    if info.transforms:
        raise unsupported_transform(files.path(info), info)
    f, fd = files.open(info)
    if info.length > MAX_DECODED:
        why = f"<{info.length} bytes, not decoded: larger than {MAX_DECODED >> 20} MiB>"
        return Value(key, info, f, opaque=why)
    win = files.window(info)
    if win.pread(4, 0) != ZIP_MAGIC:
        why = f"the item of {key!r:.100} at byte {info.offset} is not a torch.save archive"
        raise CorruptCheckpoint(f"{f}: {why}", path=f)
    try:
        # the same pickle (an optimizer option of every parameter) is unpickled once
        what = f"(value of {key!r:.80})"
        obj = archive_at(f, fd, info.offset, info.length, what=what, memo=files.memo, win=win).obj
    except UnsafePickle as e:
        why = f"<pickled object, not loaded: {_global_of(e)}; --trust-pickle loads it>"
        return Value(key, info, f, opaque=why)
    if isinstance(obj, (bytes, bytearray)):
        return _inner(Value(key, info, f), bytes(obj), "bytes", trust_pickle)
    if isinstance(obj, BytesIOValue):
        return _inner(Value(key, info, f), obj.value, "io.BytesIO", trust_pickle)
    return Value(key, info, f, value=_entries(key, obj))


def _global_of(e: UnsafePickle) -> str:
    msg = str(e)
    at = msg.find("asks for ")
    return "needs " + msg[at + 9 :].split(",")[0] if at >= 0 else "refused"


def _inner(v: Value, data: bytes, kind: str, trust_pickle: bool) -> Value:
    """A ``bytes``/``io.BytesIO`` value: opaque unless trusted, then parsed (a pickle or a torch.save)."""
    if not trust_pickle:
        return replace(v, opaque=f"<{kind} value, {len(data)} bytes, not unpickled (--trust-pickle)>")
    src = f"{v.file}: {v.key} ({kind} value)"
    try:
        if data[:4] == ZIP_MAGIC:
            with zipfile.ZipFile(io.BytesIO(data)) as zf:
                names = zf.namelist()
                pkl = [n for n in names if n.endswith("data.pkl")]
                if len(pkl) != 1 or any("/data/" in n for n in names):
                    return replace(v, opaque=f"<{kind} holding a torch.save with tensors, not loaded>")
                data = zf.read(pkl[0])
        obj = safe_loads(data, source=src, trust_pickle=True)
    except (zipfile.BadZipFile, OSError, ValueError, KeyError, UnsafePickle, CorruptCheckpoint) as e:
        return replace(v, opaque=f"<{kind} value, unreadable: {str(e)[:80]}>")
    return replace(v, value=obj, inner=True)


def _entries(key: str, o: Any) -> Any:
    """``o`` with every ``TensorRef`` made a lazy entry (they point into the ``.distcp`` file)."""
    if isinstance(o, TensorRef):
        if not o.is_contiguous:
            raise Unsupported(f"{o.file}: value {key!r:.80} holds a strided tensor view", path=o.file)
        return ref_entry(f"client/{key}", o)
    if isinstance(o, dict):
        return {k: _entries(key, v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        out = [_entries(key, v) for v in o]
        return out if isinstance(o, list) else tuple(out)
    return o


def ref_entry(name: str, ref: TensorRef) -> TensorEntry:
    """A contiguous pickled tensor as a lazy entry (its bytes stay in the file)."""
    piece = Piece(ref.file, ref.byte_offset, ref.dtype, 0, ref.numel)
    return TensorEntry(name, tuple(ref.shape), ref.dtype, Role.BUFFER, (piece,) if ref.numel else ())


__all__ = ["MAX_DECODED", "Value", "decode", "ref_entry"]
