"""Writing ``torch.save``-compatible zip archives without ``torch.save``, one storage at a time.

An archive is ``<prefix>/data.pkl`` (the pickled object; each storage a persistent id
``('storage', torch.<Type>Storage, key, 'cpu', numel)``), one uncompressed record
``<prefix>/data/<key>`` per storage with its data aligned to 64 bytes (padding in the local header's
extra field, as torch does), and ``byteorder`` / ``version`` / ``.format_version`` /
``.storage_alignment`` records. ``torch.load(weights_only=True)`` reads the result.

- ``TorchPickler`` pickles plain containers with two stand-ins: ``TensorSlot`` (a tensor: becomes
  ``torch._utils._rebuild_tensor_v2`` over a ``StorageSlot`` persistent id; the same slot object
  pickled twice is memoized, so tied names share one tensor) and ``GlobalRef`` (any dotted global,
  emitted by name without importing it). Instances of the stand-ins in
  ``zckpt.codecs.pickle_safe.FOREIGN_CLASSES`` are pickled under their foreign names (DeepSpeed's
  ``LossScaler`` ...), so DeepSpeed files can be written without importing deepspeed.
- ``TorchZipWriter`` streams records into a ``HashingSink`` (sequential: sizes and CRCs go into zip
  data descriptors, zip64 when needed), so each storage is written as it is read and the file's
  sha256 comes for free.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from zckpt import dtypes
from zckpt.codecs.pickle_safe import FOREIGN_CLASSES, Device, Size
from zckpt.dtypes import DType
from zckpt.errors import Unsupported
from zckpt.storage.checks import crc32
from zckpt.storage.sink import HashingSink
from zckpt.storage.threads import Pool
from zckpt.stream import pipeline
from zckpt.stream.fill import Layout
from zckpt.stream.items import tensor_bytes

ALIGNMENT = 64
_OVERLAP_BYTES = 1 << 20
"""Records at least this large take their CRC32 on a helper thread, concurrently with the write and hash
(zlib releases the GIL): the bytes go straight to the sink and the running CRC and size are handed to
zipfile's record writer (its ``_crc`` / ``_file_size``, which its ``close`` puts in the data descriptor;
CPython 3.8+). Where those attributes are missing, zipfile's own ``write`` is used."""
_FOREIGN_NAMES: dict[Any, tuple[str, str]] = {cls: name for name, cls in FOREIGN_CLASSES.items()}


@dataclass(frozen=True)
class GlobalRef:
    """A global (``module.name``) pickled by name; never imported or called here."""

    module: str
    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # pickle insists reduce functions are callable
        raise TypeError(f"{self.module}.{self.name} is a pickling stand-in")


@dataclass(eq=False)
class StorageSlot:
    """One storage record: ``key`` names ``data/<key>``; ``numel`` elements of ``dtype``."""

    key: str
    dtype: DType | torch.dtype
    numel: int


@dataclass(eq=False)
class TensorSlot:
    """A tensor to pickle: a contiguous view of ``storage`` starting at element ``offset``."""

    storage: StorageSlot
    shape: tuple[int, ...]
    offset: int = 0
    requires_grad: bool = False
    stride: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        st, acc = [], 1
        for s in reversed(self.shape):
            st.append(acc)
            acc *= max(s, 1)
        self.stride = tuple(reversed(st))


_REBUILD = GlobalRef("torch._utils", "_rebuild_tensor_v2")
_ODICT = GlobalRef("collections", "OrderedDict")
_SIZE = GlobalRef("torch", "Size")
_DEVICE = GlobalRef("torch", "device")


class TorchPickler(pickle._Pickler):
    """Protocol-2 pickler (as torch uses) with tensors as persistent ids and foreign globals by name.

    Built on the pure-Python pickler because only it lets a subclass emit a GLOBAL for a module that
    is not importable here (``deepspeed.*``).
    """

    dispatch = pickle._Pickler.dispatch.copy()

    def __init__(self, f: io.BytesIO) -> None:
        super().__init__(f, protocol=2)

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageSlot):
            dt = dtypes.lookup(str(obj.dtype))
            if dt is None or dt.storage is None:
                raise Unsupported(
                    f"torch zip writer: no storage type for {obj.dtype}; write safetensors instead"
                )
            return ("storage", GlobalRef("torch", dt.storage), obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, TensorSlot):
            args = (obj.storage, obj.offset, obj.shape, obj.stride, obj.requires_grad, _EmptyOrderedDict())
            return (_REBUILD, args)
        if isinstance(obj, _EmptyOrderedDict):
            return (_ODICT, ())
        if isinstance(obj, Size):  # the reader's stand-ins, written back as torch's own
            return (_SIZE, (tuple(obj),))
        if isinstance(obj, Device):
            return (_DEVICE, (obj.type,) if obj.index is None else (obj.type, obj.index))
        return NotImplemented

    def save_global(self, obj: Any, name: str | None = None) -> None:
        foreign = _FOREIGN_NAMES.get(obj)
        if foreign is None:
            super().save_global(obj, name)  # type: ignore[misc]
            return
        self._emit_global(*foreign)
        self.memoize(obj)  # type: ignore[attr-defined]

    def _emit_global(self, module: str, name: str) -> None:
        self.write(pickle.GLOBAL + module.encode() + b"\n" + name.encode() + b"\n")  # type: ignore[attr-defined]

    def _save_globalref(self, obj: GlobalRef) -> None:
        self._emit_global(obj.module, obj.name)
        self.memoize(obj)  # type: ignore[attr-defined]

    def _save_zdtype(self, obj: DType) -> None:  # ``torch.float32`` pickles as the global itself
        self._emit_global("torch", obj.name)
        self.memoize(obj)  # type: ignore[attr-defined]

    dispatch[GlobalRef] = _save_globalref  # type: ignore[assignment]
    dispatch[DType] = _save_zdtype  # type: ignore[assignment]


class _EmptyOrderedDict:
    """The ``backward_hooks`` argument of ``_rebuild_tensor_v2``: an empty ``OrderedDict()``."""


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` as torch would (tensors given as ``TensorSlot``)."""
    buf = io.BytesIO()
    TorchPickler(buf).dump(obj)
    return buf.getvalue()


class TorchZipWriter:
    """Streams a torch zip archive into ``sink``: records in call order, central directory at close."""

    def __init__(self, sink: HashingSink, prefix: str = "archive") -> None:
        self.sink = sink
        self.prefix = prefix
        self.zf = zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self._pool: ThreadPoolExecutor | None = None

    def write_record(
        self, name: str, chunks: Iterable[bytes | memoryview | torch.Tensor] | Layout, size: int
    ) -> None:
        """Add record ``<prefix>/<name>`` of ``size`` bytes from ``chunks`` (or a ``Layout``: filled block by
        block on several threads, ``zckpt.stream.pipeline.fill``); data aligned to 64 bytes."""
        info = zipfile.ZipInfo(f"{self.prefix}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = size
        zip64 = size * 1.05 > zipfile.ZIP64_LIMIT  # zipfile's own rule for the local zip64 extra
        start = self.sink.tell() + 30 + len(info.filename.encode()) + (20 if zip64 else 0)
        pad = -(start + 4) % ALIGNMENT
        info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        written = 0
        with self.zf.open(info, "w", force_zip64=zip64) as w:
            overlap = size >= _OVERLAP_BYTES and hasattr(w, "_crc") and hasattr(w, "_file_size")
            if isinstance(chunks, Layout):
                if overlap and hasattr(self.sink, "write_owned"):  # the CRC comes from the filling threads
                    w._crc = pipeline.fill(cast(pipeline.BlockSink, self.sink), chunks, crc=True)  # type: ignore[attr-defined]
                    w._file_size += chunks.nbytes  # type: ignore[attr-defined]
                    written = chunks.nbytes
                    chunks = ()
                else:
                    chunks = chunks.chunks(pipeline.CHUNK_BYTES)
            # a lazy chunk stream of a large record is read ahead on a thread: its reads overlap the CRC, hash
            # and write (a small one is read here: a thread per record costs more than it saves)
            lazy = not isinstance(chunks, (list, tuple)) and size > pipeline.CHUNK_BYTES
            stream = pipeline.prefetch(chunks) if lazy else chunks
            for c in stream:
                data = tensor_bytes(c) if isinstance(c, torch.Tensor) else c
                if overlap:  # the record's CRC on a helper thread while the chunk is written and hashed
                    crc = self._crc_pool().submit(crc32, data, w._crc)  # type: ignore[attr-defined]
                    self.sink.write(memoryview(data))
                    w._crc = crc.result()  # type: ignore[attr-defined]
                    w._file_size += len(data)  # type: ignore[attr-defined]
                else:
                    w.write(data)
                written += len(data)
        if written != size:
            raise RuntimeError(f"record {name}: wrote {written} bytes, planned {size}")

    def _crc_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = Pool(1, thread_name_prefix="zckpt-crc")
        return self._pool

    def write_bytes(self, name: str, data: bytes) -> None:
        self.write_record(name, [data], len(data))

    def write_header_records(self, pickled: bytes) -> None:
        """``data.pkl`` and the small records torch writes before the storages."""
        self.write_bytes("data.pkl", pickled)
        self.write_bytes(".format_version", b"1")
        self.write_bytes(".storage_alignment", str(ALIGNMENT).encode())
        self.write_bytes("byteorder", b"little")

    def close(self) -> None:
        try:
            self.write_bytes("version", b"3\n")
            self.zf.close()
        finally:
            if self._pool is not None:
                self._pool.shutdown()


__all__ = ["GlobalRef", "StorageSlot", "TensorSlot", "TorchPickler", "TorchZipWriter", "dumps"]
