"""Locating a DCP folder's tensor chunks in their files: at the open, or when a command first reads them.

``tensor_chunks`` locates one tensor's distinct chunks (``chunks.Files.tensor``: the embedded archive's zip
directory and pickle, or the safetensors blob's header), after checking that its boxes tile it and that the
metadata stores each one. ``blob_files`` says which files keep their tensor items in a safetensors blob: those
whose first tensor item starts a safetensors header. A chunk found otherwise is refused (a file's tensor items
are all ``torch.save`` archives or all in its blob), so that ``read.check_disjoint`` may rely on it.

``Locator`` defers the locating of a model-only open (consolidate, diff) to the moment each tensor's bytes
are first needed: its entry (``model.DeferredEntry``) asks for its chunks then, on whichever thread fills
its bytes. The command's writing starts right after the ``.metadata`` load, and a tensor's chunk archives
are located on a filling thread while the device writes the tensors before it (a 1.5B world-8 save has
~4.6k of them: ~0.3 s of one core on the 16-core host, where the write phase is bound by the disk, not by
the cores). An error is kept and raised to whoever asks for that tensor, and to every later asker; the
folder's files are closed once every tensor is located, or when the open checkpoint is dropped.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping

from zckpt.errors import CorruptCheckpoint, ShardMismatch
from zckpt.formats.dcp.boxes import check_tiling, distinct
from zckpt.formats.dcp.chunks import ZIP_MAGIC, ZSTD_MAGIC, ChunkData, Files
from zckpt.formats.dcp.metadata import DcpMetadata
from zckpt.storage import fileio

Located = dict[tuple[int, ...], ChunkData]
"""A tensor's distinct non-empty chunks by their offsets."""


def blob_files(files: Files, md: DcpMetadata) -> frozenset[str]:
    """The files (names as in ``storage_data``) whose first non-empty tensor item (in ``storage_data``
    order) starts a safetensors header. Anything else (an archive, a compressed item, damaged bytes) is left
    to ``tensor_chunks``, which says what it is."""
    seen: set[str] = set()
    out: set[str] = set()
    for (key, offsets), info in md.storage.items():
        if offsets is None or key not in md.tensors or not info.length or info.file in seen:
            continue
        seen.add(info.file)
        if not info.transforms and _starts_a_blob(fileio.pread(files.open(info)[1], 9, info.offset)):
            out.add(info.file)
    return frozenset(out)


def _starts_a_blob(head: bytes) -> bool:
    """A safetensors header's start (its u64 length, then ``{``), not an archive's or a zstd frame's."""
    return len(head) == 9 and head[8:] == b"{" and head[:4] not in (ZIP_MAGIC, ZSTD_MAGIC)


def tensor_chunks(files: Files, md: DcpMetadata, key: str, blobs: frozenset[str]) -> Located:
    """The distinct non-empty chunks of tensor ``key``, located and checked (module doc)."""
    t = md.tensors[key]
    check_tiling(md.source, key, t.shape, t.chunks)
    out: Located = {}
    for box in distinct(t.chunks):
        info = md.storage.get((key, box.offsets))
        if info is None:
            raise ShardMismatch(
                f"{md.source}: no storage recorded for chunk {list(box.offsets)} of {key!r:.100}",
                path=md.source,
            )
        d = files.tensor(key, box, info, t.dtype)
        if info.length and (d.check is None) != (info.file in blobs):
            f = str(files.path(info))
            raise CorruptCheckpoint(
                f"{f}: holds both torch.save archives and a safetensors blob of tensor chunks (chunk "
                f"{list(box.offsets)} of {key!r:.80})",
                hint="the .metadata file is damaged, or files of several saves are mixed",
                path=f,
            )
        out[box.offsets] = d
    return out


class Locator:
    """The chunks of tensors ``keys`` of one folder, each located when first asked for (module doc). Owns
    ``files``: closed once every key is located, or when the locator is dropped."""

    def __init__(self, files: Files, md: DcpMetadata, keys: Iterable[str], blobs: frozenset[str]) -> None:
        self._files, self._md, self._blobs = files, md, blobs
        self._want = frozenset(keys)
        self._got: dict[str, Located | Exception] = {}
        self._lock = threading.Lock()
        self._closer = weakref.finalize(self, files.close)
        if not self._want:
            self._closer()

    def __contains__(self, key: object) -> bool:
        return key in self._want

    def chunks(self, key: str) -> Mapping[tuple[int, ...], ChunkData]:
        """``key``'s chunks (located now, on this thread, the first time), or the error locating them."""
        with self._lock:
            got = self._got.get(key)
            if got is None:
                try:
                    got = tensor_chunks(self._files, self._md, key, self._blobs)
                except Exception as e:  # noqa: BLE001 - raised to whoever asks for this tensor
                    got = e
                self._got[key] = got
                if len(self._got) == len(self._want):
                    self._closer()
        if isinstance(got, Exception):
            raise got
        return got
