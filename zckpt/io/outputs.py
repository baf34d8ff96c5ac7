"""Writing output files safely: what to write, where, in how many shards, and never half of it.

Owns the pieces every writer shares:

- ``WriteItem``: one tensor to write (a source ``TensorEntry`` and the output dtype); its bytes come
  out in bounded chunks (``storage.iter_chunks``), so a writer never holds a whole tensor.
- ``Staging``: outputs are written into a hidden temporary folder beside the destination and moved
  into place by ``commit()``; any exception (KeyboardInterrupt included) removes everything.
- ``HashingSink``: a write-only, non-seekable file wrapper that computes the sha256 of every byte
  written and makes the file durable: at ``close()`` (fsync), or, inside an active ``Staging``
  folder of this process, at that folder's ``commit()``, which fsyncs every staged file at once
  before anything is renamed (the disk flushes one file in the background while the next is
  written, instead of the pipeline stalling on each file's fsync). Each tensor file ``F`` gets a
  sidecar ``F.sha256`` in ``sha256sum`` format (``<hex>  <name>``) covering the whole file, so
  ``sha256sum -c F.sha256`` or ``zckpt verify`` can check it. The bytes go to the device with
  ``O_DIRECT`` where the filesystem allows (``zckpt.io.direct_io``), not through the page cache.
- Shard planning and HF shard names (``model-00001-of-00003.safetensors``), size parsing (``5GB``).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from zckpt.errors import KeyMappingError, OutputExists, WriteFailed
from zckpt.io import direct_io, storage
from zckpt.model import Piece, Role, TensorEntry

CHUNK_BYTES = 64 << 20
"""Largest piece of a tensor held in memory at once while writing (per cast chunk)."""


@dataclass(frozen=True)
class WriteItem:
    """One tensor to write: its output name, source entry and output dtype."""

    name: str
    entry: TensorEntry
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def numel(self) -> int:
        return self.entry.numel

    @property
    def nbytes(self) -> int:
        return self.entry.numel * self.dtype.itemsize

    @property
    def role(self) -> Role:
        return self.entry.role

    def chunks(self, max_bytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
        """The tensor's bytes in order, as contiguous 1-D tensors of the output dtype."""
        return storage.iter_chunks(self.entry, self.dtype, max_bytes)


def entry_from_tensor(name: str, t: torch.Tensor, role: Role = Role.PARAM) -> TensorEntry:
    """A ``TensorEntry`` over an in-memory tensor (for writing state dicts built in Python)."""
    flat = t.detach().reshape(-1).contiguous().cpu()
    piece = Piece("", 0, flat.dtype, 0, flat.numel(), value=flat)
    return TensorEntry(name, tuple(t.shape), flat.dtype, role, (piece,))


def items_from_state_dict(
    sd: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None
) -> tuple[list[WriteItem], dict[str, str]]:
    """``WriteItem``s for a state dict plus its tied aliases (names sharing storage, offset and shape).

    The first name of each tied group owns the data; ``dtype`` casts floating tensors.
    """
    items: list[WriteItem] = []
    tied: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, t in sd.items():
        sig = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and sig in seen:
            tied[name] = seen[sig]
            continue
        seen[sig] = name
        out = dtype if dtype is not None and t.is_floating_point() else t.dtype
        items.append(WriteItem(name, entry_from_tensor(name, t), out))
    return items, tied


def tensor_bytes(chunk: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous tensor, without a copy."""
    return memoryview(chunk.contiguous().view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


# ---- sizes and shards ----------------------------------------------------------------------------
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(size: int | str) -> int:
    """``5GB`` -> 5e9 bytes (decimal units as in transformers; ``GiB`` for binary)."""
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size)
        if not m or m.group(2).upper() not in _UNITS:
            raise KeyMappingError(f"cannot read size {size!r}", hint="write it like 5GB, 500MB or 2GiB")
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise KeyMappingError(f"size must be positive, got {size!r}")
    return value


def plan_shards(items: Sequence[WriteItem], max_shard_size: int | None) -> list[list[WriteItem]]:
    """Greedy in-order split (as transformers does): a new shard starts when the next tensor would
    overflow the current one; a tensor larger than the limit gets a shard of its own."""
    if max_shard_size is None:
        return [list(items)]
    shards: list[list[WriteItem]] = [[]]
    size = 0
    for it in items:
        if shards[-1] and size + it.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    return shards


def planned_names(base: str, items: Sequence[WriteItem], max_shard_size: int | None) -> list[str]:
    """The tensor files (and index) a sharded write of ``items`` under ``base`` produces."""
    n = len(plan_shards(items, max_shard_size))
    return shard_names(base, n) + ([f"{base}.index.json"] if n > 1 else [])


def shard_names(base: str, n: int) -> list[str]:
    """``model.safetensors`` -> ``model-00001-of-00003.safetensors`` ... (just ``base`` when n == 1)."""
    if n == 1:
        return [base]
    stem, dot, suffix = base.partition(".")
    return [f"{stem}-{k:05d}-of-{n:05d}{dot}{suffix}" for k in range(1, n + 1)]


def write_sharded(
    folder: Path,
    base: str,
    items: Sequence[WriteItem],
    max_shard_size: int | None,
    write_one: Callable[[Path, list[WriteItem]], object],
    *,
    index_metadata: Mapping[str, Any] | None = None,
    aliases: Mapping[str, str] | None = None,
    part: tuple[int, int] = (0, 1),
) -> list[str]:
    """Write ``base`` into ``folder``: one file, or HF-style shards plus ``<base>.index.json``; returns names.

    ``write_one(path, items)`` writes one file (format-specific); ``aliases`` are tied names listed in the
    index's ``weight_map`` beside their owner (the ``.bin`` convention; safetensors keeps them in metadata).
    ``part=(rank, world)`` writes only shards ``rank::world`` of the (deterministic) plan, and the index
    only on rank 0: ``world`` processes given the same items write the same files between them.
    """
    rank, world = part
    shards = plan_shards(items, max_shard_size)
    names = shard_names(base, len(shards))
    written = []
    for k, (name, shard) in enumerate(zip(names, shards, strict=True)):
        if k % world == rank:
            write_one(folder / name, shard)
            written.append(name)
    if len(shards) > 1 and rank == 0:
        where = {it.name: name for name, shard in zip(names, shards, strict=True) for it in shard}
        where.update({a: where[o] for a, o in (aliases or {}).items() if o in where})
        meta = {"total_size": sum(it.nbytes for it in items), **(index_metadata or {})}
        with open(folder / f"{base}.index.json", "x") as f:
            json.dump({"metadata": meta, "weight_map": where}, f, indent=2, sort_keys=True)
            f.write("\n")
        written.append(f"{base}.index.json")
    return written


# ---- files -------------------------------------------------------------------------------------
_TEST_DELAY_ENV = "ZCKPT_TEST_WRITE_DELAY"
"""Seconds to sleep before each ``HashingSink.write`` (tests only: spreads a kill over a write)."""


_OVERLAP_BYTES = 1 << 20
"""Writes at least this large hash on a helper thread concurrently with the file write (both release
the GIL, so the sha256 costs no wall time on a machine with a spare core)."""


_active_staging: set[Path] = set()
_staging_lock = threading.Lock()


def _fsync_deferred(path: Path) -> bool:
    """``path`` lies in a staging folder of this process whose ``commit()`` will fsync it."""
    with _staging_lock:
        return any(d in path.parents for d in _active_staging)


class HashingSink(io.RawIOBase):
    """Write-only, non-seekable file that hashes what it writes, is fsynced at close (or at its staging
    folder's commit) and writes the sidecar."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self._durable_now = not _fsync_deferred(Path(os.path.abspath(path)))
        self._f = open(path, "xb")  # noqa: SIM115 - closed in close()
        self._direct: direct_io.DirectWriter | None = None
        if direct_io.enabled():
            try:
                self._direct = direct_io.DirectWriter(str(path), self._f.fileno())
            except OSError:  # no O_DIRECT on this filesystem: plain buffered writes
                self._direct = None
        self._sha = hashlib.sha256()
        self._pos = 0
        self._hasher: ThreadPoolExecutor | None = None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, b: object) -> int:
        mv = memoryview(b).cast("B")  # type: ignore[arg-type]
        if _TEST_DELAY_ENV in os.environ:  # test hook: lets kill tests land in the middle of a write
            time.sleep(float(os.environ[_TEST_DELAY_ENV]))
        if len(mv) >= _OVERLAP_BYTES:  # hash on a helper thread while the bytes go to the file
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="zckpt-hash")
            done = self._hasher.submit(self._sha.update, mv)
            try:
                self._put(mv)
            finally:
                done.result()
        else:
            self._put(mv)
            self._sha.update(mv)
        self._pos += len(mv)
        return len(mv)

    def _put(self, mv: memoryview) -> None:
        if self._direct is not None:
            self._direct.write(mv)
        else:
            self._f.write(mv)

    def tell(self) -> int:
        return self._pos

    def seek(self, *args: object) -> int:
        raise io.UnsupportedOperation("HashingSink is write-only and sequential")

    def hexdigest(self) -> str:
        return self._sha.hexdigest()

    def close(self) -> None:
        try:
            if not self.closed and not self._f.closed:
                try:
                    if self._direct is not None:
                        direct, self._direct = self._direct, None
                        direct.close()
                    self._f.flush()
                    if self._durable_now:
                        os.fsync(self._f.fileno())
                finally:  # a failed flush (disk full) must still release the file
                    self._f.close()
                    if self._hasher is not None:
                        self._hasher.shutdown()
        finally:
            super().close()

    def write_sidecar(self) -> Path:
        """Write ``<file>.sha256`` (``sha256sum`` format) next to the file; call after ``close()``."""
        side = self.path.with_name(self.path.name + ".sha256")
        with open(side, "x") as f:
            f.write(f"{self.hexdigest()}  {self.path.name}\n")
            f.flush()
            if self._durable_now:
                os.fsync(f.fileno())
        return side


def read_sidecar(path: Path) -> str | None:
    """The sha256 recorded in ``<path>.sha256``, or None when there is no sidecar."""
    side = path.with_name(path.name + ".sha256")
    if not side.exists():
        return None
    return side.read_text().split()[0]


_WRITE_HINTS = {
    errno.ENOSPC: "free space on the output's filesystem or write elsewhere",
    errno.EDQUOT: "the disk quota is exhausted; free space or write elsewhere",
    errno.EFBIG: "the file size limit was reached (ulimit -f, or the filesystem's maximum file size)",
    errno.EROFS: "the output's filesystem is read-only; write elsewhere",
}


class Staging:
    """A hidden temporary folder beside ``dest``; writers put files in ``.dir`` under their final names.

    ``commit()`` moves them into place: a folder ``dest`` is swapped in whole (the old one, when
    overwriting, is removed only after the new one is in place); for a file ``dest`` each staged file
    replaces its namesake in ``dest``'s folder. Leaving the ``with`` block without ``commit()`` — an
    error, KeyboardInterrupt — removes the temporary folder and everything in it.
    """

    def __init__(self, dest: Path, *, is_dir: bool, overwrite: bool = False) -> None:
        self.dest = dest
        self.is_dir = is_dir
        self.overwrite = overwrite
        check_dest(dest, is_dir=is_dir, overwrite=overwrite)
        dest.parent.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f".{dest.name}.zckpt-tmp-", dir=dest.parent))
        if is_dir:  # mkdtemp makes it 0700; the folder becomes the output, so give it the usual mode
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(self.dir, 0o777 & ~umask)
        self._done = False
        self._key = Path(os.path.abspath(self.dir))
        with _staging_lock:
            _active_staging.add(self._key)

    def __enter__(self) -> Staging:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._done:
            self.abort()
        if isinstance(ev, OSError) and ev.errno in _WRITE_HINTS:
            raise WriteFailed(
                f"{self.dest}: writing failed ({ev.strerror}); nothing was written, temporary files removed",
                hint=_WRITE_HINTS[ev.errno],
                path=str(self.dest),
            ) from ev

    def expect(self, names: Sequence[str]) -> None:
        """Fail now, before any work, if committing files ``names`` (file mode) would replace others."""
        if not self.is_dir:
            for n in names:
                check_dest(self.dest.parent / n, is_dir=False, overwrite=self.overwrite)

    def abort(self) -> None:
        self._release()
        shutil.rmtree(self.dir, ignore_errors=True)
        self._done = True

    def _release(self) -> None:
        with _staging_lock:
            _active_staging.discard(self._key)

    def commit(self) -> list[Path]:
        """Make every staged file durable (fsync, folders included), then move them into place;
        returns their final paths."""
        self._release()
        _fsync_tree(self.dir)
        names = sorted(p.name for p in self.dir.iterdir())
        if self.is_dir:
            trash = None
            if self.dest.exists():
                trash = self.dest.with_name(f".{self.dest.name}.zckpt-old-{os.getpid()}")
                os.rename(self.dest, trash)
            os.rename(self.dir, self.dest)
            if trash is not None:
                shutil.rmtree(trash, ignore_errors=True)
            final = [self.dest / n for n in names]
        else:
            final = []
            # shards of a file OUT have other names: check them too (a sidecar follows its file)
            self.expect([n for n in names if not n.endswith(".sha256")])
            # an old sidecar must never sit beside a new file (a kill between the two renames below)
            for n in names:
                if n.endswith(".sha256"):
                    (self.dest.parent / n).unlink(missing_ok=True)
            for n in names:  # sorted: each file before its sidecar
                os.replace(self.dir / n, self.dest.parent / n)
                final.append(self.dest.parent / n)
            os.rmdir(self.dir)
        _fsync_dir(self.dest.parent)
        self._done = True
        return final


def check_dest(dest: Path, *, is_dir: bool, overwrite: bool) -> None:
    """Refuse an existing output unless ``overwrite``; refuse replacing a folder by a file or back."""
    if not dest.exists():
        return
    if not overwrite:
        raise OutputExists(f"{dest} already exists", hint="pass --overwrite to replace it", path=str(dest))
    if dest.is_dir() != is_dir:
        kind = "a folder" if dest.is_dir() else "a file"
        want = "a folder" if is_dir else "a file"
        raise OutputExists(f"{dest} is {kind}; refusing to replace it by {want}",
                           hint="remove it first or choose another output path", path=str(dest))  # fmt: skip


def fsync_path(path: str | Path) -> None:
    """fsync one file or folder by path (errors propagate)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (files first, then their folders, ``root`` last)."""
    for d, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(d, name))
        _fsync_dir(Path(d))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
