"""The native format's names and its manifest, typed (spec: docs/native-format.md).

``rank_file``/``*_key`` name the files and the tensors inside them; ``Manifest`` is ``manifest.json`` as a
frozen dataclass: ``Manifest.to_json`` is the only encoder and ``Manifest.from_json`` the only decoder,
which checks every field's type and range (a manifest is input: it may be damaged or hostile).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zckpt.errors import CorruptCheckpoint
from zckpt.formats._flat import tied_map
from zckpt.formats._schema import Node
from zckpt.model import DTYPES, Role
from zckpt.storage.digest import FileDigest

FORMAT_ID = "zckpt-native"
VERSION = 3
"""3: a manifest may name a ``generation``, part of its rank files' names (a save into an object store,
where the new files must not replace the previous save's until the manifest does); written only then,
2 otherwise. 2: rank files carry per-block sha256s (``sha256_blocks``); 1 (still read): one whole-file
``sha256``."""
GENERATION = re.compile(r"g[0-9a-f]{16}")
"""A generation's spelling (``new_generation``)."""
MANIFEST = "manifest.json"
MAX_WORLD = 1 << 20
"""Largest world size a manifest may claim (a bound for hostile input, far above any real run)."""
CLIENT_REF = "__tensor__"
"""``client_state`` JSON: ``{"__tensor__": "client/<path>"}`` stands for a tensor in rank 0's file."""
RNG_KEYS = ("torch_cpu", "torch_cuda")
_HEX = re.compile(r"[0-9a-fA-F]{64}")


def rank_file(rank: int, generation: str | None = None) -> str:
    """``rank_00003.safetensors``; with a generation, ``rank_00003.g0123456789abcdef.safetensors``."""
    return f"rank_{rank:05d}.{generation}.safetensors" if generation else f"rank_{rank:05d}.safetensors"


RANK_FILE = re.compile(r"rank_\d{5}(\.g[0-9a-f]{16})?\.safetensors")
"""Any rank file's name, of any generation."""


def new_generation() -> str:
    """A fresh generation name (``zckpt.storage.remote_staging.new_generation``: 64 random bits)."""
    from zckpt.storage.remote_staging import new_generation as fresh

    return fresh()


def tensor_key(role: Role, name: str) -> str:
    """``param/<name>``, ``frozen/<name>``, ``buffer/<name>``: a model tensor in a rank file."""
    return f"{role.value}/{name}"


def optim_key(state: str, param: str) -> str:
    return f"optim/{state}/{param}"


def rng_key(kind: str) -> str:
    return f"rng/{kind}"


def client_key(path: str) -> str:
    return f"client/{path}"


@dataclass(frozen=True)
class TensorSpec:
    """A model tensor (owner names only): partitioned tensors are cut in ``partition_world`` chunks."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: Role
    partitioned: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "role": self.role.value,
            "partitioned": self.partitioned,
        }


@dataclass(frozen=True)
class OptimSpec:
    """One optimizer state of one parameter; ``python`` names the Python type of a number-valued state."""

    param: str
    state: str
    shape: tuple[int, ...]
    dtype: str
    partitioned: bool
    python: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "param": self.param,
            "state": self.state,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "partitioned": self.partitioned,
            "python": self.python,
        }


def _unique(tensors: tuple[TensorSpec, ...], file: str) -> tuple[TensorSpec, ...]:
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise CorruptCheckpoint(f"{file}: tensors lists {t.name!r:.80} twice", path=file)
        seen.add(t.name)
    return tensors


@dataclass(frozen=True)
class Manifest:
    """``manifest.json``. JSON-valued fields (optimizer, scheduler, ...) are kept as saved."""

    tag: str
    world_size: int
    partition_world: int
    stage: int
    precision: str
    compute_dtype: str
    tensors: tuple[TensorSpec, ...]
    optim_states: tuple[OptimSpec, ...]
    files: Mapping[str, tuple[FileDigest, int]]
    """rank file name -> (digest, bytes)."""
    crc32: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """rank file name -> {tensor key: CRC-32 of its bytes}: reads verify each tensor they touch."""
    tied: Mapping[str, str] = field(default_factory=dict)
    optimizer: Mapping[str, Any] | None = None
    scheduler: Any = None
    loss_scaler: Any = None
    counters: Mapping[str, int | None] = field(default_factory=dict)
    rng: tuple[Mapping[str, Any], ...] = ()
    client_state: Any = None
    config: Any = None
    version: int = VERSION
    generation: str | None = None
    """Part of the rank files' names (``rank_file``), when the save gave them one."""

    def rank_file(self, rank: int) -> str:
        """The name of ``rank``'s file in this save."""
        return rank_file(rank, self.generation)

    def to_json(self) -> dict[str, Any]:
        gen = {"generation": self.generation} if self.generation else {}
        return {
            "format": FORMAT_ID,
            "version": VERSION if self.generation else min(self.version, 2),
            **gen,
            "tag": self.tag,
            "world_size": self.world_size,
            "partition_world": self.partition_world,
            "stage": self.stage,
            "precision": self.precision,
            "compute_dtype": self.compute_dtype,
            "tensors": [t.to_json() for t in self.tensors],
            "optim_states": [o.to_json() for o in self.optim_states],
            "tied": dict(self.tied),
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "loss_scaler": self.loss_scaler,
            "counters": dict(self.counters),
            "rng": list(self.rng),
            "client_state": self.client_state,
            "config": self.config,
            "files": {n: self._file_json(n) for n in sorted(self.files)},
        }

    def _file_json(self, name: str) -> dict[str, Any]:
        digest, size = self.files[name]
        crcs = {"crc32": dict(self.crc32[name])} if name in self.crc32 else {}
        return {**_digest_json(digest), "bytes": size, **crcs}

    @classmethod
    def from_json(cls, raw: Any, file: str) -> Manifest:
        m = Node(raw, file)
        if m["format"].value != FORMAT_ID:
            raise m["format"].fail(repr(FORMAT_ID))
        version = m["version"].as_int(lo=1)
        if version > VERSION:
            raise m["version"].fail(f"a version this reader knows (<= {VERSION})", hint="upgrade zckpt")
        gen = m.get("generation")
        generation = gen.as_str() if gen is not None and gen.value is not None else None
        if generation is not None and not GENERATION.fullmatch(generation):
            raise m["generation"].fail("g and 16 hex digits")
        world = m["world_size"].as_int(lo=1, hi=MAX_WORLD)
        pw = m["partition_world"].as_int(lo=1, hi=world)
        if pw not in (1, world):
            raise m["partition_world"].fail(f"1 or the world size {world}")
        files, crcs = {}, {}
        for name, rec in m["files"].items():
            size = rec["bytes"].as_int(lo=0)
            files[name] = (_digest(rec, size), size)
            if rec.get("crc32") is not None:
                crcs[name] = {k: v.as_int(lo=0, hi=0xFFFFFFFF) for k, v in rec["crc32"].items()}
        return cls(
            tag=m["tag"].as_str(),
            world_size=world,
            partition_world=pw,
            stage=m["stage"].as_int(lo=0, hi=3),
            precision=m["precision"].as_str(),
            compute_dtype=_dtype(m.get("compute_dtype"), "float32"),
            tensors=_unique(tuple(_tensor(n) for n in m["tensors"]), file),
            optim_states=tuple(_optim(n) for n in m["optim_states"]),
            files=files,
            crc32=crcs,
            tied=tied_map(m.value.get("tied") or {}, "tied", file),
            optimizer=_opt(m.get("optimizer")),
            scheduler=m.value.get("scheduler"),
            loss_scaler=m.value.get("loss_scaler"),
            counters=_counters(m.get("counters")),
            rng=tuple(r.as_dict() for r in (m.get("rng") or Node([], file))),
            client_state=m.value.get("client_state"),
            config=m.value.get("config"),
            version=version,
            generation=generation,
        )


def _digest_json(d: FileDigest) -> dict[str, Any]:
    if d.sha256 is not None:
        return {"sha256": d.sha256}
    return {"sha256_blocks": {"block": d.block, "sha256": list(d.blocks)}}


def _hex(n: Node) -> str:
    h = n.as_str(max_len=64)
    if not _HEX.fullmatch(h):
        raise n.fail("a sha256 hex digest")
    return h.lower()


def _digest(rec: Node, size: int) -> FileDigest:
    """A rank file's ``sha256`` (version 1) or ``sha256_blocks`` (one digest per ``block`` bytes)."""
    blocks = rec.get("sha256_blocks")
    if blocks is None:
        return FileDigest(sha256=_hex(rec["sha256"]))
    if rec.has("sha256"):
        raise rec.fail("one of sha256 and sha256_blocks, not both")
    block = blocks["block"].as_int(lo=4096, hi=1 << 40)
    digests = tuple(_hex(h) for h in blocks["sha256"])
    if len(digests) != -(-size // block):
        raise blocks["sha256"].fail(f"{-(-size // block)} digests ({size} bytes in {block}-byte blocks)")
    return FileDigest(block=block, blocks=digests)


def _dtype(n: Node | None, default: str) -> str:
    if n is None:
        return default
    name = n.as_str()
    if name not in DTYPES:
        raise n.fail(f"a dtype name ({', '.join(DTYPES)})")
    return name


def _tensor(n: Node) -> TensorSpec:
    role_n = n["role"]
    role = role_n.as_str()
    if role not in ("param", "frozen", "buffer"):
        raise role_n.fail("param, frozen or buffer")
    return TensorSpec(
        n["name"].as_str(),
        n["shape"].as_shape(),
        _dtype(n["dtype"], ""),
        Role(role),
        n["partitioned"].as_bool(),
    )


def _optim(n: Node) -> OptimSpec:
    py = n.get("python")
    python = py.as_str() if py is not None else None
    if python not in (None, "int", "float"):
        raise n["python"].fail("int, float or null")
    return OptimSpec(
        n["param"].as_str(),
        n["state"].as_str(),
        n["shape"].as_shape(),
        _dtype(n["dtype"], ""),
        n["partitioned"].as_bool(),
        python,
    )


def _opt(n: Node | None) -> Mapping[str, Any] | None:
    if n is None:
        return None
    n["kind"].as_str()
    for g in n["param_groups"]:
        for p in g["params"]:
            p.as_str()
    for s in n.get("state_names") or Node([], n.file):
        s.as_str()
    return n.as_dict()


def _counters(n: Node | None) -> Mapping[str, int | None]:
    if n is None:
        return {}
    out: dict[str, int | None] = {}
    for k in ("global_steps", "global_samples", "skipped_steps", "micro_steps"):
        v = n.get(k)
        out[k] = v.as_int(lo=0) if v is not None else None
    return out
