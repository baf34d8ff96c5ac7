"""The safetensors file format, shared by every module that reads or writes it (HF files, the native
format's rank files, ``verify``, the engine's exports).

A file is an 8-byte little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``
plus an optional ``__metadata__`` (str -> str), then the data section. ``read_header`` validates it
strictly: integer lengths and offsets only (JSON ``true`` is not 1), known dtypes, offsets inside the data
section matching shape x itemsize, no overlaps, no duplicate names. ``encode_header`` is the one
encoder and ``plan_file`` the layout it implies (where each tensor's bytes start, the file size);
``write_file`` streams ``WriteItem``s after it (``zckpt.stream.pipeline``; in-memory host tensors are written
straight from their memory), ``write_views`` writes a file already laid out in memory (a snapshot),
``StreamWriter`` takes in-memory tensors one at a time in a declared order. Every file goes through
``HashingSink`` (sha256, whole or per block; durable; ``O_DIRECT`` tuned by ``WriteOptions``);
``FileRecord`` is what a writer reports of it.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zckpt import dtypes
from zckpt.dtypes import DType
from zckpt.errors import CorruptCheckpoint, Unsupported, ZckptError
from zckpt.storage import fileio
from zckpt.storage.digest import BLOCK_BYTES, FileDigest
from zckpt.storage.location import Location
from zckpt.stream.integrity import Problem, problem_from

if TYPE_CHECKING:  # torch and the write path: imported by the writers only (a header needs neither)
    import torch

    from zckpt.storage.direct_io import WriteOptions
    from zckpt.storage.sink import HashingSink
    from zckpt.stream.items import WriteItem

DTYPES: dict[str, DType] = {
    code: dtypes.BY_SAFETENSORS[code]
    for code in ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2")
}
"""The header's dtype codes zckpt reads and writes."""
NAMES: dict[DType, str] = {v: k for k, v in DTYPES.items()}
Spec = tuple[str, "DType | torch.dtype", tuple[int, ...]]
"""A tensor to lay out: name, dtype (zckpt's or torch's), shape."""
MAX_HEADER = 100 << 20
"""The header size limit safetensors itself enforces."""


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors header; ``begin``/``end`` are absolute file offsets."""

    dtype: DType
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    """A validated safetensors header: tensors in data order, metadata, where the data starts."""

    tensors: dict[str, HeaderEntry]
    metadata: dict[str, str]
    data_start: int
    size: int


@dataclass(frozen=True)
class FileRecord:
    """A written file: its name (relative to its folder), digest, size in bytes and tensor CRC-32s."""

    name: str
    digest: FileDigest
    bytes: int
    crc32: Mapping[str, int] = field(default_factory=dict)
    """Each tensor's CRC-32, when the writer was asked for them (``crc=True`` / a ``plan``)."""


@dataclass(frozen=True)
class FilePlan:
    """Where everything of a file goes: its header bytes, each tensor's absolute byte offset (in spec
    order) and the file size."""

    header: bytes
    offsets: tuple[int, ...]
    size: int
    names: tuple[str, ...] = ()

    def regions(self) -> list[tuple[int, int]]:
        """Each tensor's ``[begin, end)`` in the file (they are laid out back to back)."""
        ends = (*self.offsets[1:], self.size)
        return list(zip(self.offsets, ends, strict=True))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"name {k!r} appears twice")
        out[k] = v
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(path: str | Location, offset: int = 0) -> Header:
    """The validated header of a safetensors file (or of a safetensors blob starting at ``offset`` of a file
    and running to its end, as DCP's safetensors serialization stores one); no tensor bytes are read."""
    p = str(path)
    with fileio.open_regular(p) as f:
        size = fileio.file_size(f)
        f.seek(offset)
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCheckpoint(f"{p}: {size} bytes is too short for a safetensors file", path=p)
        (n,) = struct.unpack("<Q", head)
        if n < 2 or n > MAX_HEADER or offset + 8 + n > size:
            raise CorruptCheckpoint(
                f"{p}: header length {n} does not fit a {size}-byte file (truncated or not safetensors)",
                path=p,
            )
        raw = f.read(n)
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpoint(f"{p}: header is not valid JSON ({type(e).__name__}: {e})", path=p) from None
    if not isinstance(header, dict):
        raise CorruptCheckpoint(f"{p}: header is not a JSON object", path=p)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CorruptCheckpoint(f"{p}: __metadata__ must map strings to strings", path=p)
    start = offset + 8 + n
    tensors = {name: _entry(p, name, info, start, size) for name, info in header.items()}
    spans = sorted((e.begin, e.end, name) for name, e in tensors.items())
    for (_, e1, n1), (b2, e2, n2) in zip(spans, spans[1:], strict=False):
        if b2 < e1 and e2 > b2:
            raise CorruptCheckpoint(f"{p}: tensors {n1!r} and {n2!r} overlap in the data section", path=p)
    end = max((e.end for e in tensors.values()), default=start)
    if end != size:  # the safetensors library refuses this too (MetadataIncompleteBuffer)
        raise CorruptCheckpoint(
            f"{p}: {size - end} trailing bytes after the last tensor (the header covers {end - start} of "
            f"{size - start}); the file was appended to or extended after the save",
            hint="re-create the file, or restore it from a good copy",
            path=p,
        )
    ordered = dict(sorted(tensors.items(), key=lambda kv: kv[1].begin))
    return Header(ordered, meta, start, size)


def _entry(p: str, name: str, info: Any, start: int, size: int) -> HeaderEntry:
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise CorruptCheckpoint(f"{p}: tensor {name!r:.80} needs exactly dtype, shape, data_offsets", path=p)
    dt, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dt, str) or dt not in DTYPES:
        raise Unsupported(
            f"{p}: tensor {name!r:.80} has dtype {dt!r:.40}; known: {', '.join(DTYPES)}", path=p
        )
    if not (isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape)):
        raise CorruptCheckpoint(f"{p}: tensor {name!r:.80} has a bad shape {shape!r:.80}", path=p)
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
        raise CorruptCheckpoint(f"{p}: tensor {name!r:.80} has bad data_offsets {offs!r:.80}", path=p)
    lo, hi = offs
    if not 0 <= lo <= hi or hi - lo != math.prod(shape) * DTYPES[dt].itemsize:
        raise CorruptCheckpoint(
            f"{p}: tensor {name!r:.80} data_offsets {offs} do not hold shape {shape} of {dt}", path=p
        )
    if start + hi > size:
        raise CorruptCheckpoint(
            f"{p}: tensor {name!r:.80} ends at byte {start + hi} but the file has {size} (truncated?)",
            hint="re-copy or re-download the file",
            path=p,
        )
    return HeaderEntry(DTYPES[dt], tuple(shape), start + lo, start + hi)


def encode_header(
    specs: Sequence[Spec],
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """The length prefix and JSON header for tensors ``(name, dtype, shape)`` laid out in order, padded so
    the data section starts 8-aligned (as safetensors does)."""
    return plan_file(specs, metadata).header


def plan_file(
    specs: Sequence[Spec],
    metadata: Mapping[str, str] | None = None,
) -> FilePlan:
    """The header of a file holding tensors ``(name, dtype, shape)`` in order, and where their bytes go."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    starts = []
    for name, given, shape in specs:
        dtype = dtypes.lookup(str(given))
        if dtype is None or dtype not in NAMES:
            raise Unsupported(f"{name}: safetensors cannot store {given}")
        if name in header:
            raise ValueError(f"tensor {name!r} would be written twice")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        starts.append(offset)
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    names = tuple(name for name, _, _ in specs)
    return FilePlan(head, tuple(len(head) + o for o in starts), len(head) + offset, names)


def write_file(
    path: Path,
    items: Sequence[WriteItem],
    *,
    metadata: Mapping[str, str] | None = None,
    on_bytes: Callable[[int], None] | None = None,
    workers: int | None = None,
    sidecar: bool = True,
    opts: WriteOptions | None = None,
    on_stats: Callable[[dict[str, Any]], None] | None = None,
    crc: bool = False,
    block: int | None = None,
    algorithm: str = "crc32",
) -> FileRecord:
    """Stream ``items`` into a new safetensors file at ``path`` (which must not exist): header first, then
    each tensor in bounded chunks (a whole in-memory host tensor of the output dtype straight from its
    memory); with ``sidecar`` also ``<path>.crc32.json`` (block digests, ``BLOCK_BYTES`` unless ``block``
    says otherwise); with ``crc`` each tensor's CRC-32 in the record; with
    ``block`` the record's digest is the ``algorithm`` digest of each ``block`` bytes
    (``zckpt.storage.digest``)."""
    from zckpt.stream import pipeline

    plan = plan_file([(it.name, it.dtype, it.shape) for it in items], metadata)
    if sidecar and block is None:  # a block-digest sidecar: hashed on several cores as it is written
        block = BLOCK_BYTES
    from zckpt.storage.sink import HashingSink  # the write path (O_DIRECT, numpy): not needed to read

    sink = HashingSink(path, opts, plan.regions() if crc else (), block, algorithm, size=plan.size)
    try:
        sink.write(plan.header)
        run: list[WriteItem] = []
        for it in items:
            mem = _host_bytes(it)
            if mem is None:
                run.append(it)
                continue
            if run:
                pipeline.write_items(sink, run, workers=workers, on_bytes=on_bytes)
                run = []
            sink.write(mem)
            if on_bytes is not None:
                on_bytes(len(mem))
        if run:
            pipeline.write_items(sink, run, workers=workers, on_bytes=on_bytes)
    except BaseException:
        sink.abort()  # nothing of it appears (an object upload is aborted)
        raise
    sink.close()
    if on_stats is not None:
        on_stats(sink.stats())
    if sidecar:
        sink.write_sidecar()
    return _record(path, sink, plan if crc else None)


def _record(path: Path, sink: HashingSink, plan: FilePlan | None) -> FileRecord:
    crcs = dict(zip(plan.names, sink.crcs, strict=True)) if plan is not None else {}
    return FileRecord(path.name, sink.digest(), sink.tell(), crcs)


def _host_bytes(it: WriteItem) -> memoryview | None:
    """The bytes of ``it`` when they lie in one contiguous host tensor of the output dtype, else None (a
    ``DeferredEntry``'s pieces lie in files: not resolved here, ahead of the write)."""
    if it.entry.deferred:
        return None
    ps = it.entry.pieces
    if it.span is not None or it.pad or len(ps) != 1 or ps[0].value is None or ps[0].grid:
        return None
    torch = sys.modules.get("torch")
    if torch is None:  # no tensor was made: the value is a Python number
        return None

    from zckpt.stream.items import tensor_bytes

    v = ps[0].value
    if not isinstance(v, torch.Tensor):  # a Python number: no tensor memory to write from
        return None
    if v.device.type != "cpu" or v.dtype != it.dtype or not v.is_contiguous() or v.numel() != it.numel:
        return None
    return tensor_bytes(v.reshape(-1))


def write_views(
    path: Path,
    views: Sequence[memoryview],
    opts: WriteOptions | None = None,
    on_stats: Callable[[dict[str, Any]], None] | None = None,
    plan: FilePlan | None = None,
    block: int | None = None,
    algorithm: str = "crc32",
) -> FileRecord:
    """A new file at ``path`` made of ``views`` in order (a file laid out in memory, e.g. by ``plan_file``):
    the views must stay unchanged until this returns, which lets aligned memory go to the device without
    a copy while it is hashed. Given the ``plan`` of that layout, each tensor's CRC-32 is in the record;
    ``block``, ``algorithm``: as for ``write_file``."""
    from zckpt.storage.sink import HashingSink

    size = sum(v.nbytes for v in views)
    sink = HashingSink(path, opts, plan.regions() if plan is not None else (), block, algorithm, size=size)
    try:
        for v in views:
            sink.write(v, stable=True)
    except BaseException:
        sink.abort()  # nothing of it appears (an object upload is aborted)
        raise
    sink.close()
    if on_stats is not None:
        on_stats(sink.stats())
    return _record(path, sink, plan)


class StreamWriter:
    """A safetensors file whose tensors arrive one at a time, in the declared order (``write``), so the
    writer never holds more than one; ``commit()`` closes it and returns its record."""

    def __init__(
        self,
        path: Path,
        specs: Sequence[Spec],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        self._order = [(n, d, tuple(s)) for n, d, s in specs]
        raw = encode_header(self._order, metadata)
        from zckpt.storage.sink import HashingSink

        self._sink = HashingSink(self.path)
        self._next = 0
        try:
            self._sink.write(raw)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, t: torch.Tensor) -> None:
        want, dtype, shape = self._order[self._next]
        if name != want or t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(
                f"{self.path}: expected {want} {dtype} {list(shape)}, got {name} {t.dtype} {list(t.shape)}"
            )
        from zckpt.stream.items import tensor_bytes

        self._sink.write(tensor_bytes(t.detach().to("cpu").reshape(-1)))
        self._next += 1

    def commit(self) -> FileRecord:
        if self._next != len(self._order):
            raise ValueError(f"{self.path}: {len(self._order) - self._next} tensors were never written")
        try:
            self._sink.close()
        except BaseException:
            self.abort()
            raise
        return FileRecord(self.path.name, self._sink.digest(), self._sink.tell())

    def abort(self) -> None:
        """Remove the file (also when closing it fails: a full disk fails the final flush); an object's upload
        is aborted."""
        try:
            self._sink.abort()
        finally:
            self.path.unlink(missing_ok=True)


def read_tensor(path: str | Location, key: str) -> torch.Tensor | None:
    """One small tensor of a safetensors file, copied out; None when the file has no ``key``."""
    e = read_header(path).tensors.get(key)
    if e is None:
        return None
    import torch

    out = torch.empty(e.numel, dtype=e.dtype.torch)
    fileio.read_into(str(path), e.begin, out)
    return out.view(e.shape)


def check_file(f: Location) -> list[Problem]:
    """The header parses strictly (``read_header`` refuses trailing bytes) and, as the spec requires, the
    data section is exactly covered: no holes."""
    try:
        h = read_header(f)
    except ZckptError as e:
        return [problem_from(e, f)]
    end = h.data_start
    for name, t in h.tensors.items():
        if t.begin > end:
            return [
                Problem(str(f), f"{t.begin - end}-byte hole in the data section before {name!r}", "corrupt")
            ]
        end = max(end, t.end)
    return []
