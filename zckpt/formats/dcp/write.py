"""``zckpt reshard SRC OUT --to dcp --world N``: a DCP checkpoint of any ``Checkpoint``, in torchtitan's
layout, that ``dcp.load`` + ``set_model_state_dict`` / ``set_optimizer_state_dict`` load into an FSDP2 model
and its optimizer at any world size (DCP reshards at load by box intersection). ``OUT`` is the DCP folder.

What is written (keys as torchtitan's ``CheckpointManager`` and ``flatten_optimizer_state_dict=True`` save):

- model tensors at the root under their FQN, both names of a tied pair (strict loading wants both);
  params, frozen params and optimizer states cut on dim 0 into ``N`` chunks with ``torch.chunk`` sizes, as
  FSDP2 at world ``N`` shards them (rank ``r`` -> ``__r_0.distcp``); buffers and 0-d tensors whole;
- ``optimizer.state.<fqn>.<k>`` (``step`` as a 0-d float32 tensor, as torch's Adam keeps it) and
  ``optimizer.param_groups.<fqn>.<k>`` for every option of the parameter's group, ``None`` values included;
- ``lr_scheduler.*`` (the source's scheduler state), ``train_state.step`` (the step counter), the client
  state (a DCP source's ``train_state``/``dataloader`` keys at their paths, another source's under
  ``client_state.*``), a DCP source's opaque values copied byte for byte;
- ``.metadata`` last (``finish``), pickled under DCP's class names (``pickler``).

Every item is one ``torch.save``-compatible zip archive (``zckpt.codecs.torchzip_write``) streamed into a
``HashingSink`` (a ``.sha256.json`` block-digest sidecar per file, hashed on several cores); the folder is
staged and published whole by ``ops/reshard``.
"""

from __future__ import annotations

import functools
import math
import mmap
import zlib
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from zckpt import partition
from zckpt.checkpoint import Checkpoint
from zckpt.codecs import zipdir
from zckpt.codecs.safetensors import FileRecord
from zckpt.codecs.torchzip_write import StorageSlot, TensorSlot, TorchZipWriter
from zckpt.codecs.torchzip_write import dumps as pickle_obj
from zckpt.errors import InvalidArgument, KeyMappingError
from zckpt.formats.base import CheckpointWriter, OnFile, WritePlan
from zckpt.formats.dcp.metadata import METADATA
from zckpt.formats.dcp.pickler import Stored, TensorSpec, dumps
from zckpt.formats.dcp.read import NAME
from zckpt.model import Role, TensorEntry
from zckpt.storage import fileio
from zckpt.storage.digest import BLOCK_BYTES
from zckpt.storage.sink import FillRing, HashingSink
from zckpt.stream import pipeline
from zckpt.stream.fill import layout_of_items
from zckpt.stream.items import WriteItem, tensor_bytes

Path_ = tuple[str | int, ...]
COPY_BYTES = 8 << 20


@dataclass(frozen=True)
class Item:
    """One stored item: a tensor chunk (``entry`` + box), a value (``value``) or a verbatim ``raw`` copy."""

    key: str
    rank: int
    entry: TensorEntry | None = None
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    value: Any = None
    raw: tuple[str, int, int] | None = None


@dataclass(frozen=True)
class DcpPlan(WritePlan):
    tensors: tuple[TensorSpec, ...] = ()
    byte_keys: tuple[str, ...] = ()
    paths: Mapping[str, Path_] = field(default_factory=dict)
    items: tuple[Item, ...] = ()


@dataclass(frozen=True)
class DcpRecord(FileRecord):
    """A written ``.distcp`` file and where each of its items is."""

    stored: tuple[Stored, ...] = ()


def flatten(value: Any, path: Path_) -> Iterator[tuple[Path_, Any]]:
    """DCP's flattening (``_traverse.traverse_state_dict``): dicts are walked, empty ones vanish; a list is
    one leaf unless it holds a dict, a tensor or such a list; tuples and everything else are leaves (a tuple
    holding a tensor is walked too: its tensors are written as tensor items)."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from flatten(v, (*path, str(k)))
    elif isinstance(value, (list, tuple)) and (not _terminal(list(value)) or _holds_entry(value)):
        for i, v in enumerate(value):
            yield from flatten(v, (*path, i))
    else:
        yield path, value


def _holds_entry(v: Any) -> bool:
    if isinstance(v, TensorEntry):
        return True
    if isinstance(v, Mapping):
        return any(_holds_entry(x) for x in v.values())
    return isinstance(v, (list, tuple)) and any(_holds_entry(x) for x in v)


def _terminal(values: list[Any]) -> bool:
    for v in values:
        if isinstance(v, (Mapping, TensorEntry)):
            return False
        if isinstance(v, list) and not _terminal(v):
            return False
    return True


def _option(k: str, v: Any) -> Any:
    """A param-group option back in torch's own type (``betas`` is a tuple)."""
    return tuple(v) if k == "betas" and isinstance(v, list) else v


class _Planner:
    """Builds the plan: keys, paths, tensor boxes and each item's rank."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.paths: dict[str, Path_] = {}
        self.tensors: list[TensorSpec] = []
        self.byte_keys: list[str] = []
        self.items: list[Item] = []
        self._whole = 0

    def key(self, path: Path_) -> str:
        k = ".".join(map(str, path))
        if k in self.paths:
            raise KeyMappingError(
                f"DCP writer: key {k!r:.100} would be written twice", hint="rename one of them"
            )
        self.paths[k] = path
        return k

    def _next_rank(self) -> int:
        self._whole += 1
        return (self._whole - 1) % self.world

    def tensor(self, path: Path_, e: TensorEntry, *, shard: bool, dtype: torch.dtype | None = None) -> None:
        k = self.key(path)
        dt = dtype or e.dtype.torch
        shape = () if dtype is not None and e.numel == 1 else e.shape
        if shard and shape and shape[0] and e.numel:
            boxes = []
            for r in range(self.world):
                lo, n = partition.chunk_range(shape[0], self.world, r)
                if n > 0:
                    off, size = (lo, *[0] * (len(shape) - 1)), (n, *shape[1:])
                    boxes.append((off, size))
                    self.items.append(Item(k, r, e, off, size, dt))
        else:
            off = tuple(0 for _ in shape)
            boxes = [(off, shape)]
            self.items.append(Item(k, self._next_rank(), e, off, shape, dt))
        self.tensors.append(TensorSpec(k, dt, shape, tuple(boxes)))

    def value(self, path: Path_, v: Any) -> None:
        k = self.key(path)
        self.byte_keys.append(k)
        self.items.append(Item(k, self._next_rank(), value=v))

    def raw(self, path: Path_, f: str, offset: int, length: int) -> None:
        k = self.key(path)
        self.byte_keys.append(k)
        self.items.append(Item(k, self._next_rank(), raw=(f, offset, length)))


def _model(p: _Planner, ckpt: Checkpoint) -> None:
    tied = ckpt.meta.tied
    for e in ckpt.model_entries():
        p.tensor((e.name,), e, shard=e.role is not Role.BUFFER)
        for alias in (a for a, o in tied.items() if o == e.name):
            p.tensor((alias,), e, shard=e.role is not Role.BUFFER)


def _optimizer(p: _Planner, ckpt: Checkpoint) -> list[str]:
    """Optimizer states and the flattened param groups; notes on what was left out."""
    notes: list[str] = []
    params = {e.name: e for e in ckpt.model_entries() if e.role is Role.PARAM}
    for e in (e for e in ckpt.entries.values() if e.role is Role.OPTIM):
        path: Path_ = ("optimizer", f"state.{e.name}.{e.state}")
        if e.state == "step" and e.numel == 1:
            p.tensor(path, e, shard=False, dtype=torch.float32)
        else:
            p.tensor(path, e, shard=e.name in params and e.shape == params[e.name].shape)
    opt = ckpt.meta.state.optimizer
    if opt is None:
        return notes
    for g in opt.groups:
        for name in g.params:
            if name not in params:
                continue
            for k, v in g.options.items():
                p.value(("optimizer", f"param_groups.{name}.{k}"), _option(k, v))
    grouped = {n for g in opt.groups for n in g.params}
    lost = [n for n in params if n not in grouped]
    if lost:
        notes.append(f"params {lost[:3]} belong to no optimizer param group: no param_groups keys written")
    if opt.groups and not any("initial_lr" in g.options for g in opt.groups):
        notes.append("the param groups have no initial_lr (no torch LR scheduler ran on them): create the "
                     "scheduler after loading, or load with strict=False")  # fmt: skip
    return notes


def _state(p: _Planner, ckpt: Checkpoint) -> list[str]:
    """Scheduler, step counter, client state and (from a DCP source) the opaque values copied verbatim."""
    st = ckpt.meta.state
    private = st.private(NAME)
    if st.scheduler is not None:
        for path, v in flatten(st.scheduler, ("lr_scheduler",)):
            p.value(path, v)
    client = dict(st.client_state)
    root: Path_ = () if private else ("client_state",)
    raw = private.get("raw") or {}
    steps = st.counters.global_steps
    if (
        steps is not None
        and "train_state" not in client
        and not any(r["path"][:1] == ["train_state"] for r in raw.values())
    ):
        p.value(("train_state", "step"), steps)
    for path, v in flatten(client, root):
        if isinstance(v, TensorEntry):
            p.tensor(path, v, shard=False)
        else:
            p.value(path, v)
    for r in raw.values():
        p.raw(tuple(r["path"]), r["file"], r["offset"], r["length"])
    if any(str(r["path"][0]) == "dataloader" for r in raw.values()) and ckpt.meta.world_size != p.world:
        return [f"dataloader states are copied as saved at world {ckpt.meta.world_size}; exclude them when "
                "loading at another world size (torchtitan does)"]  # fmt: skip
    return []


class _Rel:
    """A sink seen from ``base``: each archive's zip offsets and 64-byte alignment count from its own start,
    as in a standalone ``torch.save`` file (DCP loads every item from its own byte range). Writes under
    ``_SMALL`` bytes (zipfile's headers, descriptors, directory entries and small records: ~40 per archive)
    gather here and reach the sink as one write before the next big one, a fill, or ``flush``."""

    _SMALL = 64 << 10

    def __init__(self, sink: HashingSink) -> None:
        self.sink, self.base = sink, sink.tell()
        self._held = bytearray()

    def write(self, b: Any) -> int:
        n = len(memoryview(b).cast("B"))
        if n < self._SMALL:
            self._held += b
            if len(self._held) >= self._SMALL:
                self.flush()
            return n
        self.flush()
        return self.sink.write(b)

    def write_owned(self, mv: memoryview) -> list[Future[None]]:
        self.flush()
        return self.sink.write_owned(mv)

    def fill_ring(self) -> FillRing:
        self.flush()
        return self.sink.fill_ring()

    def reserve(self) -> memoryview:
        self.flush()
        return self.sink.reserve()

    def commit(self, n: int) -> None:
        self.sink.commit(n)

    @property
    def piece_bytes(self) -> int:
        return self.sink.piece_bytes

    @property
    def head_room(self) -> int:
        self.flush()  # the room left in the sink's buffer once the held bytes are in it
        return self.sink.head_room

    @property
    def in_flight(self) -> int:
        return self.sink.in_flight

    def tell(self) -> int:
        return self.sink.tell() + len(self._held) - self.base

    def flush(self) -> None:
        if self._held:
            self.sink.write(bytes(self._held))
            self._held.clear()


@functools.lru_cache(maxsize=4096)
def _tensor_pickle(dtype: torch.dtype, sizes: tuple[int, ...]) -> bytes:
    """A chunk's ``data.pkl``: the same for every chunk of one dtype and shape (thousands per checkpoint)."""
    return pickle_obj(TensorSlot(StorageSlot("0", dtype, math.prod(sizes)), sizes))


_SCALARS = (bool, int, float, str, type(None))


@functools.lru_cache(maxsize=4096)
def _scalar_pickle(kind: str, text: str, value: Any) -> bytes:
    """A plain value's ``data.pkl`` (an optimizer option of every parameter: thousands of equal ones), keyed
    by type and ``repr`` (``0.0 == -0.0`` and ``1 == 1.0 == True`` must not share a pickle)."""
    return pickle_obj(value)


def _value_pickle(v: Any) -> bytes:
    return _scalar_pickle(type(v).__name__, repr(v), v) if type(v) in _SCALARS else pickle_obj(v)


class _Recorder:
    """A sink that keeps the bytes written to it, but for one big write it only counts (``_frame``)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.pos = 0
        self.gap: tuple[int, int] | None = None

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        if len(mv) >= _Rel._SMALL:
            if self.gap is not None:
                raise RuntimeError("a second big write in one archive frame")
            self.gap = (self.pos, len(mv))
        else:
            self.parts.append(bytes(mv))
        self.pos += len(mv)
        return len(mv)

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


@dataclass(frozen=True)
class _Frame:
    """A chunk archive around its data: the bytes before and after (``TorchZipWriter``'s own, made once per
    pickle and size), and where the data's CRC-32 goes in ``after`` (its data descriptor and its directory
    entry)."""

    before: bytes
    after: bytes
    crc_at: tuple[int, int]


@functools.lru_cache(maxsize=1024)
def _frame(pickled: bytes, nbytes: int) -> _Frame:
    """The frame of every chunk archive with this ``data.pkl`` and ``nbytes`` of data: ``TorchZipWriter``
    writes one with zeros as data (an anonymous mapping, read only by the CRC-32), and the data's CRC-32 is
    found where zip puts it: right after the data (its descriptor) and in data/0's directory entry."""
    rec = _Recorder()
    zw = TorchZipWriter(cast(HashingSink, rec))
    zw.write_header_records(pickled)
    zeros = mmap.mmap(-1, max(nbytes, 1))
    # Closed only on success: an exception (Ctrl-C's KeyboardInterrupt above all) leaves views of the
    # mapping in its traceback's frames, and closing it then raises BufferError in place of that exception;
    # the mapping is unmapped when the last view goes.
    view = memoryview(zeros)[:nbytes]
    crc = zlib.crc32(view).to_bytes(4, "little")
    zw.write_record("data/0", [view] if nbytes >= _Rel._SMALL else [bytes(view)], nbytes)
    view.release()
    zeros.close()
    zw.close()
    whole = b"".join(rec.parts)
    if rec.gap is None:  # the data is in ``whole``: where its record says
        d = zipdir.read(lambda n, at: whole[at : at + n], len(whole))
        e = d.entries[_DATA0.decode()]
        head = whole[e.header_offset : e.header_offset + zipdir.LOCAL_HEADER.size + len(e.orig)]
        start = zipdir.data_start(e, head, len(whole))
        before, after = whole[:start], whole[start + nbytes :]
    else:
        before, after = whole[: rec.gap[0]], whole[rec.gap[0] :]
    entry = after.find(_DATA0) - 46  # data/0's directory entry (its local header is in ``before``)
    if after[:8] != b"PK\x07\x08" + crc or entry < 0 or after[entry : entry + 4] != b"PK\x01\x02":
        raise RuntimeError("chunk archive frame: no data descriptor or directory entry for data/0")
    if after[entry + 16 : entry + 20] != crc:
        raise RuntimeError("chunk archive frame: data/0's directory entry holds another CRC-32")
    return _Frame(before, after, (4, entry + 16))


_DATA0 = b"archive/data/0"


def _archive(sink: HashingSink, pickled: bytes, data: WriteItem | None) -> None:
    if data is None:
        rel = _Rel(sink)
        zw = TorchZipWriter(cast(HashingSink, rel))
        zw.write_header_records(pickled)
        zw.close()
        rel.flush()
        return
    frame = _frame(pickled, data.nbytes)
    rel = _Rel(sink)
    rel.write(frame.before)
    crc = pipeline.fill(cast(pipeline.BlockSink, rel), layout_of_items([data]), crc=True)
    after = bytearray(frame.after)
    for at in frame.crc_at:
        after[at : at + 4] = crc.to_bytes(4, "little")
    rel.write(after)
    rel.flush()


def _write_item(sink: HashingSink, it: Item, ckpt: Checkpoint) -> None:
    if it.raw is not None:
        f, offset, length = it.raw
        for lo in range(0, length, COPY_BYTES):
            buf = torch.empty(min(COPY_BYTES, length - lo), dtype=torch.uint8)
            fileio.read_into(f, offset + lo, buf)
            sink.write(tensor_bytes(buf))
        return
    if it.entry is None:
        _archive(sink, _value_pickle(it.value), None)
        return
    e, dt = it.entry, cast(torch.dtype, it.dtype)
    n = math.prod(it.sizes)
    inner = n // it.sizes[0] if it.sizes and it.sizes[0] else 1
    lo = it.offsets[0] * inner if it.offsets else 0
    item = WriteItem(it.key, e, dt, span=(lo, lo + n))
    _archive(sink, _tensor_pickle(dt, tuple(it.sizes)), item)


class DcpWriter(CheckpointWriter):
    """``zckpt reshard --to dcp`` (see the module doc)."""

    generations = True  # ``.metadata``'s storage data names each item's file

    def plan(self, ckpt: Checkpoint, *, world: int, stage: int | None, tag: str) -> WritePlan:
        if stage is not None:
            raise InvalidArgument(
                f"--stage {stage}: a DCP checkpoint has no ZeRO stage", hint="leave out --stage with --to dcp"
            )
        p = _Planner(world)
        _model(p, ckpt)
        notes = _optimizer(p, ckpt) + _state(p, ckpt)
        return DcpPlan(
            world=world,
            stage=None,  # not ZeRO: the summary must not call it "ZeRO-3"
            tag=tag,
            units=world,
            notes=tuple(notes),
            digest=(len(p.tensors), len(p.byte_keys), len(p.items)),
            tensors=tuple(p.tensors),
            byte_keys=tuple(p.byte_keys),
            paths=dict(p.paths),
            items=tuple(p.items),
        )

    def write_unit(
        self, ckpt: Checkpoint, plan: WritePlan, out: Path, unit: int, on_file: OnFile
    ) -> list[FileRecord]:
        assert isinstance(plan, DcpPlan)
        mine = [it for it in plan.items if it.rank == unit]
        if not mine:
            return []
        mine.sort(key=lambda it: it.entry is not None)  # bytes items first, as DCP writes them
        name = f"__{unit}_0.{plan.generation}.distcp" if plan.generation else f"__{unit}_0.distcp"
        out.mkdir(parents=True, exist_ok=True)
        sink = HashingSink(out / name, block=BLOCK_BYTES)  # its digest: blocks, hashed on several cores
        stored = []
        try:
            for it in mine:
                start = sink.tell()
                _write_item(sink, it, ckpt)
                off = it.offsets if it.entry is not None else None
                stored.append(Stored(it.key, off, name, start, sink.tell() - start))
        except BaseException:
            sink.abort()  # nothing of it appears (an object upload is aborted)
            raise
        sink.close()
        sink.write_sidecar()
        on_file(name, sink.tell())
        return [DcpRecord(name, sink.digest(), sink.tell(), stored=tuple(stored))]

    def finish(
        self, ckpt: Checkpoint, plan: WritePlan, out: Path, records: Sequence[FileRecord], on_file: OnFile
    ) -> None:
        """``.metadata`` from every unit's records: written last, its presence marks a complete save."""
        assert isinstance(plan, DcpPlan)
        stored = [s for r in records if isinstance(r, DcpRecord) for s in r.stored]
        digests = [f"{r.name} {r.digest.sha256 or ' '.join(r.digest.blocks)}" for r in records]
        data = dumps(plan.tensors, plan.byte_keys, plan.paths, stored, digests=digests)
        with HashingSink(out / METADATA) as sink:  # an error: nothing of it appears (``HashingSink.abort``)
            sink.write(data)
        on_file(METADATA, len(data))
