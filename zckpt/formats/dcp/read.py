"""Opening a DCP checkpoint lazily: metadata now, chunk locations now or at first read, tensor bytes on read.

For each DCP folder: ``.metadata`` (``metadata``), each tensor's boxes checked to tile it (``boxes``), each
distinct non-empty chunk located in its file (``locate``, ``chunks``: the embedded archive's zip directory and
pickle only), each bytes item decoded or kept opaque (``values``). A model-only open (consolidate, diff)
locates a tensor's chunks when its bytes are first needed, on the thread that reads them
(``locate.Locator``, ``model.DeferredEntry``): the writing starts right after the ``.metadata`` load. Keys
become zckpt entries by their path (``layout.classify``): model tensors under their FQN, optimizer states as
``<fqn>:<state>``, the rest the ``TrainingState`` (``state``).

Roles (DCP records none): a model tensor with optimizer state is a trainable ``PARAM``; a non-floating one
a ``BUFFER``. A floating tensor without optimizer state, in a checkpoint holding optimizer state, is
``FROZEN`` when its last name part is ``weight`` or ``bias`` (the names ``nn.Module`` gives parameters) and a
``BUFFER`` otherwise (``running_mean``, ``pos_scale``); in a model-only checkpoint every floating tensor is a
``PARAM`` (nothing there tells trainable from frozen).

Tied weights: DCP stores both names of a tied pair (bytes written twice) and optimizer state under the first
only. A name without optimizer state whose boxes, dtype and shape equal those of a trainable name, and whose
chunks' zip CRC-32s and sizes are all equal to that name's (safetensors chunks: whose bytes are equal), is
mapped as a tied alias of it: one entry, read once, consolidated HF-style; ``verify`` compares the bytes.
Model-only checkpoints keep both names (equal frozen tensors, e.g. untrained norms, are not ties).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zckpt import dtypes
from zckpt.checkpoint import Checkpoint
from zckpt.dtypes import DType
from zckpt.errors import CorruptCheckpoint, ShardMismatch
from zckpt.formats.dcp import hfshards, state
from zckpt.formats.dcp.boxes import box_piece, distinct
from zckpt.formats.dcp.chunks import ChunkData, Files
from zckpt.formats.dcp.layout import NAME as layout_NAME
from zckpt.formats.dcp.layout import Slot, Source, classify, rank_of, resolve
from zckpt.formats.dcp.locate import Locator, blob_files, tensor_chunks
from zckpt.formats.dcp.metadata import METADATA, DcpMetadata, StorageKey, TensorMeta, load_metadata
from zckpt.formats.dcp.values import Value, decode
from zckpt.model import DeferredEntry, Piece, Role, TensorEntry, precision_of
from zckpt.state import CheckpointMeta, TrainingState
from zckpt.storage import collector, session
from zckpt.storage.location import Location, location

NAME = layout_NAME  # the format's name (``layout``: what detecting it imports)
FROZEN_NAMES = ("weight", "bias")


@dataclass
class Loaded:
    """What the folders of one checkpoint hold, keys in state-dict order."""

    keys: list[str] = field(default_factory=list)
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    tensors: dict[str, TensorMeta] = field(default_factory=dict)
    data: dict[StorageKey, ChunkData] = field(default_factory=dict)
    values: dict[str, Value] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    serialization: set[str] = field(default_factory=set)
    lazy: dict[str, Locator] = field(default_factory=dict)
    """Tensors whose chunks a ``Locator`` is locating (a lazy open), not in ``data``."""

    def chunk(self, key: str, offsets: tuple[int, ...]) -> ChunkData:
        loc = self.lazy.get(key)
        return self.data[(key, offsets)] if loc is None else loc.chunks(key)[offsets]

    def merge(self, other: Loaded, where: Location) -> None:
        dup = next((k for k in other.keys if k in self.paths), None)
        if dup is not None:
            raise CorruptCheckpoint(f"{where}: key {dup!r:.100} is saved in two DCP folders", path=str(where))
        self.keys += other.keys
        self.paths.update(other.paths)
        self.tensors.update(other.tensors)
        self.data.update(other.data)
        self.values.update(other.values)
        self.files += other.files
        self.serialization |= other.serialization
        self.lazy.update(other.lazy)


def load_folder(
    folder: Location,
    *,
    trust_pickle: bool = False,
    model_only: bool = False,
    md: DcpMetadata | None = None,
    lazy: bool = False,
) -> Loaded:
    """Metadata (``md`` when already parsed), chunk locations and decoded values of one DCP folder
    (``model_only``: the model tensors' chunks only; every other item is checked against the metadata but
    not opened). ``lazy``: each tensor's chunks are located when first read (``locate.Locator``), not now."""
    md = md if md is not None else load_metadata(folder)
    out = Loaded(list(md.keys), dict(md.paths), dict(md.tensors))
    keep = _model_and_step(md) if model_only else None
    kept = [k for k in md.keys if keep is None or k in keep]
    tensors = {k for k in kept if k in md.tensors}
    files = Files(folder)  # a lazy open hands it to its Locator, which closes it
    try:
        blobs = blob_files(files, md)
        for key in kept:
            if key in tensors:
                if not lazy:
                    out.data.update(((key, o), d) for o, d in tensor_chunks(files, md, key, blobs).items())
                continue
            info = md.storage.get((key, None))
            if info is None:
                raise ShardMismatch(
                    f"{md.source}: no storage recorded for value {key!r:.100}", path=md.source
                )
            out.values[key] = decode(files, key, info, trust_pickle=trust_pickle)
        used = sorted({str(files.path(i)) for i in md.storage.values()})
        check_disjoint(md, blobs)
    except BaseException:
        files.close()
        raise
    if lazy:
        out.lazy = dict.fromkeys(tensors, Locator(files, md, tensors, blobs))
    else:
        files.close()
    out.serialization = {
        "safetensors" if info.file in blobs else "torch_save"
        for k, info in md.storage.items()
        if k[1] is not None and k[0] in tensors and info.length
    }
    out.files = [md.source, *used]
    return out


def _recent() -> dict[str, tuple[DcpMetadata, Loaded]]:
    """The folders the running operation's last full ``read`` loaded (by path): the ``.metadata`` parse it
    used and what they hold (its ``Storage.cache("dcp.read")``). Never mutated (``read`` merges them into a
    fresh ``Loaded``). A model-only read (lazy) is not kept."""
    return session.current().cache("dcp.read")


def _keep(folder: Location, md: DcpMetadata, part: Loaded) -> None:
    recent = _recent()
    if len(recent) >= 4:
        recent.clear()
    recent[str(folder)] = (md, part)


def model_of(folder: Location, md: DcpMetadata | None) -> Loaded:
    """The model chunks of the DCP folder whose parsed ``.metadata`` is ``md``: what the last full ``read`` of
    it loaded when it used this very parse (the same object: ``load_metadata`` gives one parse per file
    content), else loaded model-only now (``md`` None: parsed now). verify's checks after its open so read the
    folder's chunk archives once, not twice."""
    got = _recent().get(str(folder))
    if got is not None and md is not None and got[0] is md:
        return got[1]
    return load_folder(folder, model_only=True, md=md)


def _model_and_step(md: DcpMetadata) -> set[str]:
    """The keys a model-only open reads: the model tensors, and what gives the step (``state.counters``):
    the client's ``train_state`` values (torchtitan) and the first optimizer ``step`` state (one archive)."""
    keep: set[str] = set()
    step: str | None = None
    for key in md.keys:
        s = classify(md.paths[key], key in md.tensors)
        if s.kind == "model" or (s.kind == "client" and s.path[:1] == ("train_state",)):
            keep.add(key)
        elif step is None and s.kind == "optim" and s.state == "step":
            step = key
    return keep if step is None else keep | {step}


def check_disjoint(md: DcpMetadata, blobs: frozenset[str]) -> None:
    """No two items share bytes of a file (a damaged offset pointing at another item's archive would read
    that item's values under this key), whether or not they were opened; an empty chunk's archive too (it
    is never read, but a bytes item pointed at it would be). Tensor chunks in the safetensors blob of a file
    of ``blobs`` all start at the blob: exempt from that, but a blob's item is exactly its chunk's bytes (0
    for an empty chunk): another length names another item."""
    numel: dict[StorageKey, int] = {(k, c.offsets): c.numel for k, t in md.tensors.items() for c in t.chunks}
    by_file: dict[str, list[tuple[int, int, StorageKey]]] = {}
    for k, info in md.storage.items():
        if k[1] is not None and info.file in blobs:
            want = numel.get(k, 0) * md.tensors[k[0]].dtype.itemsize
            if info.length != want:
                raise CorruptCheckpoint(
                    f"{md.source}: storage_data gives {_name(k)} {info.length} bytes of {info.file}'s "
                    f"safetensors blob, where the chunk holds {want}",
                    hint="the .metadata file is damaged; restore it from the original save",
                    path=md.source,
                )
            continue
        if not info.length:  # no bytes to share
            continue
        by_file.setdefault(info.file, []).append((info.offset, info.offset + info.length, k))
    for f, items in by_file.items():
        items.sort(key=lambda it: (it[0], it[1]))
        for (_, a1, ka), (b0, b1, kb) in zip(items, items[1:], strict=False):
            if b0 < a1:
                where = str(md.folder / f)
                raise CorruptCheckpoint(
                    f"{where}: the items of {_name(ka)} and {_name(kb)} overlap at bytes "
                    f"[{b0}, {min(a1, b1)})",
                    hint="the .metadata file is damaged; restore it from the original save",
                    path=where,
                )


def _name(k: StorageKey) -> str:
    return f"{k[0]!r:.60}" + ("" if k[1] is None else f" chunk {list(k[1])}")


def load_hf_shards(folder: Location) -> Loaded:
    tensors, data, files = hfshards.load(folder)
    chunks: dict[StorageKey, ChunkData] = {(k, o): d for (k, o), d in data.items()}
    return Loaded(list(tensors), {k: (k,) for k in tensors}, tensors, chunks, {}, files, {"hf-shards"})


def pieces(ld: Loaded, key: str) -> tuple[Piece, ...]:
    t = ld.tensors[key]
    out = []
    for box in distinct(t.chunks):
        d = ld.chunk(key, box.offsets)
        p = box_piece(t.shape, box, d.file, d.byte_offset, t.dtype, rank_of(d.file), d.check)
        if p is not None:
            out.append(p)
    return tuple(out)


def _same_bytes(ld: Loaded, a: str, b: str) -> bool:
    ta, tb = ld.tensors[a], ld.tensors[b]
    if (ta.dtype, ta.shape) != (tb.dtype, tb.shape):
        return False
    ba, bb = distinct(ta.chunks), distinct(tb.chunks)
    if sorted((c.offsets, c.sizes) for c in ba) != sorted((c.offsets, c.sizes) for c in bb):
        return False
    da = [ld.chunk(a, c.offsets) for c in ba]
    db = [ld.chunk(b, c.offsets) for c in ba]
    if all(x.crc is not None and y.crc is not None for x, y in zip(da, db, strict=True)):
        return all(x.crc == y.crc and x.numel == y.numel for x, y in zip(da, db, strict=True))
    import numpy as np  # chunks without recorded CRC-32s: compared by their bytes (no torch needed)

    from zckpt.stream.fill import Layout, Run
    from zckpt.stream.spans import CHUNK_BYTES

    ea = TensorEntry(a, ta.shape, ta.dtype, Role.PARAM, pieces(ld, a))
    eb = TensorEntry(b, tb.shape, tb.dtype, Role.PARAM, pieces(ld, b))
    la, lb = Layout([Run(ea, 0, ea.numel, ea.dtype)]), Layout([Run(eb, 0, eb.numel, eb.dtype)])
    x, y = np.empty(min(CHUNK_BYTES, la.nbytes), np.uint8), np.empty(min(CHUNK_BYTES, la.nbytes), np.uint8)
    for lo in range(0, la.nbytes, CHUNK_BYTES):
        n = min(CHUNK_BYTES, la.nbytes - lo)
        la.fill(x[:n], lo)
        lb.fill(y[:n], lo)
        if not np.array_equal(x[:n], y[:n]):
            return False
    return True


def ties(ld: Loaded, model: list[str], slots: Mapping[str, Slot], trainable: set[str]) -> dict[str, str]:
    """``{alias: owner}``: names without optimizer state holding a trainable name's bytes (module doc)."""
    if not trainable:
        return {}
    owners = [k for k in model if slots[k].name in trainable]
    out: dict[str, str] = {}
    for k in model:
        name = slots[k].name
        if name in trainable or not ld.tensors[k].dtype.is_floating_point:
            continue
        owner = next((o for o in owners if _same_bytes(ld, o, k)), None)
        if owner is not None:
            out[name] = slots[owner].name
    return out


def role_of(name: str, dtype: DType, trainable: set[str]) -> Role:
    if name in trainable:
        return Role.PARAM
    if not (dtype.is_floating_point or dtype.is_complex):
        return Role.BUFFER
    if not trainable:
        return Role.PARAM
    return Role.FROZEN if name.rpartition(".")[2] in FROZEN_NAMES else Role.BUFFER


def _optim_value(key: str, slot: Slot, v: Value) -> TensorEntry | None:
    """An optimizer state saved as a Python number (an old ``step``) as an inline 0-d entry."""
    x = v.value
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    dtype = dtypes.int64 if isinstance(x, int) else dtypes.float64
    piece = Piece("", 0, dtype, 0, 1, value=x)  # a tensor when read (``Piece.inline``)
    pytype = "int" if isinstance(x, int) else "float"
    return TensorEntry(slot.name, (), dtype, Role.OPTIM, (piece,), state=slot.state, pytype=pytype)


@dataclass(frozen=True)
class Parts:
    model: list[TensorEntry]
    optim: list[TensorEntry]
    client_tensors: dict[str, TensorEntry]
    tied: dict[str, str]


def entries(ld: Loaded, slots: Mapping[str, Slot], *, model_only: bool = False) -> Parts:
    """Model and optimizer entries, client tensors and ties (see the module doc); ``model_only``: the model
    entries and ties only (nothing else was located)."""
    model = [k for k in ld.keys if k in ld.tensors and slots[k].kind == "model"]
    trainable = {slots[k].name for k in ld.keys if slots[k].kind == "optim"}
    tied = ties(ld, model, slots, trainable)
    out = Parts([], [], {}, tied)
    for k in ld.keys:
        s = slots[k]
        if model_only and s.kind != "model":
            continue
        if k in ld.tensors:
            t = ld.tensors[k]
            if s.kind == "model" and s.name not in tied:
                out.model.append(_model_entry(ld, k, s.name, role_of(s.name, t.dtype, trainable)))
            elif s.kind == "optim":
                out.optim.append(
                    TensorEntry(s.name, t.shape, t.dtype, Role.OPTIM, pieces(ld, k), state=s.state)
                )
            elif s.kind != "model":
                out.client_tensors[k] = TensorEntry(
                    f"client/{k}", t.shape, t.dtype, Role.BUFFER, pieces(ld, k)
                )
        elif s.kind == "optim":
            e = _optim_value(k, s, ld.values[k])
            if e is not None:
                out.optim.append(e)
    return out


def _model_entry(ld: Loaded, key: str, name: str, role: Role) -> TensorEntry:
    t = ld.tensors[key]
    if key in ld.lazy:  # its chunks are located when its bytes are first needed
        return DeferredEntry(name, t.shape, t.dtype, role, functools.partial(pieces, ld, key))
    return TensorEntry(name, t.shape, t.dtype, role, pieces(ld, key))


def _step_entry(ld: Loaded, key: str, s: Slot) -> TensorEntry | None:
    """The optimizer ``step`` state at ``key`` when a model-only open read it (``_model_and_step``)."""
    if s.kind != "optim" or s.state != "step":
        return None
    if key in ld.tensors:
        t = ld.tensors[key]
        if key not in ld.lazy and not all((key, b.offsets) in ld.data for b in distinct(t.chunks)):
            return None  # not opened
        return TensorEntry(s.name, t.shape, t.dtype, Role.OPTIM, pieces(ld, key), state=s.state)
    return _optim_value(key, s, ld.values[key]) if key in ld.values else None


def _world(ld: Loaded, src: Source) -> int:
    if src.layout == "hf-shards":
        return max(1, len(ld.files))
    ranks = [r for f in ld.files if (r := rank_of(f)) is not None]
    return max(ranks) + 1 if ranks else 1


def _precision(model: list[TensorEntry]) -> str:
    dts = {e.dtype for e in model if e.role is Role.PARAM}
    return precision_of(dts.pop()) if len(dts) == 1 else "fp32"


def read(
    path: Location, *, tag: str | None = None, trust_pickle: bool = False, model_only: bool = False
) -> Checkpoint:
    """The checkpoint at ``path``; ``model_only``: its model tensors and precision only (no optimizer or
    training state: for consolidate, which then opens a third of the archives)."""
    with collector.paused(long_lived=True):  # ~2 records per chunk, kept for the command (see paused)
        return _read(path, tag, trust_pickle, model_only)


def _read(path: Location, tag: str | None, trust_pickle: bool, model_only: bool) -> Checkpoint:
    src = resolve(location(path), tag)
    ld = Loaded()
    for folder in src.folders:
        if src.layout == "hf-shards":
            part = load_hf_shards(folder)
        else:
            md = load_metadata(folder)
            part = load_folder(
                folder, trust_pickle=trust_pickle, model_only=model_only, md=md, lazy=model_only
            )
            if not model_only:
                _keep(folder, md, part)
        ld.merge(part, folder)
    slots = {k: classify(ld.paths[k], k in ld.tensors) for k in ld.keys}
    parts = entries(ld, slots, model_only=model_only)
    if model_only:
        step = [e for k in ld.keys if (e := _step_entry(ld, k, slots[k])) is not None]
        client = state.assemble(slots, ld.paths, ld.values, {})[2]
        ts = TrainingState(
            precision=_precision(parts.model),
            counters=state.counters(client, step),
            framework={NAME: {"layout": src.layout}},
        )
    else:
        groups, sched, client, raw = state.assemble(slots, ld.paths, ld.values, parts.client_tensors)
        ts = TrainingState(
            precision=_precision(parts.model),
            optimizer=state.optimizer(groups, parts.optim),
            scheduler=sched,
            counters=state.counters(client, parts.optim),
            client_state=client,
            framework={NAME: {"layout": src.layout, "raw": raw}},
        )
    values = {k: v.describe() for k, v in ld.values.items() if slots[k].kind != "group"}
    meta = CheckpointMeta(
        format=NAME,
        path=str(src.root),
        world_size=_world(ld, src),
        tag=src.tag,
        save_dir=str(src.save_dir) if src.save_dir is not None else None,
        tied=parts.tied,
        files=tuple(ld.files),
        state=ts,
        extra=_extra(src, ld, values),
    )
    return Checkpoint(meta, parts.model + parts.optim)


def _extra(src: Source, ld: Loaded, values: Mapping[str, str]) -> dict[str, Any]:
    return {
        "layout": src.layout,
        "folders": [str(f) for f in src.folders],
        "serialization": sorted(ld.serialization),
        "values": dict(values),
        "metadata": [f for f in ld.files if Path(f).name == METADATA],
    }
