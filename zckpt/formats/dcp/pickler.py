"""Writing DCP's ``.metadata`` without importing ``torch.distributed``: the reader's stand-ins
(``zckpt.formats.dcp.metadata``) pickled under DCP's own class names, so real torch unpickles real objects.

Built on ``zckpt.io.torchzip_write.TorchPickler`` (protocol 2, globals by name): dataclasses as NEWOBJ + BUILD
with their field dict (as ``pickle`` writes them), ``TensorProperties`` with its 5-tuple state (what its
``__setstate__`` takes), ``torch.Size`` / the memory-format enum / ``_get_layout`` as REDUCE calls, dtypes as
``torch.<name>`` globals.
"""

from __future__ import annotations

import copyreg
import io
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zckpt.formats.dcp import metadata as M
from zckpt.io.torchzip_write import GlobalRef, TorchPickler

_DCP = "torch.distributed.checkpoint"
NAMES: dict[type, tuple[str, str]] = {
    M.Metadata: (f"{_DCP}.metadata", "Metadata"),
    M.TensorStorageMetadata: (f"{_DCP}.metadata", "TensorStorageMetadata"),
    M.BytesStorageMetadata: (f"{_DCP}.metadata", "BytesStorageMetadata"),
    M.ChunkStorageMetadata: (f"{_DCP}.metadata", "ChunkStorageMetadata"),
    M.MetadataIndex: (f"{_DCP}.metadata", "MetadataIndex"),
    M.StorageMeta: (f"{_DCP}.metadata", "StorageMeta"),
    M.TensorProperties: (f"{_DCP}.metadata", "TensorProperties"),
    M.StorageInfo_: (f"{_DCP}.filesystem", "_StorageInfo"),
}
_SIZE = GlobalRef("torch", "Size")
_MEM_FORMAT = GlobalRef(f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING")
_LAYOUT = GlobalRef("torch.serialization", "_get_layout")
VERSION = "1.0.0"


@dataclass(frozen=True)
class Size:
    """A ``torch.Size`` to pickle (``REDUCE(torch.Size, (dims,))``)."""

    dims: tuple[int, ...]


class MetadataPickler(TorchPickler):
    """``TorchPickler`` that writes the DCP stand-ins under DCP's names."""

    dispatch = TorchPickler.dispatch.copy()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Size):
            return (_SIZE, (tuple(obj.dims),))
        if isinstance(obj, M.TensorProperties):
            state = (
                obj.__dict__["dtype"],
                _Call(_LAYOUT, ("torch.strided",)),
                False,
                _Call(_MEM_FORMAT, (0,)),
                False,
            )
            return (copyreg.__newobj__, (M.TensorProperties,), state)  # type: ignore[attr-defined]
        if isinstance(obj, _Call):
            return (obj.func, obj.args)
        return super().reducer_override(obj)

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if isinstance(obj, type) and obj in NAMES:
            self._emit_global(*NAMES[obj])
            self.memoize(obj)  # type: ignore[attr-defined]
            return
        super().save_global(obj, name)

    def _save_dtype(self, obj: torch.dtype) -> None:
        self._emit_global("torch", str(obj).removeprefix("torch."))
        self.memoize(obj)  # type: ignore[attr-defined]

    dispatch[torch.dtype] = _save_dtype  # type: ignore[assignment]


@dataclass(frozen=True)
class _Call:
    func: GlobalRef
    args: tuple[Any, ...]


def _record(cls: type[M._Record], **fields: Any) -> Any:
    obj = cls.__new__(cls)
    obj.__dict__.update(fields)
    return obj


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of the checkpoint: flattened key, stored dtype, shape and chunk boxes (offsets, sizes)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    boxes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


@dataclass(frozen=True)
class Stored:
    """Where one item was written: ``key`` (and chunk ``offsets``; None for a bytes item) in ``file``."""

    key: str
    offsets: tuple[int, ...] | None
    file: str
    offset: int
    length: int


def dumps(
    tensors: Sequence[TensorSpec],
    byte_keys: Sequence[str],
    paths: Mapping[str, tuple[str | int, ...]],
    stored: Sequence[Stored],
    checkpoint_id: str | None = None,
) -> bytes:
    """The ``.metadata`` pickle of a checkpoint whose items ``stored`` are written. ``checkpoint_id`` (DCP
    records the folder it saved to; nothing reads it back) stays None: the writer only sees its staging
    folder, published under another name."""
    sdm: dict[str, Any] = {}
    for t in tensors:
        props = _record(M.TensorProperties, dtype=t.dtype)
        chunks = [_record(M.ChunkStorageMetadata, offsets=Size(o), sizes=Size(s)) for o, s in t.boxes]
        sdm[t.key] = _record(M.TensorStorageMetadata, properties=props, size=Size(t.shape), chunks=chunks)
    for k in byte_keys:
        sdm[k] = _record(M.BytesStorageMetadata)
    index = {(t.key, o): i for t in tensors for i, (o, _) in enumerate(t.boxes)}
    storage = {}
    for s in stored:
        off = None if s.offsets is None else Size(s.offsets)
        ix = None if s.offsets is None else index[(s.key, s.offsets)]
        mi = _record(M.MetadataIndex, fqn=s.key, offset=off, index=ix)
        storage[mi] = _record(M.StorageInfo_, relative_path=s.file, offset=s.offset, length=s.length)
    meta = _record(
        M.StorageMeta, checkpoint_id=checkpoint_id, save_id=str(uuid.uuid4()), load_id=None, modules=[]
    )
    md = _record(
        M.Metadata,
        state_dict_metadata=sdm,
        planner_data={k: tuple(paths[k]) for k in sdm},
        storage_data=storage,
        storage_meta=meta,
        version=VERSION,
    )
    buf = io.BytesIO()
    MetadataPickler(buf).dump(md)
    return buf.getvalue()
