"""One ``torch.save`` archive built from lazy tensors: ``Archive.tensor`` registers a storage whose bytes
are read (``zckpt.stream.flat``) only while ``save`` streams it into the file, one storage at a time;
``convert`` copies a pickled source object with every tensor reference turned into such a storage."""

from __future__ import annotations

import copy
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from zckpt.codecs.pickle_safe import TensorRef, _Record
from zckpt.codecs.safetensors import FileRecord
from zckpt.codecs.torchzip_write import StorageSlot, TensorSlot, TorchZipWriter, dumps
from zckpt.errors import Unsupported
from zckpt.model import Piece, Role, TensorEntry
from zckpt.storage.digest import BLOCK_BYTES
from zckpt.storage.sink import HashingSink
from zckpt.stream.flat import FlatSource, whole
from zckpt.stream.items import entry_from_tensor


class Archive:
    """One torch.save archive: ``tensor()`` registers a lazy storage; ``save()`` streams it out."""

    def __init__(self) -> None:
        self.storages: list[tuple[StorageSlot, FlatSource]] = []
        self._refs: dict[tuple[str, str], StorageSlot] = {}

    def tensor(
        self, src: FlatSource, shape: tuple[int, ...] | None = None, requires_grad: bool = False
    ) -> TensorSlot:
        slot = StorageSlot(str(len(self.storages)), src.dtype, src.numel)
        self.storages.append((slot, src))
        shp = (src.numel,) if shape is None else tuple(shape)
        return TensorSlot(slot, shp, 0, requires_grad)

    def scalar(self, t: torch.Tensor) -> TensorSlot:
        e = entry_from_tensor("scalar", t)
        return self.tensor(whole(e), tuple(t.shape))

    def convert(self, obj: Any) -> Any:
        """A copy of a pickled source object with every ``TensorRef`` (or in-memory tensor) turned into a
        lazy tensor."""
        if isinstance(obj, torch.Tensor):
            return self.scalar(obj.detach().cpu().contiguous())
        if isinstance(obj, TensorEntry):
            return self.tensor(whole(obj), obj.shape)
        if isinstance(obj, TensorRef):
            key = (obj.file, obj.storage.key)
            slot = self._refs.get(key)
            if slot is None:
                base = obj.byte_offset - obj.offset * obj.dtype.itemsize
                e = TensorEntry(
                    "ref",
                    (obj.storage.numel,),
                    obj.dtype,
                    Role.BUFFER,
                    (Piece(obj.file, base, obj.dtype, 0, obj.storage.numel),),
                )
                slot = StorageSlot(str(len(self.storages)), obj.dtype, obj.storage.numel)
                self.storages.append((slot, whole(e)))
                self._refs[key] = slot
            if not obj.is_contiguous:
                raise Unsupported(f"{obj.file}: non-contiguous tensor in pickled state cannot be copied")
            return TensorSlot(slot, tuple(obj.shape), obj.offset, obj.requires_grad)
        if isinstance(obj, OrderedDict):
            return OrderedDict((k, self.convert(v)) for k, v in obj.items())
        if isinstance(obj, dict):
            return {k: self.convert(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.convert(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self.convert(v) for v in obj)
        if isinstance(obj, _Record):
            new = copy.copy(obj)
            new.__dict__ = {k: self.convert(v) for k, v in obj.__dict__.items()}
            return new
        return obj

    def save(self, path: Path, obj: Any) -> FileRecord:
        """Write the archive (pickle first, then each storage streamed) and its sidecar."""
        sink = HashingSink(path, block=BLOCK_BYTES)  # its digest: blocks, hashed on several cores
        try:
            w = TorchZipWriter(sink, prefix=path.stem)
            w.write_header_records(dumps(obj))
            for slot, src in self.storages:
                w.write_record(f"data/{slot.key}", src.layout(), src.nbytes)
            w.close()
        except BaseException:
            sink.abort()  # nothing of it appears (an object upload is aborted)
            raise
        sink.close()
        sink.write_sidecar()
        return FileRecord(path.name, sink.digest(), sink.tell())
