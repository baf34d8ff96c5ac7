"""The format-independent checkpoint model every command works on.

A checkpoint is a set of *logical tensors* (``TensorEntry``: name, shape, dtype, role), each made of *pieces*
(``Piece``: a run of its flattened elements stored contiguously in one file, at a known byte offset), plus one
frozen manifest (``CheckpointMeta``). Readers build all of it from headers and pickled metadata only; tensor
bytes are read on demand, one tensor at a time, with ``pread`` (``zckpt.storage.fileio``), touching only the
bytes that tensor needs.

Keys: a model tensor's key is its state-dict name (``"emb.weight"``); an optimizer state's key is
``"<param name>:<state>"`` (``"emb.weight:exp_avg"``). Tied aliases resolve to their owner's entry.
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from zckpt import dtypes
from zckpt.dtypes import DType
from zckpt.errors import CorruptCheckpoint, InvalidArgument, KeyMappingError

if TYPE_CHECKING:
    import torch

STATE_SEP = ":"

DTYPES: dict[str, DType] = {
    n: dtypes.BY_NAME[n]
    for n in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
              "float8_e4m3fn", "float8_e5m2")
}  # fmt: skip
"""The dtypes a checkpoint's tensors may have (``parse_dtype`` reads their names)."""


PRECISIONS: dict[str, DType] = {"fp32": dtypes.float32, "bf16": dtypes.bfloat16, "fp16": dtypes.float16}
"""Training precisions (DeepSpeed's names) and their compute dtypes."""
_PRECISION_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
}
OUTPUT_DTYPES = ("auto", *PRECISIONS)
"""``consolidate(dtype=...)``'s choices (``parse_output_dtype`` reads every spelling of them)."""


def precision_of(dtype: DType | torch.dtype) -> str:
    """The training precision whose compute dtype is ``dtype`` (fp32 for anything else)."""
    return next((k for k, v in PRECISIONS.items() if v == dtype), "fp32")


def parse_precision(name: str) -> str | None:
    """``fp32``/``bf16``/``fp16`` for a precision or dtype name (``bfloat16``, ``half``...), else None."""
    key = name.lower().removeprefix("torch.")
    key = _PRECISION_ALIASES.get(key, key)
    return key if key in PRECISIONS else None


def parse_output_dtype(dtype: str | DType | torch.dtype) -> str:
    """``auto``, ``fp32``, ``bf16`` or ``fp16`` for an output dtype in any spelling people type.

    Accepts DeepSpeed's names (``fp32``, ``bf16``, ``fp16``), torch's (``float32``, ``bfloat16``,
    ``float16``, ``half``, ``float``, with or without ``torch.``, or a ``torch.dtype``), and transformers'
    ``torch_dtype`` values (``"bfloat16"``, ``"auto"``), in any case. The one parser behind the library's
    ``dtype=`` and the CLI's ``--dtype``.

    Raises:
        InvalidArgument: (a ``ValueError``) for any other name or dtype.
    """
    if isinstance(dtype, DType) or dtypes.is_torch_dtype(dtype):
        got = next((k for k, v in PRECISIONS.items() if v == dtype), None)
    elif isinstance(dtype, str):
        got = "auto" if dtype.strip().lower() == "auto" else parse_precision(dtype.strip())
    else:
        got = None
    if got is None:
        raise InvalidArgument(
            f"unknown dtype {dtype!r}; choose auto, fp32, bf16 or fp16",
            hint="torch's and transformers' names work too: float32, bfloat16, float16, torch.bfloat16",
        )
    return got


def dtype_name(dtype: DType | torch.dtype) -> str:
    return dtype.name if isinstance(dtype, DType) else str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> DType:
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
        """A model tensor (param, frozen param or buffer), not an optimizer state."""
        return self is not Role.OPTIM


@dataclass(frozen=True)
class Checked:
    """A stored byte range whose checksum is recorded: ``size`` bytes at ``start`` of ``file`` with CRC-32
    ``crc32`` (a zip record), or a whole file with its ``sha256`` (a ``.sha256`` sidecar, a native
    manifest's digest) or its ``blocks``' digests (``algorithm``: ``crc32`` from a ``.crc32.json`` sidecar,
    ``sha256`` from a ``.sha256.json`` one or a native manifest); ``what`` names it. Pieces inside it carry
    it so reads can verify it."""

    file: str
    start: int
    size: int
    crc32: int | None
    what: str
    sha256: str | None = None
    block: int = 0
    """With ``blocks``: the file's digest per ``block`` bytes (a block sidecar), not whole."""
    blocks: tuple[str, ...] = ()
    algorithm: str = "sha256"
    """Of ``blocks`` (hex): ``crc32`` or ``sha256``."""


@dataclass(frozen=True, eq=False)
class Piece:
    """Part of a logical tensor's flattened elements, stored contiguously in one file.

    A plain piece is one run: elements ``[start, start + numel)`` of the flattened logical tensor.
    ``file``/``byte_offset``/``dtype`` say where its bytes are (``dtype`` is the stored dtype, which the
    reader casts to the logical one when they differ). ``padding`` counts stored elements after the run that
    belong to no tensor; they are never read. ``value`` holds a tensor that lives in no file, or a Python
    number of a pickle (``inline()`` gives either as a tensor); then ``file`` is empty.

    A box piece (a chunk of a tensor cut along inner dimensions, as tensor parallelism does) has a
    ``grid``: outer loops ``(count, stride)``, outermost first. It holds ``prod(counts)`` runs of
    ``run = numel // prod(counts)`` elements stored one after another; the run at loop indices
    ``(i_0, ..., i_k)`` is logical ``[start + sum(i_j * stride_j), ... + run)``. ``runs`` lists them.
    """

    file: str
    byte_offset: int
    dtype: DType
    start: int
    numel: int
    rank: int | None = None
    padding: int = 0
    value: torch.Tensor | int | float | bool | None = None
    grid: tuple[tuple[int, int], ...] = ()
    check: Checked | None = None
    """The checksummed record holding the piece's bytes, when the format records one."""

    def __post_init__(self) -> None:
        if type(self.dtype) is not DType:  # a torch.dtype or a name from a caller: zckpt's own value
            object.__setattr__(self, "dtype", dtypes.of(self.dtype))

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def inline(self) -> torch.Tensor:
        """``value`` as a tensor of ``dtype`` (a Python number, as readers keep one, becomes one element):
        what reads of an in-memory piece copy from. Imports torch."""
        import torch

        v = self.value
        if isinstance(v, torch.Tensor):
            return v
        if v is None:
            raise ValueError(f"a piece of {self.file or '<inline>'} holds no in-memory value")
        return torch.tensor([v], dtype=self.dtype.torch)

    @property
    def nruns(self) -> int:
        return math.prod(c for c, _ in self.grid)

    @property
    def run(self) -> int:
        """Elements per contiguous run."""
        return self.numel // self.nruns if self.grid else self.numel

    def _run_start(self, j: int) -> int:
        at, rest = self.start, j
        for count, stride in reversed(self.grid):
            rest, i = divmod(rest, count)
            at += i * stride
        return at

    def runs(self, lo: int = 0, hi: int | None = None) -> Iterator[tuple[int, int, int]]:
        """``(logical start, element offset in the piece's storage, length)`` of each run overlapping logical
        ``[lo, hi)``, clipped to it, in logical order."""
        hi = self.start + self._extent() if hi is None else hi
        if not self.grid:
            a, b = max(lo, self.start), min(hi, self.start + self.numel)
            if b > a:
                yield a, a - self.start, b - a
            return
        run, j, n = self.run, 0, self.nruns
        top = n
        while j < top:  # first run ending after lo (run starts grow with j)
            mid = (j + top) // 2
            if self._run_start(mid) + run <= lo:
                j = mid + 1
            else:
                top = mid
        while j < n:
            at = self._run_start(j)
            if at >= hi:
                return
            a, b = max(lo, at), min(hi, at + run)
            if b > a:
                yield a, j * run + (a - at), b - a
            j += 1

    def _extent(self) -> int:
        """Logical span from ``start`` to the end of the last run."""
        return self._run_start(self.nruns - 1) + self.run - self.start if self.grid else self.numel


@dataclass(frozen=True, eq=False)
class TensorEntry:
    """One logical tensor: its identity and the pieces that hold its bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    role: Role
    pieces: tuple[Piece, ...]
    state: str | None = None
    pytype: str | None = None
    """``"int"`` / ``"float"`` when the source saved a 0-d value as a Python number (an optimizer's
    ``step``): writers give it back that type."""

    def __post_init__(self) -> None:
        if type(self.dtype) is not DType:
            object.__setattr__(self, "dtype", dtypes.of(self.dtype))
        _check_state(self.name, self.role, self.state)
        _check_pieces(self.key, self.shape, self.pieces)

    deferred: ClassVar[bool] = False
    """Pieces found on first use (``DeferredEntry``): they lie in files, never in memory."""

    @property
    def key(self) -> str:
        """The checkpoint key: the name, or ``<name>:<state>`` for an optimizer state."""
        return self.name if self.state is None else f"{self.name}{STATE_SEP}{self.state}"

    @property
    def numel(self) -> int:
        """Number of elements of the logical tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the logical tensor in its dtype."""
        return self.numel * self.dtype.itemsize

    @property
    def stored_nbytes(self) -> int:
        """Bytes its pieces occupy on disk (padding excluded)."""
        return sum(p.nbytes for p in self.pieces)

    def to_json(self) -> dict[str, Any]:
        """This entry as JSON values (name, shape, dtype, role, pieces)."""
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


def _check_state(name: str, role: Role, state: str | None) -> None:
    if (role is Role.OPTIM) != (state is not None):
        raise ValueError(f"{name}: optimizer entries need a state name and only they have one")


def _check_pieces(key: str, shape: tuple[int, ...], pieces: tuple[Piece, ...]) -> None:
    """The pieces hold exactly the tensor's elements: plain pieces tile it, box pieces add up to it."""
    numel = math.prod(shape)
    if any(p.grid for p in pieces):  # box pieces: their reader checked that the boxes tile
        total = sum(p.numel for p in pieces)
        if total != numel:
            raise CorruptCheckpoint(
                f"{key}: pieces hold {total} elements but shape {list(shape)} needs {numel}",
                hint="a file is missing or belongs to another run",
            )
        return
    covered = 0
    for p in sorted(pieces, key=lambda p: p.start):
        if p.start != covered:
            raise CorruptCheckpoint(
                f"{key}: pieces leave a gap or overlap at element {covered} (next piece starts at "
                f"{p.start}, file {p.file or '<inline>'})"
            )
        covered += p.numel
    if covered != numel:
        raise CorruptCheckpoint(
            f"{key}: pieces hold {covered} elements but shape {list(shape)} needs {numel}",
            hint="a rank file is missing or belongs to another run",
        )


class DeferredEntry(TensorEntry):
    """A ``TensorEntry`` whose pieces are found when first asked for: ``resolve()`` gives them, once, on
    whichever thread asks first (it must give the same pieces, or raise the same error, on every call). A
    reader that locates its chunks then (``zckpt.formats.dcp.locate``) so overlaps the locating with the
    writing of the tensors before. The pieces are checked as ``TensorEntry``'s are, when resolved."""

    deferred: ClassVar[bool] = True

    def __init__(  # noqa: PLR0913 - TensorEntry's fields, the pieces replaced by their resolver
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: DType | torch.dtype,
        role: Role,
        resolve: Callable[[], tuple[Piece, ...]],
        state: str | None = None,
        pytype: str | None = None,
    ) -> None:
        _check_state(name, role, state)
        fields = {"name": name, "shape": shape, "dtype": dtypes.of(dtype), "role": role, "state": state}
        for k, v in (*fields.items(), ("pytype", pytype), ("_resolve", resolve)):
            object.__setattr__(self, k, v)

    def __getattr__(self, attr: str) -> Any:  # only for what the instance lacks: ``pieces`` until resolved
        if attr != "pieces":
            raise AttributeError(attr)
        with _RESOLVING:  # one resolution: every thread sees the same Piece objects
            pieces: tuple[Piece, ...] | None = self.__dict__.get("pieces")
            if pieces is None:
                pieces = self.__dict__["_resolve"]()
                _check_pieces(self.key, self.shape, pieces)
                object.__setattr__(self, "pieces", pieces)
        return pieces


_RESOLVING = threading.RLock()
"""Held while a ``DeferredEntry`` resolves its pieces (re-entrant: a resolver may read another entry's)."""
