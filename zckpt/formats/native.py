"""The engine's native checkpoint format (spec: docs/native-format.md): reader and detector.

Layout: ``<dir>/latest`` (tag), ``<dir>/<tag>/manifest.json`` and ``<dir>/<tag>/rank_{r:05d}.safetensors``.
Every tensor is partitioned per tensor: the flattened tensor is cut in ``partition_world`` chunks of
``ceil(numel / partition_world)`` elements (``zckpt.partition``); rank r's file holds chunk r, padded, under
``param/<name>`` (fp32 masters), ``frozen/<name>`` and ``optim/<state>/<name>``. Each becomes one ``Piece``
per rank with the padding excluded. Buffers (``buffer/<name>``) and replicated optimizer states (0-d
``step``...) are read from rank 0's file. Nothing here unpickles anything.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from zckpt.checkpoint import Checkpoint
from zckpt.errors import CorruptCheckpoint, ShardMismatch
from zckpt.formats.hf import ST_DTYPES, read_header
from zckpt.io import storage
from zckpt.model import CheckpointMeta, OptimizerInfo, Piece, Role, TensorEntry, parse_dtype
from zckpt.partition import chunk_range, chunk_size

NAME = "native"
FORMAT = "zckpt-native"
VERSION = 1
MANIFEST = "manifest.json"


def _is_tag_dir(p: Path) -> bool:
    m = p / MANIFEST
    if not m.is_file():
        return False
    try:
        with open(m, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return f'"format": "{FORMAT}"'.encode() in head


def detect(path: Path) -> bool:
    """A folder whose ``latest`` names a tag folder with our manifest, or such a tag folder itself."""
    if not path.is_dir():
        return False
    if _is_tag_dir(path):
        return True
    latest = path / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        return bool(tag) and _is_tag_dir(path / tag)
    return False


def resolve(path: Path, tag: str | None = None) -> Path:
    """The tag folder for ``path`` (a save dir with ``latest``, or a tag folder) and ``tag``."""
    if tag is not None:
        return path / tag
    if _is_tag_dir(path):
        return path
    latest = path / "latest"
    if not latest.is_file():
        raise CorruptCheckpoint(
            f"{path}: no `latest` file and no {MANIFEST}", hint="pass --tag", path=str(path)
        )
    return path / latest.read_text().strip()


def manifest(tag_dir: Path) -> dict[str, Any]:
    try:
        man: dict[str, Any] = json.loads((tag_dir / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CorruptCheckpoint(f"{tag_dir / MANIFEST}: cannot read ({e})", path=str(tag_dir)) from None
    if man.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{tag_dir / MANIFEST}: format is {man.get('format')!r}, not {FORMAT!r}")
    if man.get("version", 0) > VERSION:
        raise CorruptCheckpoint(
            f"{tag_dir / MANIFEST}: format version {man['version']} is newer than this reader ({VERSION})",
            hint="upgrade zckpt",
        )
    return man


def rank_file(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"rank_{rank:05d}.safetensors"


def read_rank_tensor(path: Path, key: str) -> torch.Tensor | None:
    """One small tensor (an RNG state, say) of a rank file, copied out; None when absent."""
    header, _, start = read_header(path)
    info = header.get(key)
    if info is None:
        return None
    dtype = ST_DTYPES[info["dtype"]]
    lo, hi = info["data_offsets"]
    p = Piece(str(path), start + lo, dtype, 0, (hi - lo) // dtype.itemsize)
    return storage.piece_view(p).clone().view(info["shape"])


def read(path: Path, *, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
    td = resolve(Path(path), tag)
    man = manifest(td)
    world, pw = int(man["world_size"]), int(man["partition_world"])
    files = [rank_file(td, r) for r in range(world)]
    headers: list[tuple[dict[str, Any], int]] = []
    for f in files:
        if not f.is_file():
            raise ShardMismatch(f"{td}: rank file {f.name} is missing (world size {world})", path=str(td))
        want = man["files"].get(f.name, {}).get("bytes")
        if want is not None and f.stat().st_size != want:
            raise ShardMismatch(
                f"{f}: {f.stat().st_size} bytes, the manifest says {want} (truncated or another save)",
                path=str(f),
            )
        h, _, start = read_header(f)
        headers.append((h, start))

    def piece(r: int, key: str, dtype: torch.dtype, start: int, numel: int, padding: int) -> Piece:
        h, data = headers[r]
        if key not in h:
            raise ShardMismatch(f"{files[r]}: has no tensor {key!r}", path=str(files[r]))
        return Piece(
            str(files[r]), data + h[key]["data_offsets"][0], dtype, start, numel, rank=r, padding=padding
        )

    def partitioned(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Piece, ...]:
        n = 1
        for d in shape:
            n *= d
        c = chunk_size(n, pw)
        out = []
        for r in range(pw):
            start, valid = chunk_range(n, pw, r)
            if valid > 0:
                out.append(piece(r, key, dtype, start, valid, c - valid))
        return tuple(out)

    def pieces_of(key: str, spec: dict[str, Any]) -> tuple[tuple[int, ...], torch.dtype, tuple[Piece, ...]]:
        shape, dtype = tuple(spec["shape"]), parse_dtype(spec["dtype"])
        if spec["partitioned"]:
            return shape, dtype, partitioned(key, shape, dtype)
        return shape, dtype, (piece(0, key, dtype, 0, math.prod(shape), 0),)  # replicated: rank 0's copy

    entries: list[TensorEntry] = []
    for t in man["tensors"]:
        role = Role(t["role"])
        shape, dtype, pieces = pieces_of(f"{role.value}/{t['name']}", t)
        entries.append(TensorEntry(t["name"], shape, dtype, role, pieces))
    for o in man["optim_states"]:
        shape, dtype, pieces = pieces_of(f"optim/{o['state']}/{o['param']}", o)
        entries.append(TensorEntry(o["param"], shape, dtype, Role.OPTIM, pieces, state=o["state"]))
    opt = man.get("optimizer") or {}
    meta = CheckpointMeta(
        format=NAME,
        path=str(td),
        world_size=world,
        stage=man.get("stage"),
        tag=man.get("tag"),
        step=man.get("counters", {}).get("global_steps"),
        precision=man.get("precision"),
        optimizer=OptimizerInfo(
            opt.get("kind", "?"), tuple(opt.get("param_groups", ())), tuple(opt.get("state_names", ()))
        )
        if opt
        else None,  # fmt: skip
        tied=dict(man.get("tied", {})),
        config=man.get("config"),
        files=tuple(str(f) for f in files),
        extra={
            "version": man.get("version"),
            "partition_world": pw,
            "scheduler": man.get("scheduler"),
            "loss_scaler": man.get("loss_scaler"),
            "client_state": man.get("client_state"),
            "counters": man.get("counters"),
            "rng": man.get("rng"),
            "file_hashes": man.get("files"),
        },
    )
    return Checkpoint(meta, entries)
