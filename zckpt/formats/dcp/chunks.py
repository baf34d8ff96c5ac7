"""Chunk storage: from a ``_StorageInfo(relative_path, offset, length)`` to the chunk's raw bytes in its file,
without loading anything.

Each item of a ``.distcp`` file is one complete ``torch.save`` zip archive (DCP's default serialization):
its zip directory, local headers and ``data.pkl`` are parsed through a window of the file
(``zckpt.codecs.torchzip.archive_at``, the pickle through the safe unpickler), giving the absolute offset of
the storage record ``data/0``, its dtype and shape, and its zip CRC-32. With
``FileSystemWriter(serialization_format=SAFETENSORS)`` a file holds the bytes items as archives and then one
safetensors blob to EOF with every tensor chunk of the rank under its flattened key; every tensor item's
offset is the blob's start. zstd-compressed items (``transform_descriptors``) are refused with a hint.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from zckpt.codecs import safetensors
from zckpt.codecs.pickle_safe import TensorRef
from zckpt.codecs.safetensors import Header
from zckpt.codecs.torchzip import archive_at
from zckpt.dtypes import DType
from zckpt.errors import CorruptCheckpoint, ShardMismatch, Unsupported
from zckpt.formats.dcp.metadata import METADATA, Chunk, StorageInfo
from zckpt.model import Checked
from zckpt.storage import fileio
from zckpt.storage.location import Location
from zckpt.stream.window import Window

ZIP_MAGIC = b"PK\x03\x04"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass(frozen=True)
class ChunkData:
    """Where a chunk's elements are: ``numel`` elements of ``dtype`` from ``byte_offset`` of ``file``."""

    file: str
    byte_offset: int
    dtype: DType
    numel: int
    check: Checked | None = None
    """The storage record and its CRC-32 (torch archives; None for safetensors blobs): reads verify it."""

    @property
    def crc(self) -> int | None:
        return None if self.check is None else self.check.crc32


def unsupported_transform(file: Location, info: StorageInfo) -> Unsupported:
    return Unsupported(
        f"{file}: items are compressed ({', '.join(info.transforms) or 'zstd frames'}); zckpt reads "
        "uncompressed DCP checkpoints only",
        hint="convert it with torch (torch.distributed.checkpoint.format_utils.dcp_to_torch_save) or re-save "
        "without _extensions",
        path=str(file),
    )


class Files:
    """Open ``.distcp`` files of one folder (one descriptor each, closed on exit) and what they hold."""

    def __init__(self, folder: Location) -> None:
        self.folder = folder
        self._fds: dict[str, tuple[fileio.Handle, int]] = {}
        self._headers: dict[tuple[str, int], Header] = {}
        self._paths: dict[str, Location] = {}
        self.memo: dict[tuple[bytes, bool], object] = {}

    def __enter__(self) -> Files:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for fd, _ in self._fds.values():
            with contextlib.suppress(OSError):
                fileio.close_fd(fd)
        self._fds.clear()

    def path(self, info: StorageInfo) -> Location:
        p = self._paths.get(info.file)
        if p is None:
            p = self._paths[info.file] = self._checked_path(info)
        return p

    def _checked_path(self, info: StorageInfo) -> Location:
        rel = Path(info.file)
        if rel.is_absolute() or ".." in rel.parts or not info.file or "\x00" in info.file:
            md = str(self.folder / METADATA)
            raise CorruptCheckpoint(
                f"{md}: storage file {info.file!r:.80} is not a name inside the folder",
                hint="the .metadata file is damaged; restore it from the original save",
                path=md,
            )
        return self.folder / rel.as_posix()

    def open(self, info: StorageInfo) -> tuple[str, fileio.Handle]:
        """(path, descriptor) of the item's file, its bytes checked to lie inside the file."""
        f = str(self.path(info))
        if f not in self._fds:
            if not fileio.exists(f):
                raise ShardMismatch(
                    f"{f}: missing (the metadata stores items in it)",
                    hint="restore the file from the original save",
                    path=f,
                )
            h = fileio.open_fd(f)
            self._fds[f] = (h, h.size)
        fd, size = self._fds[f]
        if info.offset + info.length > size:
            raise CorruptCheckpoint(
                f"{f}: an item needs bytes [{info.offset}, {info.offset + info.length}) but the file has "
                f"{size} bytes (truncated?)",
                hint="re-copy the file, or check the save finished",
                path=f,
            )
        return f, fd

    def window(self, info: StorageInfo) -> Window:
        """The item's bytes as a ``Window`` (its first read fetches the head an archive parse needs next)."""
        _, fd = self.open(info)
        return Window(fd, info.offset, info.length)

    def tensor(self, key: str, box: Chunk, info: StorageInfo, dtype: DType) -> ChunkData:
        """The chunk ``box`` of tensor ``key`` (stored dtype ``dtype``), located and checked."""
        if info.transforms:
            raise unsupported_transform(self.path(info), info)
        win = self.window(info)
        head = win.pread(4, 0)
        if head == ZIP_MAGIC:
            return self._from_archive(key, box, info, dtype, win)
        if head == ZSTD_MAGIC:
            raise unsupported_transform(self.path(info), info)
        return self._from_blob(key, box, info, dtype)

    def _from_archive(self, key: str, box: Chunk, info: StorageInfo, dtype: DType, win: Window) -> ChunkData:
        f, fd = self.open(info)
        what = f"(chunk of {key if len(key) <= 60 else '...' + key[-57:]!r})"  # the tail names the tensor
        arc = archive_at(f, fd, info.offset, info.length, what=what, memo=self.memo, win=win)
        ref = arc.obj
        where = f"{f}: chunk {list(box.offsets)} of {key!r:.80}"
        if not isinstance(ref, TensorRef):
            raise CorruptCheckpoint(f"{where} holds a {type(ref).__name__}, not a tensor", path=f)
        if ref.dtype != dtype or ref.numel != box.numel or (ref.numel and tuple(ref.shape) != box.sizes):
            raise CorruptCheckpoint(
                f"{where} is {list(ref.shape)} {ref.dtype}, the metadata says {list(box.sizes)} {dtype}",
                hint="the metadata and the rank files come from different saves",
                path=f,
            )
        if ref.numel and not ref.is_contiguous:
            raise Unsupported(f"{where} is stored as a strided view", path=f)
        return ChunkData(f, ref.byte_offset, dtype, box.numel, ref.check)

    def _from_blob(self, key: str, box: Chunk, info: StorageInfo, dtype: DType) -> ChunkData:
        f, _ = self.open(info)
        hkey = (f, info.offset)
        if hkey not in self._headers:
            try:
                self._headers[hkey] = safetensors.read_header(f, info.offset)
            except CorruptCheckpoint as err:
                why = str(err).removeprefix(f"{f}: ")[:80]
                raise CorruptCheckpoint(
                    f"{f}: the item at byte {info.offset} is neither a torch.save archive nor a safetensors "
                    f"blob ({why})",
                    path=f,
                ) from None
        e = self._headers[hkey].tensors.get(key)
        if e is None:
            raise CorruptCheckpoint(f"{f}: its safetensors blob has no tensor {key!r:.100}", path=f)
        if e.dtype != dtype or e.numel != box.numel or e.end - e.begin != info.length:
            raise CorruptCheckpoint(
                f"{f}: {key!r:.100} in the safetensors blob is {list(e.shape)} {e.dtype}, the metadata says "
                f"{list(box.sizes)} {dtype}",
                path=f,
            )
        return ChunkData(f, e.begin, dtype, box.numel)
