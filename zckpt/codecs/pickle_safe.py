"""Unpickling without running code from the file: ``zckpt.codecs.pickle_core``'s bounded unpickle, with
torch's tensors as placeholders (torch itself is never imported here).

``SafeUnpickler`` resolves globals through an allowlist only: plain containers, torch's tensor
rebuild functions (which here build ``TensorRef`` placeholders instead of tensors), torch's dtypes (as
``zckpt.dtypes.DType``), sizes (``Size``, a tuple) and devices (``Device``), and inert stand-ins for the
few foreign classes real checkpoints hold (DeepSpeed's
``ZeroStageEnum``, ``LossScaler``, ``DynamicLossScaler``, ``fragment_address``, ``SubparamShape``,
``argparse.Namespace``, ``io.BytesIO`` (its bytes kept unparsed), numpy arrays); a caller may allow a few
more inert stand-ins for one pickle (``extra``). Anything else raises ``UnsafePickle`` naming the global
and the file, before anything is called. ``trust_pickle=True`` resolves unknown globals for real (with a
warning) — only for files you wrote yourself.
"""

from __future__ import annotations

import enum
import pickle
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from zckpt import dtypes
from zckpt.codecs.pickle_core import LEAVES, RestrictedUnpickler, bounded_loads, check_graph, children
from zckpt.codecs.pickle_core import MAX_DEPTH as MAX_DEPTH  # re-exported: the limits of every zckpt unpickle
from zckpt.codecs.pickle_core import MAX_NODES_PER_BYTE as MAX_NODES_PER_BYTE
from zckpt.codecs.pickle_core import MAX_STACK as MAX_STACK
from zckpt.codecs.pickle_core import _Record as _Record  # the formats' stand-ins derive from it
from zckpt.dtypes import DType
from zckpt.errors import CorruptCheckpoint, UnsafePickle
from zckpt.model import Checked

if TYPE_CHECKING:
    import torch


# ---- stand-ins for foreign classes -------------------------------------------------------------
class ZeroStageEnum(int, enum.Enum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum``."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class LossScaler(_Record):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler``."""


class DynamicLossScaler(_Record):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``."""


class Namespace(_Record):
    """Stand-in for ``argparse.Namespace`` (Megatron's ``args``)."""


class BytesIOValue(_Record):
    """Stand-in for ``io.BytesIO`` (torchtitan's train-state values): its bytes are kept, never parsed."""

    value: bytes = b""

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) >= 2 and isinstance(state[0], (bytes, bytearray))):
            raise UnsafePickle(f"io.BytesIO state of unexpected shape {type(state).__name__}")
        self.value = bytes(state[0])

    def __getstate__(self) -> tuple[bytes, int, None]:  # written back as io.BytesIO's own state
        return (self.value, 0, None)


@dataclass
class fragment_address:  # noqa: N801 - mirrors DeepSpeed's name
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address``."""

    numel: int
    start: int


@dataclass
class SubparamShape:
    """Stand-in for ``deepspeed.checkpoint.universal_checkpoint.SubparamShape``."""

    patterns: Any = None
    shape: Any = None
    partition_dim: Any = None


class Size(tuple[int, ...]):
    """Stand-in for ``torch.Size``: a tuple of ints (pickles call ``torch.Size(dims)``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"torch.Size({list(self)})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Size, (tuple(self),))


@dataclass(frozen=True)
class Device:
    """Stand-in for ``torch.device`` (``torch.device("cuda", 0)`` in a pickle): its type and index."""

    type: str
    index: int | None = None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


Allowed = Mapping[tuple[str, str], Any]
"""Globals a caller allows for one pickle: ``(module, name)`` -> the inert object they resolve to."""

# The dotted names these stand-ins are pickled under (also used by writers of DeepSpeed files).
FOREIGN_CLASSES: dict[tuple[str, str], Any] = {
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): ZeroStageEnum,
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): LossScaler,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): DynamicLossScaler,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): fragment_address,
    ("deepspeed.checkpoint.universal_checkpoint", "SubparamShape"): SubparamShape,
    ("argparse", "Namespace"): Namespace,
    ("_io", "BytesIO"): BytesIOValue,
}


# ---- tensor placeholders -----------------------------------------------------------------------
@dataclass(frozen=True)
class StorageRef:
    """A storage of a torch zip archive: record ``key`` holding ``numel`` elements of ``dtype``."""

    key: str
    dtype: DType
    numel: int


@dataclass(eq=False)
class TensorRef:
    """A tensor of a pickle, not loaded: its storage record, element offset, shape and stride.

    ``byte_offset`` is the absolute file offset of element 0, filled by ``zckpt.codecs.torchzip`` once the
    record offsets are known; ``attrs`` keeps Python attributes pickled with it (DeepSpeed's ``ds_id``).
    """

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool = False
    file: str = ""
    byte_offset: int = -1
    attrs: dict[str, Any] | None = None
    check: Checked | None = None
    """The zip record holding the storage, with its CRC-32 (``zckpt.storage.checks``)."""

    @property
    def dtype(self) -> DType:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def is_contiguous(self) -> bool:
        expect = 1
        for size, st in zip(reversed(self.shape), reversed(self.stride), strict=False):
            if size != 1 and st != expect:
                return False
            expect *= size
        return True

    def scalar(self) -> int | float | bool:
        """The value of a one-element tensor (an optimizer's ``step``), read without torch.

        Raises:
            CorruptCheckpoint: when its bytes lie past the end of the file.
        """
        from zckpt.storage import fileio

        fd = fileio.open_fd(self.file)
        try:
            raw = fileio.pread(fd, self.dtype.itemsize, self.byte_offset)
        finally:
            fileio.close_fd(fd)
        if self.numel != 1 or len(raw) != self.dtype.itemsize:
            raise CorruptCheckpoint(f"{self.file}: a {list(self.shape)} value lies past the end or is no "
                                    "scalar (truncated?)", path=self.file)  # fmt: skip
        return self.dtype.unpack(raw)

    def load(self) -> torch.Tensor:
        """Read this tensor's bytes (a copy, ``pread``: only the elements its view reaches).

        Raises:
            CorruptCheckpoint: when the view reaches outside its storage.
        """
        import torch

        from zckpt.storage import fileio

        if self.numel == 0:
            return torch.empty(self.shape, dtype=self.dtype.torch)
        reach = 1 + sum((n - 1) * st for n, st in zip(self.shape, self.stride, strict=True))
        if self.offset < 0 or min(self.stride, default=0) < 0 or self.offset + reach > self.storage.numel:
            raise CorruptCheckpoint(f"{self.file}: a {list(self.shape)} tensor's view reaches outside its "
                                    "storage", path=self.file)  # fmt: skip
        buf = torch.empty(reach, dtype=self.dtype.torch)
        fileio.read_into(self.file, self.byte_offset, buf)
        return torch.as_strided(buf, self.shape, self.stride, 0).clone()


class _StorageType:
    def __init__(self, dtype: DType) -> None:
        self.dtype = dtype


def _rebuild_tensor_v2(
    storage: StorageRef,
    offset: int,
    size: Any,
    stride: Any,
    requires_grad: bool = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> TensorRef:
    return TensorRef(storage, int(offset), tuple(size), tuple(stride), bool(requires_grad))


def _rebuild_parameter(data: TensorRef, requires_grad: bool, backward_hooks: Any, *state: Any) -> TensorRef:
    data.requires_grad = bool(requires_grad)
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: tuple[Any, ...], state: Any) -> Any:
    ret = func(*args)
    if isinstance(ret, TensorRef) and isinstance(state, dict) and state:
        ret.attrs = dict(state)
    return ret


class _Marker:
    """Inert placeholder for an allowlisted class used only as an argument (``torch.Tensor``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _numpy_global(name: str) -> Any:
    """numpy's own array/scalar rebuild functions (they construct data, never call user code)."""
    if name not in ("_reconstruct", "scalar", "ndarray", "dtype"):
        return None
    import importlib

    import numpy as np

    if name in ("ndarray", "dtype"):
        return getattr(np, name)
    for mod in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            return getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError):
            continue
    return None


_ALLOWED: dict[tuple[str, str], Any] = {  # on top of ``pickle_core.PLAIN``
    ("torch", "Size"): Size,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _Marker("torch.Tensor"),
    ("torch.nn.parameter", "Parameter"): _Marker("torch.nn.Parameter"),
    ("torch", "device"): Device,
    **FOREIGN_CLASSES,
}


_NUMPY_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray", "numpy")


class SafeUnpickler(RestrictedUnpickler):
    """Restricted unpickler; tensors come out as ``TensorRef`` placeholders."""

    def __init__(
        self,
        f: BinaryIO,
        *,
        source: str,
        trust_pickle: bool = False,
        extra: Mapping[tuple[str, str], Any] | None = None,
    ) -> None:
        super().__init__(f, source=source, allowed={**_ALLOWED, **(extra or {})})
        self.trust_pickle = trust_pickle
        self.refs: list[TensorRef] = []

    def resolve(self, module: str, name: str) -> Any:
        if module == "torch":  # dtypes and storage classes by name, from fixed tables (never getattr(torch))
            dt = dtypes.BY_STORAGE.get(name) if name.endswith("Storage") else dtypes.lookup(name)
            if dt is not None:
                return _StorageType(dt) if name.endswith("Storage") else dt
        if module in _NUMPY_MODULES:
            g = _numpy_global(name)
            if g is not None:
                return g
        if self.trust_pickle:
            warnings.warn(f"{self.source}: --trust-pickle: resolving {module}.{name} for real", stacklevel=2)
            return pickle.Unpickler.find_class(self, module, name)
        return None

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise UnsafePickle(f"{self.source}: unexpected persistent id {pid!r:.80}", path=self.source)
        _, stype, key, _location, numel = pid[:5]
        if not isinstance(key, str) or isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise UnsafePickle(f"{self.source}: malformed storage id {pid!r:.80}", path=self.source)
        if isinstance(stype, _StorageType):
            dtype = stype.dtype
        elif isinstance(stype, DType):
            dtype = stype
        else:
            raise UnsafePickle(f"{self.source}: storage of unknown type {stype!r:.80}", path=self.source)
        return StorageRef(str(key), dtype, int(numel))


_LEAVES: frozenset[type] = LEAVES | {DType, Size, Device, StorageRef}
"""Types whose objects hold nothing to walk (``Size`` holds ints only)."""


def _children(o: Any) -> list[Any]:
    if isinstance(o, TensorRef):
        return list(o.attrs.values()) if o.attrs else []
    return children(o)


def _check_graph(obj: Any, source: str, max_nodes: int) -> None:
    """``pickle_core.check_graph`` with torch's leaves and tensor placeholders' attributes."""
    check_graph(obj, source, max_nodes, _LEAVES, _children)


def safe_loads(
    data: bytes,
    *,
    source: str,
    trust_pickle: bool = False,
    max_bytes: int | None = None,
    extra: Mapping[tuple[str, str], Any] | None = None,
) -> Any:
    """Unpickle ``data`` (a pickle with no tensor storages, or one whose storages become refs), bounded: see
    ``zckpt.codecs.pickle_core.bounded_loads``. Any failure is one ``CorruptCheckpoint`` or ``UnsafePickle``.
    ``extra`` allows more globals for this one pickle (a format's own inert stand-ins)."""

    def unpickler(f: BinaryIO) -> SafeUnpickler:
        return SafeUnpickler(f, source=source, trust_pickle=trust_pickle, extra=extra)

    return bounded_loads(
        data, source=source, unpickler=unpickler, max_bytes=max_bytes, leaves=_LEAVES, kids=_children
    )
