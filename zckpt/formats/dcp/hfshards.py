"""``HuggingFaceStorageWriter(save_distributed=True)`` folders: ``shard-<r>-model-<k>-of-<n>.safetensors``
files, no ``.metadata``. Each file holds its rank's chunks under bare FQNs and, in its header's
``__metadata__``, ``DCP_SHARDING_INFO`` = ``{fqn: {"saved_offsets": [...]}}``; a tensor's shape is the largest
``offset + size`` over all files (what torch's ``HuggingFaceStorageReader`` does). Model tensors only."""

from __future__ import annotations

import json

from zckpt.codecs import safetensors
from zckpt.errors import CorruptCheckpoint
from zckpt.formats.dcp.chunks import ChunkData
from zckpt.formats.dcp.layout import SHARD_RE, SHARDING_INFO
from zckpt.formats.dcp.metadata import Chunk, TensorMeta
from zckpt.storage.location import Location, ordered


def shard_files(folder: Location) -> list[Location]:
    return ordered(f for f in folder.glob("shard-*.safetensors") if SHARD_RE.match(f.name))


def _offsets(f: Location, raw: str | None) -> dict[str, tuple[int, ...]]:
    try:
        info = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):
        info = None
    if not isinstance(info, dict):
        raise CorruptCheckpoint(f"{f}: header metadata {SHARDING_INFO} is missing or not JSON", path=str(f))
    out = {}
    for k, v in info.items():
        offs = v.get("saved_offsets") if isinstance(v, dict) else None
        if not isinstance(offs, list) or not all(isinstance(o, int) and o >= 0 for o in offs):
            raise CorruptCheckpoint(f"{f}: {SHARDING_INFO} of {k!r:.80} has no saved_offsets", path=str(f))
        out[k] = tuple(offs)
    return out


Loaded = tuple[dict[str, TensorMeta], dict[tuple[str, tuple[int, ...]], ChunkData], list[str]]


def load(folder: Location) -> Loaded:
    """(tensors in first-seen order, chunk data by (key, offsets), files) of the shards in ``folder``."""
    pieces: dict[str, list[tuple[Chunk, ChunkData]]] = {}
    files = shard_files(folder)
    for f in files:
        h = safetensors.read_header(f)
        offs = _offsets(f, h.metadata.get(SHARDING_INFO))
        for name, e in h.tensors.items():
            if name not in offs:
                why = f"tensor {name!r:.80} is missing from {SHARDING_INFO}"
                raise CorruptCheckpoint(f"{f}: {why}", path=str(f))
            if e.numel == 0:
                continue
            if len(offs[name]) != len(e.shape):
                raise CorruptCheckpoint(f"{f}: offsets of {name!r:.80} do not match its shape", path=str(f))
            box = Chunk(offs[name], e.shape)
            pieces.setdefault(name, []).append((box, ChunkData(str(f), e.begin, e.dtype, e.numel)))
    tensors: dict[str, TensorMeta] = {}
    data: dict[tuple[str, tuple[int, ...]], ChunkData] = {}
    for name, got in pieces.items():
        dtypes = {d.dtype for _, d in got}
        if len(dtypes) != 1:
            why = f"shards of {name!r:.80} have dtypes {sorted(map(str, dtypes))}"
            raise CorruptCheckpoint(f"{folder}: {why}", path=str(folder))
        shape = tuple(max(b.offsets[i] + b.sizes[i] for b, _ in got) for i in range(len(got[0][0].sizes)))
        tensors[name] = TensorMeta(dtypes.pop(), shape, tuple(b for b, _ in got))
        data.update({(name, b.offsets): d for b, d in got})
    return tensors, data, [str(f) for f in files]
