"""The format-independent checkpoint model every command works on.

A checkpoint is a set of *logical tensors* (``TensorEntry``: name, shape, dtype, role), each made of
*pieces* (``Piece``: a run of its flattened elements stored contiguously in one file, at a known byte
offset), plus one frozen manifest (``CheckpointMeta``). Readers build all of it from headers and
pickled metadata only; tensor bytes are read on demand, one tensor at a time, through mmap
(``zckpt.io.storage``), touching only the bytes that tensor needs.

Keys: a model tensor's key is its state-dict name (``"emb.weight"``); an optimizer state's key is
``"<param name>:<state>"`` (``"emb.weight:exp_avg"``). Tied aliases resolve to their owner's entry.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from zckpt.errors import CorruptCheckpoint, KeyMappingError

STATE_SEP = ":"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise KeyMappingError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


class Role(str, enum.Enum):
    """What a logical tensor is."""

    PARAM = "param"
    """A trainable parameter. Read from the fp32 master copy wherever the format keeps one."""
    FROZEN = "frozen"
    """A parameter with ``requires_grad=False`` (no master, no optimizer state)."""
    BUFFER = "buffer"
    """A persistent buffer, in its own dtype (int64 stays int64)."""
    OPTIM = "optim"
    """An optimizer state of one trainable parameter (``TensorEntry.state`` says which)."""

    @property
    def is_model(self) -> bool:
        return self is not Role.OPTIM


@dataclass(frozen=True, eq=False)
class Piece:
    """A contiguous run of a logical tensor's flattened elements, stored in one file.

    ``start``/``numel`` place the run in the flattened logical tensor; ``file``/``byte_offset``/
    ``dtype`` say where its bytes are (``dtype`` is the stored dtype, which the reader casts to the
    logical one when they differ). ``padding`` counts stored elements after the run that belong to no
    tensor; they are never read. ``value`` holds a tensor that lives in no file (a Python number in a
    pickle); then ``file`` is empty.
    """

    file: str
    byte_offset: int
    dtype: torch.dtype
    start: int
    numel: int
    rank: int | None = None
    padding: int = 0
    value: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, eq=False)
class TensorEntry:
    """One logical tensor: its identity and the pieces that hold its bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: Role
    pieces: tuple[Piece, ...]
    state: str | None = None

    def __post_init__(self) -> None:
        if (self.role is Role.OPTIM) != (self.state is not None):
            raise ValueError(f"{self.name}: optimizer entries need a state name and only they have one")
        covered = 0
        for p in sorted(self.pieces, key=lambda p: p.start):
            if p.start != covered:
                raise CorruptCheckpoint(
                    f"{self.key}: pieces leave a gap or overlap at element {covered} (next piece starts at "
                    f"{p.start}, file {p.file or '<inline>'})"
                )
            covered += p.numel
        if covered != self.numel:
            raise CorruptCheckpoint(
                f"{self.key}: pieces hold {covered} elements but shape {list(self.shape)} needs {self.numel}",
                hint="a rank file is missing or belongs to another run",
            )

    @property
    def key(self) -> str:
        return self.name if self.state is None else f"{self.name}{STATE_SEP}{self.state}"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def stored_nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "role": self.role.value,
            "pieces": [
                {
                    "file": p.file,
                    "byte_offset": p.byte_offset,
                    "dtype": dtype_name(p.dtype),
                    "start": p.start,
                    "numel": p.numel,
                    "rank": p.rank,
                    "padding": p.padding,
                }
                for p in self.pieces
            ],
        }


@dataclass(frozen=True)
class OptimizerInfo:
    """The optimizer as the checkpoint recorded it.

    ``param_groups`` are the hyper-parameters of each group with ``params`` replaced by parameter
    names; ``state_names`` the per-parameter states present (``exp_avg``, ``momentum_buffer``, ...).
    """

    kind: str
    param_groups: tuple[dict[str, Any], ...] = ()
    state_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckpointMeta:
    """The manifest: everything about a checkpoint that is not tensor bytes."""

    format: str
    path: str
    world_size: int = 1
    stage: int | None = None
    tag: str | None = None
    step: int | None = None
    precision: str | None = None
    optimizer: OptimizerInfo | None = None
    tied: Mapping[str, str] = field(default_factory=dict)
    config: Mapping[str, Any] | None = None
    files: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Format-specific state: scheduler, loss scaler, client_state, versions, step counters..."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        for alias, owner in self.tied.items():
            if alias == owner:
                raise ValueError(f"tied alias {alias!r} points at itself")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tied"] = dict(self.tied)
        return json.loads(json.dumps(d, default=_json_default))


def _json_default(o: Any) -> Any:
    if isinstance(o, torch.dtype):
        return dtype_name(o)
    if isinstance(o, torch.Tensor):
        return o.tolist() if o.numel() <= 16 else f"<tensor {list(o.shape)} {dtype_name(o.dtype)}>"
    if isinstance(o, enum.Enum):
        return o.value
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return repr(o)
