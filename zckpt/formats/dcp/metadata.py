"""DCP's ``.metadata`` file: unpickled through zckpt's bounded unpickle (``zckpt.codecs.pickle_core``) into
the inert stand-ins of ``standins``, then checked into typed, frozen records.

``DcpMetadata`` is what readers use: every flattened key in state-dict order with its path (``planner_data``:
never split keys on dots), tensors as ``TensorMeta`` (dtype, shape, chunk boxes), bytes items, and
``storage`` from ``(key, chunk offsets)`` (``None`` for bytes items) to ``StorageInfo``.

The load runs without torch (``zckpt.codecs.pickle_core``: dtypes are kept as ``DtypeName``, ``torch.Size`` as
an int64 array) into ``Parsed``, plain tuples and dicts, and only ``build`` maps the dtype names to
``zckpt.dtypes.DType``s (still without torch).
So the command line can parse a large ``.metadata`` in a child process while it imports torch (``preload``,
``zckpt.storage.preopen``); the parent takes the child's ``Parsed`` only for the very bytes it read itself.
"""

from __future__ import annotations

import hashlib
import marshal
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from zckpt import dtypes
from zckpt.codecs.pickle_core import bounded_loads
from zckpt.dtypes import DType
from zckpt.errors import CorruptCheckpoint
from zckpt.formats._schema import Node
from zckpt.formats.dcp.standins import (
    LEAVES_MD,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    DtypeName,
    Metadata,
    MetadataIndex,
    Size,
    StorageInfo_,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    Unpickler,
)
from zckpt.storage import collector, fileio, preopen, session
from zckpt.storage.location import Location, location

METADATA = ".metadata"
MAX_METADATA = 1 << 30
"""Largest ``.metadata`` read (a 100B-parameter checkpoint's is a few hundred MB at most)."""


# ---- typed metadata ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chunk:
    """A box of a tensor: element ``offsets`` and ``sizes`` per dimension (both empty for a 0-d tensor)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class TensorMeta:
    dtype: DType
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class StorageInfo:
    """Where one item's bytes are: ``length`` bytes at ``offset`` of ``file`` (relative to the folder)."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


StorageKey = tuple[str, tuple[int, ...] | None]
"""``(flattened key, chunk offsets)`` of a tensor chunk; ``(key, None)`` of a bytes item."""


@dataclass(frozen=True)
class DcpMetadata:
    source: str
    """The ``.metadata`` file."""
    keys: tuple[str, ...]
    """Every flattened key, in state-dict order (``planner_data``'s order when it has them all)."""
    paths: Mapping[str, tuple[str | int, ...]]
    tensors: Mapping[str, TensorMeta]
    byte_keys: frozenset[str]
    storage: Mapping[StorageKey, StorageInfo]
    version: str | None = None
    checkpoint_id: str | None = None

    @property
    def folder(self) -> Location:
        return location(self.source).parent


Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A chunk as ``parse`` gives it: ``(offsets, sizes)``."""


class Parsed(NamedTuple):
    """``parse``'s result: ``DcpMetadata``'s fields as plain values (marshal'd as a tuple by ``preload``),
    each tensor ``(dtype name, shape, boxes)``, each storage ``(file, offset, length, transforms)``."""

    keys: tuple[str, ...]
    paths: dict[str, tuple[str | int, ...]]
    tensors: dict[str, tuple[str, tuple[int, ...], tuple[Box, ...]]]
    byte_keys: frozenset[str]
    storage: dict[StorageKey, tuple[str, int, int, tuple[str, ...]]]
    version: str | None
    checkpoint_id: str | None


def build(source: str, p: Parsed) -> DcpMetadata:
    """The typed records of ``p``, dtypes mapped to ``DType``s (a name zckpt does not know is refused)."""
    tensors: dict[str, TensorMeta] = {}
    for key, (name, shape, boxes) in p.tensors.items():
        dtype = dtypes.lookup(name)
        if dtype is None:
            raise CorruptCheckpoint(
                f"{source}: tensor {key!r:.80} has dtype torch.{name:.40}, which zckpt does not read",
                hint=f"zckpt reads {', '.join(dtypes.BY_NAME)}", path=source
            )  # fmt: skip
        tensors[key] = TensorMeta(dtype, shape, tuple([Chunk(o, z) for o, z in boxes]))
    storage = {k: StorageInfo(*v) for k, v in p.storage.items()}
    return DcpMetadata(source, p.keys, p.paths, tensors, p.byte_keys, storage, p.version, p.checkpoint_id)


def load_metadata(folder: Location) -> DcpMetadata:
    """Read and check ``folder/.metadata`` (one ``CorruptCheckpoint``/``UnsafePickle`` line on any damage).
    The running operation keeps the last few parses (its ``Storage.cache("dcp.metadata")``), by path and the
    digest of their bytes (read in full each time: a changed file is parsed again); ``DcpMetadata`` is
    frozen, its mappings only read."""
    f = folder / METADATA
    data = _read(f)
    src = str(f)
    digest = _digest(data)
    parsed = session.current().cache("dcp.metadata")
    got = parsed.get((src, digest))
    if got is None:
        with collector.paused(long_lived=True):  # ~100k small records, kept (see paused)
            got = build(src, _preloaded(src, digest) or parse_bytes(data, src))
        while len(parsed) >= 4:  # a few kept: verify reads them right after the open did
            del parsed[next(iter(parsed))]
        parsed[(src, digest)] = got
    return got


def _read(f: Location) -> bytes:
    with fileio.open_regular(f) as fh:
        data = fh.read(MAX_METADATA + 1)
    src = str(f)
    if not data:
        raise CorruptCheckpoint(f"{src}: empty file (0 bytes)", hint="the save did not finish", path=src)
    if len(data) > MAX_METADATA or data[:1] != b"\x80":
        raise CorruptCheckpoint(f"{src}: not a DCP metadata pickle", path=src)
    return data


def _digest(data: bytes) -> bytes:
    """What names a ``.metadata``'s bytes: the cache key, and how a pre-open child's parse is matched."""
    return hashlib.blake2b(data, digest_size=16).digest()


def parse_bytes(data: bytes, source: str) -> Parsed:
    """``.metadata``'s bytes through the bounded unpickle and ``parse`` (no torch needed)."""

    def unpickler(fh: BinaryIO) -> Unpickler:
        return Unpickler(fh, source)

    obj = bounded_loads(data, source=source, unpickler=unpickler, leaves=LEAVES_MD)
    return parse(Node(obj, source))


# ---- parsed in a child process while the command line imports torch ---------------------------------
def preload(path: str) -> bytes:
    """The command line's pre-open (``zckpt.storage.preopen``, in a child that has not imported torch): the
    ``.metadata`` at ``path`` read, parsed and checked, as marshal'd ``(digest of its bytes, Parsed)``. Any
    refusal raises: the parent then parses the file itself and reports it through its own path."""
    data = _read(Path(path))
    with collector.paused():  # parse makes a record per chunk and storage entry: no collections meanwhile
        parsed = parse_bytes(data, path)
    return marshal.dumps((_digest(data), tuple(parsed)))


def _preloaded(src: str, digest: bytes) -> Parsed | None:
    """What a pre-open child parsed from ``src``, if one was started for it and read these same bytes."""
    children = session.current().cache("preopen")
    blob = preopen.take(children, os.path.realpath(src)) if children else None
    if blob is None:
        return None
    try:
        theirs, fields = marshal.loads(blob)
        return Parsed(*fields) if theirs == digest else None
    except (EOFError, ValueError, TypeError):
        return None


def _fields(node: Node, cls: type, expected: str) -> Node:
    """The ``__dict__`` of a stand-in instance, as a node."""
    node.of_type(cls, expected)
    return Node(node.value.__dict__, node.file, node.where)


def _ints(node: Node) -> tuple[int, ...]:
    got = _plain_ints(node.value)
    if got is not None:
        return got
    if not isinstance(node.value, (tuple, list)) or len(node.value) > 64:
        raise node.fail("a tuple of sizes")
    return tuple(n.as_int(lo=0) for n in node)


_SEQS = (tuple, list, Size)


def _plain_ints(v: Any) -> tuple[int, ...] | None:
    """``v`` as a tuple when it is a short sequence of plain non-negative ints (what every real file holds),
    else None: the checked path then names what is wrong. A 2.3 MB ``.metadata`` has ~45k of these."""
    if type(v) in _SEQS and len(v) <= 64:
        for x in v:
            if type(x) is not int or x < 0:
                return None
        return tuple(v)
    return None


def _tensor(key: str, node: Node) -> tuple[str, tuple[int, ...], tuple[Box, ...]]:
    t = _fields(node, TensorStorageMetadata, "TensorStorageMetadata")
    props = _fields(t["properties"], TensorProperties, "TensorProperties")
    dtype = str(props["dtype"].of_type(DtypeName, "a torch dtype"))
    layout = props.get("layout")
    if layout is not None and layout.value != "torch.strided":
        raise layout.fail("torch.strided (sparse tensors are not supported)")
    shape = _ints(t["size"])
    chunks = []
    for c in t["chunks"]:
        box = _plain_box(c.value, shape)
        if box is None:
            cf = _fields(c, ChunkStorageMetadata, "ChunkStorageMetadata")
            off, size = _ints(cf["offsets"]), _ints(cf["sizes"])
            if len(off) != len(shape) or len(size) != len(shape):
                raise c.fail(f"a box of {len(shape)} dimensions (tensor {list(shape)})")
            if any(o + s > d for o, s, d in zip(off, size, shape, strict=True)):
                raise c.fail(f"a box inside the tensor's shape {list(shape)}")
            box = (off, size)
        chunks.append(box)
    return dtype, shape, tuple(chunks)


def _plain_box(c: Any, shape: tuple[int, ...]) -> Box | None:
    """The chunk when ``c`` is a well-formed box inside ``shape``, else None (the checked path explains)."""
    if type(c) is not ChunkStorageMetadata:
        return None
    d = c.__dict__
    off, size = _plain_ints(d.get("offsets")), _plain_ints(d.get("sizes"))
    if off is None or size is None or len(off) != len(shape) or len(size) != len(shape):
        return None
    for o, s, n in zip(off, size, shape, strict=True):
        if o + s > n:
            return None
    return off, size


_Tensors = Mapping[str, tuple[str, tuple[int, ...], tuple[Box, ...]]]
_Stored = tuple[str, int, int, tuple[str, ...]]


def _storage(node: Node, tensors: _Tensors, byte_keys: frozenset[str]) -> dict[StorageKey, _Stored]:
    out: dict[StorageKey, _Stored] = {}
    boxes: dict[str, frozenset[tuple[int, ...]]] = {}
    for idx, info in node.as_dict().items():
        plain = _plain_storage(idx, info, tensors, byte_keys, boxes)
        if plain is not None:
            out[plain[0]] = plain[1]
            continue
        where = Node(idx, node.file, f"{node.where}[{idx!r:.60}]")
        ix = _fields(where, MetadataIndex, "MetadataIndex")
        fqn = ix["fqn"].as_str(1 << 16)
        off = ix.get("offset")
        if fqn not in tensors and fqn not in byte_keys:
            raise ix["fqn"].fail("a key of state_dict_metadata")
        key: StorageKey = (fqn, None)
        if fqn in tensors:
            if off is None:
                raise ix.fail(f"the chunk offsets of tensor {fqn!r:.80}")
            key = (fqn, _ints(off))
            if key[1] not in {c[0] for c in tensors[fqn][2]}:
                raise CorruptCheckpoint(
                    f"{node.file}: storage_data names chunk {list(key[1])} of {fqn!r:.80}, which is not one "
                    "of the tensor's chunks in state_dict_metadata",
                    hint=_DAMAGED,
                    path=node.file,
                )
        si = _fields(Node(info, node.file, f"{where.where}.value"), StorageInfo_, "_StorageInfo")
        tr = si.get("transform_descriptors")
        out[key] = (
            si["relative_path"].as_str(),
            si["offset"].as_int(lo=0),
            si["length"].as_int(lo=0),
            tuple(n.as_str() for n in tr) if tr is not None else (),
        )
    return out


def _plain_storage(
    idx: Any,
    info: Any,
    tensors: _Tensors,
    byte_keys: frozenset[str],
    boxes: dict[str, frozenset[tuple[int, ...]]],
) -> tuple[StorageKey, _Stored] | None:
    """One well-formed ``storage_data`` entry, or None (the checked path in ``_storage`` names what is wrong).
    ``boxes`` caches each tensor's chunk offsets."""
    if type(idx) is not MetadataIndex or type(info) is not StorageInfo_:
        return None
    fqn = idx.__dict__.get("fqn")
    if type(fqn) is not str or len(fqn) > 1 << 16:
        return None
    key: StorageKey
    if fqn in tensors:
        off = _plain_ints(idx.__dict__.get("offset"))
        known = boxes.get(fqn)
        if known is None:
            known = boxes[fqn] = frozenset(c[0] for c in tensors[fqn][2])
        if off is None or off not in known:
            return None
        key = (fqn, off)
    elif fqn in byte_keys:
        key = (fqn, None)
    else:
        return None
    d = info.__dict__
    path, offset, length = d.get("relative_path"), d.get("offset"), d.get("length")
    tr = d.get("transform_descriptors")
    if type(path) is not str or len(path) > 4096 or type(offset) is not int or type(length) is not int:
        return None
    if offset < 0 or length < 0:
        return None
    if tr is not None and not (type(tr) in _SEQS and all(type(x) is str and len(x) <= 4096 for x in tr)):
        return None
    return key, (path, offset, length, tuple(tr) if tr is not None else ())


_DAMAGED = "the .metadata file is damaged; restore it from the original save"


def _planner_paths(pd: Node | None, order: list[str]) -> dict[str, tuple[str | int, ...]]:
    """``planner_data``: each key's path, checked against the key it names. DCP flattens a state dict by
    joining a value's path with dots, so a path must spell its key, and (when present at all) the table names
    exactly the keys of ``state_dict_metadata``: a renamed path or key would put a tensor under another name.
    None or empty: a saver that keeps no paths (``flatten_state_dict=False``), the keys' ``fallback_path``."""
    paths: dict[str, tuple[str | int, ...]] = {}
    if pd is None:
        return paths
    if not isinstance(pd.value, Mapping):
        raise pd.fail("a dict of key paths")
    src = pd.file
    for key, p in pd.items():
        parts = tuple(n.value for n in p)
        if not parts or not all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in parts):
            raise p.fail("a path of names and list indices")
        spelled = ".".join(map(str, parts))
        if spelled != key:
            raise CorruptCheckpoint(
                f"{src}: planner_data gives key {key!r:.80} the path {list(parts)!r:.80}, which spells "
                f"{spelled!r:.80}",
                hint=_DAMAGED,
                path=src,
            )
        paths[key] = parts
    known = set(order)
    extra = next((k for k in paths if k not in known), None)
    missing = next((k for k in order if k not in paths), None) if paths else None
    if extra is not None or missing is not None:
        what = f"names {extra!r:.80}, which" if extra is not None else f"lacks {missing!r:.80}, which"
        is_not = "is not a key of" if extra is not None else "is a key of"
        raise CorruptCheckpoint(f"{src}: planner_data {what} {is_not} state_dict_metadata", hint=_DAMAGED,
                                path=src)  # fmt: skip
    return paths


def parse(root: Node) -> Parsed:
    """The checked fields of ``DcpMetadata`` from the unpickled stand-in graph (``build`` types them)."""
    md = _fields(root, Metadata, "a DCP Metadata object")
    tensors: dict[str, tuple[str, tuple[int, ...], tuple[Box, ...]]] = {}
    byte_keys: set[str] = set()
    order: list[str] = []
    for key, v in md["state_dict_metadata"].items():
        order.append(key)
        if isinstance(v.value, BytesStorageMetadata):
            byte_keys.add(key)
        else:
            tensors[key] = _tensor(key, v)
    paths = _planner_paths(md.get("planner_data"), order)
    keys = list(paths) + [k for k in order if k not in paths]
    for k in keys:
        paths.setdefault(k, fallback_path(k))
    sm = md.get("storage_meta")
    cid = None
    if sm is not None and isinstance(sm.value, StorageMeta):
        c = sm.value.__dict__.get("checkpoint_id")
        cid = c if isinstance(c, str) else None
    version = md.get("version")
    return Parsed(
        keys=tuple(keys),
        paths=paths,
        tensors=tensors,
        byte_keys=frozenset(byte_keys),
        storage=_storage(md["storage_data"], tensors, frozenset(byte_keys)),
        version=version.value if version is not None and isinstance(version.value, str) else None,
        checkpoint_id=cid,
    )


_CONTAINERS = ("model", "optim", "optimizer", "lr_scheduler", "scheduler", "train_state", "dataloader")


def fallback_path(key: str) -> tuple[str | int, ...]:
    """A key's path when ``planner_data`` lacks it (files of savers that keep none): known container names
    and the optimizer's ``state``/``param_groups`` structure are split off, the rest stays one name."""
    head, dot, rest = key.partition(".")
    if not dot or head not in _CONTAINERS:
        return (key,)
    if head in ("optim", "optimizer"):
        kind, dot2, tail = rest.partition(".")
        if kind == "param_groups" and dot2:
            i, _, k = tail.partition(".")
            if i.isdigit() and k:
                return (head, kind, int(i), k)
        if kind == "state" and dot2 and "." in tail:
            fqn, _, st = tail.rpartition(".")
            return (head, kind, fqn, st)
    return (head, rest)
