"""safetensors files and Hugging Face model folders: lazy reading (headers only) and streaming writing.

Reads a single ``.safetensors`` file, or an HF folder holding ``model.safetensors``, sharded
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``, or ``pytorch_model.bin``
(sharded with ``pytorch_model.bin.index.json``; the ``.bin`` files are read by ``torch_file``).

The safetensors header is parsed here, strictly: 8-byte little-endian length, sane against the file
size; a JSON object of ``{name: {dtype, shape, data_offsets}}`` plus an optional ``__metadata__``
(str -> str); known dtypes; offsets inside the data section, matching shape x itemsize, not
overlapping. Each tensor becomes one ``Piece`` pointing into the file.

zckpt's own metadata (written by ``write_safetensors``, read back here):

- ``__metadata__["format"] = "pt"`` (transformers requires it);
- ``__metadata__["zckpt.tied"]``: JSON ``{alias: owner}``. One copy is stored, under the owner's name;
  transformers re-ties aliases itself from ``config.tie_word_embeddings``, so aliases are *not*
  listed in the index's ``weight_map`` (that would make them "missing" from their shard). The
  index's ``metadata`` also holds ``"zckpt.tied"`` (as a JSON object);
- ``__metadata__["zckpt.roles"]``: JSON ``{name: "frozen" | "buffer" | "optim"}`` for tensors that are
  not trainable params. Without it, floating tensors are params and the others (int, bool) buffers.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from zckpt.checkpoint import Checkpoint
from zckpt.errors import CorruptCheckpoint, ShardMismatch, Unsupported
from zckpt.io import pipeline
from zckpt.io.outputs import HashingSink, Staging, WriteItem, planned_names, write_sharded
from zckpt.model import STATE_SEP, CheckpointMeta, Piece, Role, TensorEntry

NAME = "hf"

ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
MAX_HEADER = 100 << 20  # the limit safetensors itself enforces
SAFETENSORS = "model.safetensors"
BIN = "pytorch_model.bin"
TIED_KEY = "zckpt.tied"
ROLES_KEY = "zckpt.roles"


# ---- detection -----------------------------------------------------------------------------------
def detect(path: Path) -> bool:
    if path.is_file():
        return path.suffix == ".safetensors"
    return path.is_dir() and _folder_layout(path) is not None


def _folder_layout(folder: Path) -> tuple[str, Path] | None:
    """("index"|"single", file) for an HF folder; safetensors before .bin, an index before a lone file."""
    for suffix in (".safetensors", ".bin"):
        indexes = sorted(folder.glob(f"*{suffix}.index.json"))
        if len(indexes) == 1:
            return "index", indexes[0]
        base = folder / (SAFETENSORS if suffix == ".safetensors" else BIN)
        if base.is_file():
            return "single", base
        if suffix == ".safetensors":
            files = sorted(folder.glob("*.safetensors"))
            if len(files) == 1:
                return "single", files[0]
    return None


# ---- header parsing ------------------------------------------------------------------------------
def read_header(path: Path) -> tuple[dict[str, dict[str, Any]], dict[str, str], int]:
    """(tensors, metadata, data start) of a safetensors file, strictly validated. No tensor bytes read."""
    p = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptCheckpoint(f"{p}: {size} bytes is too short for a safetensors file", path=p)
            (n,) = struct.unpack("<Q", head)
            if n < 2 or n > MAX_HEADER or 8 + n > size:
                raise CorruptCheckpoint(
                    f"{p}: header length {n} does not fit a {size}-byte file (truncated or not safetensors)",
                    path=p,
                )
            raw = f.read(n)
    except OSError as e:
        raise CorruptCheckpoint(f"{p}: cannot read ({e.strerror})", path=p) from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CorruptCheckpoint(f"{p}: header is not valid JSON ({type(e).__name__}: {e})", path=p) from None
    if not isinstance(header, dict):
        raise CorruptCheckpoint(f"{p}: header is not a JSON object", path=p)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CorruptCheckpoint(f"{p}: __metadata__ must map strings to strings", path=p)
    data_start = 8 + n
    data_size = size - data_start
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CorruptCheckpoint(f"{p}: tensor {name!r} needs exactly dtype, shape, data_offsets", path=p)
        dt, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if dt not in ST_DTYPES:
            raise Unsupported(f"{p}: tensor {name!r} has dtype {dt!r}; known: {', '.join(ST_DTYPES)}", path=p)
        if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
            raise CorruptCheckpoint(f"{p}: tensor {name!r} has a bad shape {shape!r}", path=p)
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)):
            raise CorruptCheckpoint(f"{p}: tensor {name!r} has bad data_offsets {offs!r}", path=p)
        lo, hi = offs
        numel = 1
        for s in shape:
            numel *= s
        if not 0 <= lo <= hi or hi - lo != numel * ST_DTYPES[dt].itemsize:
            raise CorruptCheckpoint(
                f"{p}: tensor {name!r} data_offsets {offs} do not hold shape {shape} of {dt}", path=p
            )
        if hi > data_size:
            raise CorruptCheckpoint(
                f"{p}: tensor {name!r} ends at byte {data_start + hi} but the file has {size} (truncated?)",
                hint="re-copy or re-download the file",
                path=p,
            )
        spans.append((lo, hi, name))
    spans.sort()
    for (_, e1, n1), (b2, e2, n2) in zip(spans, spans[1:], strict=False):
        if b2 < e1 and e2 > b2:
            raise CorruptCheckpoint(f"{p}: tensors {n1!r} and {n2!r} overlap in the data section", path=p)
    return header, meta, data_start


def _json_meta(meta: Mapping[str, str], key: str, path: Path) -> dict[str, str]:
    if key not in meta:
        return {}
    try:
        val = json.loads(meta[key])
    except json.JSONDecodeError:
        raise CorruptCheckpoint(f"{path}: __metadata__[{key!r}] is not JSON", path=str(path)) from None
    if not isinstance(val, dict):
        raise CorruptCheckpoint(f"{path}: __metadata__[{key!r}] must be a JSON object", path=str(path))
    return {str(k): str(v) for k, v in val.items()}


def file_entries(path: Path) -> tuple[list[TensorEntry], dict[str, str], dict[str, str]]:
    """(entries, tied aliases, raw metadata) of one safetensors file."""
    header, meta, start = read_header(path)
    roles = _json_meta(meta, ROLES_KEY, path)
    entries = []
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dtype = ST_DTYPES[info["dtype"]]
        shape = tuple(info["shape"])
        numel = (info["data_offsets"][1] - info["data_offsets"][0]) // dtype.itemsize
        piece = Piece(str(path), start + info["data_offsets"][0], dtype, 0, numel)
        default = Role.PARAM if (dtype.is_floating_point or dtype.is_complex) else Role.BUFFER
        role = Role(roles.get(name, default.value))
        base, state = name, None
        if role is Role.OPTIM:
            base, _, state = name.rpartition(STATE_SEP)
        entries.append(TensorEntry(base, shape, dtype, role, (piece,), state=state))
    return entries, _json_meta(meta, TIED_KEY, path), meta


# ---- reading -------------------------------------------------------------------------------------
def read(path: Path, *, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
    if path.is_file():
        single, tied1, meta = file_entries(path)
        return Checkpoint(
            CheckpointMeta(
                format=NAME, path=str(path), tied=tied1, files=(str(path),), extra={"metadata": meta}
            ),
            single,
        )
    layout = _folder_layout(path)
    if layout is None:
        raise CorruptCheckpoint(f"{path}: no model.safetensors, pytorch_model.bin or index in this folder",
                                path=str(path))  # fmt: skip
    kind, file = layout
    if kind == "single":
        files, tied = [file], dict[str, str]()
        weight_map: dict[str, str] | None = None
    else:
        weight_map, tied = _read_index(file)
        files = [path / f for f in sorted(set(weight_map.values()))]  # shard order = original order
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ShardMismatch(f"{file}: shard files listed in the index are missing: {', '.join(missing)}",
                                path=str(file))  # fmt: skip
    entries: list[TensorEntry] = []
    extra: dict[str, Any] = {}
    for f in files:
        if f.suffix == ".safetensors":
            es, t, _ = file_entries(f)
        else:
            from zckpt.formats import torch_file

            es, t, _ = torch_file.file_entries(f, trust_pickle=trust_pickle)
        entries += es
        tied.update(t)
    if weight_map is not None:
        where = {e.key: Path(e.pieces[0].file).name for e in entries}
        bad = [k for k, f in weight_map.items() if where.get(k) != f and k not in tied]
        if bad:
            raise ShardMismatch(
                f"{file}: {len(bad)} tensors listed in the index are not in their shard, e.g. {bad[0]!r} "
                f"(expected in {weight_map[bad[0]]})",
                hint="the index and the shard files come from different saves",
                path=str(file),
            )
        extra["index"] = str(file)
    config = _read_json(path / "config.json") if (path / "config.json").is_file() else None
    tied = {a: o for a, o in tied.items() if a not in {e.key for e in entries}}
    return Checkpoint(
        CheckpointMeta(format=NAME, path=str(path), tied=tied, config=config,
                       files=tuple(str(f) for f in files), extra=extra),
        entries,
    )  # fmt: skip


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpoint(f"{path}: unreadable JSON ({e})", path=str(path)) from None


def _read_index(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    idx = _read_json(path)
    wm = idx.get("weight_map") if isinstance(idx, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) and "/" not in v for v in wm.values()):
        raise CorruptCheckpoint(f"{path}: index has no valid weight_map", path=str(path))
    md = idx.get("metadata") or {}
    tied = md.get(TIED_KEY) or {}
    if not isinstance(tied, dict):
        raise CorruptCheckpoint(f"{path}: metadata[{TIED_KEY!r}] must be an object", path=str(path))
    return dict(wm), {str(k): str(v) for k, v in tied.items()}


# ---- writing -------------------------------------------------------------------------------------
def _file_metadata(items: Sequence[WriteItem], tied: Mapping[str, str], metadata: Mapping[str, str] | None
                   ) -> dict[str, str]:  # fmt: skip
    names = {it.name for it in items}
    md = {"format": "pt", **(metadata or {})}
    mine = {a: o for a, o in tied.items() if o in names}
    if mine:
        md[TIED_KEY] = json.dumps(mine, sort_keys=True)
    roles = {it.name: it.role.value for it in items if it.role is not Role.PARAM}
    if roles:
        md[ROLES_KEY] = json.dumps(roles, sort_keys=True)
    return md


def write_file(
    path: Path,
    items: Sequence[WriteItem],
    *,
    tied: Mapping[str, str] | None = None,
    metadata: Mapping[str, str] | None = None,
    on_bytes: Callable[[int], None] | None = None,
    workers: int | None = None,
) -> str:
    """Stream ``items`` into a new safetensors file at ``path`` (header first, then each tensor in
    bounded chunks); write its ``.sha256`` sidecar. Returns the sha256. ``path`` must not exist."""
    header: dict[str, Any] = {"__metadata__": _file_metadata(items, tied or {}, metadata)}
    offset = 0
    for it in items:
        if it.dtype not in _ST_NAMES:
            raise Unsupported(f"{it.name}: safetensors cannot store {it.dtype}")
        if it.name in header:
            raise CorruptCheckpoint(f"{path}: tensor {it.name!r} would be written twice")
        header[it.name] = {"dtype": _ST_NAMES[it.dtype], "shape": list(it.shape),
                           "data_offsets": [offset, offset + it.nbytes]}  # fmt: skip
        offset += it.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes, as safetensors does
    sink = HashingSink(path)
    try:
        sink.write(struct.pack("<Q", len(raw)))
        sink.write(raw)
        pipeline.write_items(sink, items, workers=workers, on_bytes=on_bytes)
    finally:
        sink.close()
    sink.write_sidecar()
    return sink.hexdigest()


def write_into(
    folder: Path,
    base: str,
    items: Sequence[WriteItem],
    *,
    tied: Mapping[str, str] | None = None,
    metadata: Mapping[str, str] | None = None,
    max_shard_size: int | None = None,
    on_bytes: Callable[[int], None] | None = None,
    workers: int | None = None,
    part: tuple[int, int] = (0, 1),
) -> list[str]:
    """Write ``base`` (or its shards plus ``<base>.index.json``) into an existing folder; returns names.
    ``part=(rank, world)``: this rank's share only (see ``zckpt.io.outputs.write_sharded``)."""
    tied = dict(tied or {})
    return write_sharded(
        folder,
        base,
        items,
        max_shard_size,
        lambda p, shard: write_file(
            p, shard, tied=tied, metadata=metadata, on_bytes=on_bytes, workers=workers
        ),
        index_metadata={TIED_KEY: tied} if tied else None,
        part=part,
    )


def write_safetensors(
    out: str | Path,
    items: Sequence[WriteItem],
    *,
    tied: Mapping[str, str] | None = None,
    metadata: Mapping[str, str] | None = None,
    max_shard_size: int | None = None,
    overwrite: bool = False,
    on_bytes: Callable[[int], None] | None = None,
    workers: int | None = None,
) -> list[Path]:
    """Write tensors to ``out`` (a ``.safetensors`` file, or a folder for the HF layout), atomically.

    Args:
        out: a file name ending in ``.safetensors``, or a folder (gets ``model.safetensors``, sharded
            with an index when ``max_shard_size`` splits it).
        items: what to write (see ``zckpt.io.outputs.items_from_state_dict``).
        tied: ``{alias: owner}``; owners are stored once and aliases recorded in the metadata.

    Returns:
        The final paths written (tensor files, sidecars, index).
    """
    out = Path(out)
    is_dir = out.suffix != ".safetensors"
    base = SAFETENSORS if is_dir else out.name
    with Staging(out, is_dir=is_dir, overwrite=overwrite) as st:
        st.expect(planned_names(base, items, max_shard_size))
        write_into(st.dir, base, items, tied=tied, metadata=metadata,
                   max_shard_size=max_shard_size, on_bytes=on_bytes, workers=workers)  # fmt: skip
        return st.commit()
