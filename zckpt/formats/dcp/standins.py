"""The stand-ins a DCP ``.metadata`` pickle is unpickled into, and its unpickler, without torch.

``.metadata`` is a plain pickle (protocol 4, 5 on Python 3.14; several FRAMEs when large) of
``torch.distributed.checkpoint.metadata.Metadata``. The globals it may name (found by scanning real files of
torch 2.13, and in torch 2.0-2.12's sources for the older names) are ``ALLOWED`` below: DCP's dataclasses
(built by NEWOBJ + BUILD into ``__dict__``), ``TensorProperties`` (BUILD with a 5-tuple through its
``__setstate__``), the memory-format enum, ``torch.serialization._get_layout`` and ``pathlib`` paths;
besides them ``torch.Size``, read as an int64 array, and torch's dtypes, kept as their names (``DtypeName``).
torch < 2.2 pickled ``TensorProperties``/``MEM_FORMAT_ENCODING`` from
``torch.distributed._shard.sharded_tensor.metadata``; torch 1.13's prototype lived in
``torch.distributed._shard.checkpoint``. Megatron-Core's ``torch_dist`` saves add
``Metadata.all_local_plans``, every rank's ``SavePlan`` (``WriteItem``, ``WriteItemType``,
``TensorWriteData``, ``BytesIOWriteData``): inert records too, never read. Nothing from
``torch.distributed`` is imported, nor torch itself:
``zckpt.formats.dcp.metadata`` checks what this builds. The writer (``pickler``) pickles the same stand-ins
under DCP's names.
"""

from __future__ import annotations

import array
from pathlib import Path
from typing import Any, BinaryIO

from zckpt.codecs.pickle_core import LEAVES, RestrictedUnpickler, _Record
from zckpt.errors import CorruptCheckpoint


class Metadata(_Record):
    """Stand-in for ``Metadata`` (state_dict_metadata, planner_data, storage_data, storage_meta, version)."""


class TensorStorageMetadata(_Record):
    """Stand-in for ``TensorStorageMetadata`` (properties, size, chunks)."""


class BytesStorageMetadata(_Record):
    """Stand-in for ``BytesStorageMetadata`` (no fields)."""


class ChunkStorageMetadata(_Record):
    """Stand-in for ``ChunkStorageMetadata`` (offsets, sizes)."""


class MetadataIndex(_Record):
    """Stand-in for ``MetadataIndex`` (fqn, offset, index); hashable like DCP's (by fqn and offset)."""

    def _key(self) -> tuple[Any, Any]:
        off = self.__dict__.get("offset")
        return (self.__dict__.get("fqn"), tuple(off) if isinstance(off, (tuple, list, array.array)) else off)

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and self._key() == other._key()


class StorageMeta(_Record):
    """Stand-in for ``StorageMeta`` (checkpoint_id, save_id, load_id, modules)."""


class StorageInfo_(_Record):  # noqa: N801 - the stand-in of ``_StorageInfo``
    """Stand-in for ``filesystem._StorageInfo`` (relative_path, offset, length[, transform_descriptors])."""


class TensorProperties(_Record):
    """Stand-in for ``TensorProperties``: BUILD passes ``(dtype, layout, requires_grad, memory_format,
    pin_memory)`` to ``__setstate__`` (a dict in the oldest files)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 5:
            names = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
            self.__dict__.update(zip(names, state, strict=True))
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            raise CorruptCheckpoint(f"TensorProperties state of unexpected shape {type(state).__name__}")


class SavePlan(_Record):
    """Stand-in for ``planner.SavePlan`` (items, storage_data, planner_data, usable): Megatron-Core's
    ``torch_dist`` save keeps every rank's plan in ``Metadata.all_local_plans``; nothing here reads it."""


class WriteItem(_Record):
    """Stand-in for ``planner.WriteItem`` (index, type, bytes_io_data, tensor_data) of ``all_local_plans``."""


class TensorWriteData(_Record):
    """Stand-in for ``planner.TensorWriteData`` (chunk, properties, size) of ``all_local_plans``."""


class BytesIOWriteData(_Record):
    """Stand-in for ``planner.BytesIOWriteData`` (nbytes) of ``all_local_plans``."""


def _write_item_type(value: Any) -> int:
    """``WriteItemType(value)``: the enum's number (1 TENSOR, 2 SHARD, 3 BYTE_IO)."""
    if type(value) is not int or not 0 <= value <= 8:
        raise CorruptCheckpoint(f"WriteItemType {value!r:.40} is not a small int")
    return value


def _mem_format(value: Any) -> int:
    """``_MEM_FORMAT_ENCODING(value)``: the encoding's number (0 contiguous, 1 channels_last, 2 preserve)."""
    if value not in (0, 1, 2):
        raise CorruptCheckpoint(f"memory format encoding {value!r:.40} is not 0, 1 or 2")
    return int(value)


def _layout(name: Any) -> str:
    """``torch.serialization._get_layout(name)``: kept as its name (only ``torch.strided`` is supported)."""
    if not isinstance(name, str) or len(name) > 64:
        raise CorruptCheckpoint(f"tensor layout {name!r:.40} is not a name")
    return name


def _path(*parts: Any) -> str:
    """``pathlib.PosixPath(*parts)`` as a string (DCP's ``checkpoint_id``: the writing machine's path)."""
    if not all(isinstance(p, str) for p in parts):
        raise CorruptCheckpoint("checkpoint_id path parts are not strings")
    return str(Path(*parts)) if parts else ""


_DCP = "torch.distributed.checkpoint"
_CLASSES = {
    "Metadata": Metadata,
    "TensorStorageMetadata": TensorStorageMetadata,
    "BytesStorageMetadata": BytesStorageMetadata,
    "ChunkStorageMetadata": ChunkStorageMetadata,
    "MetadataIndex": MetadataIndex,
    "StorageMeta": StorageMeta,
    "TensorProperties": TensorProperties,
    "_MEM_FORMAT_ENCODING": _mem_format,
}
_SHARDED = "torch.distributed._shard.sharded_tensor.metadata"
ALLOWED: dict[tuple[str, str], Any] = {
    **{(f"{_DCP}.metadata", n): c for n, c in _CLASSES.items()},
    **{("torch.distributed._shard.checkpoint.metadata", n): c for n, c in _CLASSES.items()},  # torch 1.13
    (f"{_DCP}.filesystem", "_StorageInfo"): StorageInfo_,
    (f"{_DCP}.planner", "SavePlan"): SavePlan,  # Megatron-Core's ``all_local_plans``
    (f"{_DCP}.planner", "WriteItem"): WriteItem,
    (f"{_DCP}.planner", "WriteItemType"): _write_item_type,
    (f"{_DCP}.planner", "TensorWriteData"): TensorWriteData,
    (f"{_DCP}.planner", "BytesIOWriteData"): BytesIOWriteData,
    ("torch.distributed._shard.checkpoint.filesystem", "_StorageInfo"): StorageInfo_,
    (_SHARDED, "TensorProperties"): TensorProperties,  # torch 2.0 - 2.1
    (_SHARDED, "MEM_FORMAT_ENCODING"): _mem_format,
    ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("pathlib", "PureWindowsPath"): _path,
    ("pathlib", "Path"): _path,
}
"""The globals a ``.metadata`` pickle may name besides plain containers, ``torch.Size`` and dtypes."""


class Size(array.array):
    """``torch.Size(dims)``: int64s in a C array (built as fast as torch's own, a ``TypeError`` or
    ``OverflowError`` for anything but ints, as torch's), so the graph check need not walk it: a ``.metadata``
    holds two per chunk."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"torch.Size({list(self)})"


class _SizeGlobal:
    """The global ``torch.Size`` resolves to: REDUCE calls it with a list or tuple only (an array would read
    bytes as raw int64s, where torch reads them as a sequence of small ints)."""

    def __call__(self, dims: Any = ()) -> Size:
        if type(dims) is not tuple and type(dims) is not list:
            raise TypeError(f"torch.Size from {type(dims).__name__}")
        return Size("q", dims)

    def __repr__(self) -> str:
        return "torch.Size"


_size = _SizeGlobal()


class DtypeName(str):
    """A torch dtype as a ``.metadata`` names it (``torch.float32`` is ``DtypeName("float32")``), no torch."""


DTYPE_NAMES = frozenset(
    """
    bfloat16 bit bits16 bits1x8 bits2x4 bits4x2 bits8 bool cdouble cfloat chalf complex128 complex32
    complex64 double float float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz
    float8_e5m2 float8_e5m2fnuz float8_e8m0fnu half int int1 int16 int2 int3 int32 int4 int5 int6 int64
    int7 int8 long qint32 qint8 quint2x4 quint4x2 quint8 short uint1 uint16 uint2 uint3 uint32 uint4 uint5
    uint6 uint64 uint7 uint8
    """.split()  # noqa: SIM905 - one table, not 56 lines
)
"""The ``torch.X`` globals a ``.metadata`` may name as a dtype: every dtype attribute of torch 2.13 (which has
all of the older ones). ``build`` refuses a name the running torch lacks."""


class Unpickler(RestrictedUnpickler):
    """``ALLOWED`` and plain containers; ``torch.Size`` is a ``Size``, a dtype its ``DtypeName``."""

    def __init__(self, f: BinaryIO, source: str) -> None:
        super().__init__(f, source=source, allowed=ALLOWED)

    def resolve(self, module: str, name: str) -> Any:
        if module == "torch":
            if name == "Size":
                return _size
            if name in DTYPE_NAMES:
                return DtypeName(name)
        return None


LEAVES_MD: frozenset[type] = LEAVES | {DtypeName, Size}
"""What the graph check need not walk in an unpickled ``.metadata``."""
