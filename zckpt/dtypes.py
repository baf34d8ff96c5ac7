"""zckpt's own element types: what metadata says about a tensor's dtype, without importing torch.

A ``DType`` is a frozen value (name, item size, kind, safetensors code, torch storage class, numpy
equivalent). Readers build the checkpoint model (``zckpt.model``) from headers and pickles with these, so
``inspect``, ``verify`` and ``diff`` of safetensors files never import torch; code that builds tensors asks
``dtype.torch`` (torch is imported then, on first use). A ``DType`` compares equal to the ``torch.dtype`` of
the same name (either side), so ``entry.dtype == torch.bfloat16`` keeps its meaning; ``of`` turns a torch
dtype or a name into the ``DType``. There is one ``DType`` object per name (``BY_NAME``).
"""

from __future__ import annotations

import importlib
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, eq=False, repr=False)
class DType:
    """One element type. Equal to another ``DType`` only when it is the same one, and to the
    ``torch.dtype`` of the same name; hashed by name."""

    name: str
    """torch's name, without ``torch.`` (``bfloat16``)."""
    itemsize: int
    kind: str
    """``f`` floating point, ``i`` signed integer, ``u`` unsigned integer, ``b`` bool, ``c`` complex."""
    safetensors: str | None
    """The safetensors header's code (``BF16``), None where safetensors has none."""
    storage: str | None
    """The legacy torch storage class that pickles name (``BFloat16Storage``), None where there is none."""
    numpy: str | None
    """The numpy dtype of the same values (``<f4``), None where numpy has none (bfloat16, float8)."""

    @property
    def is_floating_point(self) -> bool:
        return self.kind == "f"

    @property
    def is_complex(self) -> bool:
        return self.kind == "c"

    @property
    def torch(self) -> torch.dtype:
        """The ``torch.dtype`` (imports torch on first use)."""
        dt: torch.dtype = getattr(importlib.import_module("torch"), self.name)
        return dt

    def unpack(self, raw: bytes) -> int | float | bool:
        """The one little-endian value of this dtype in ``raw`` (a 0-d tensor's bytes: an optimizer's
        ``step``), without torch.

        Raises:
            ValueError: for a dtype with no Python scalar here (float8, complex), or ``raw`` of another size.
        """
        if len(raw) != self.itemsize:
            raise ValueError(f"{len(raw)} bytes are no {self.name} value")
        if self.name == "bfloat16":  # the top half of a float32
            return float(struct.unpack("<f", b"\0\0" + raw)[0])
        code = _STRUCT.get(self.name)
        if code is None:
            raise ValueError(f"no Python scalar for {self.name}")
        value: int | float | bool = struct.unpack(code, raw)[0]
        return value

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return other is self
        if is_torch_dtype(other):
            return str(other) == f"torch.{self.name}"
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return f"torch.{self.name}"  # what messages said when this was a torch.dtype

    __repr__ = __str__

    def __reduce__(self) -> tuple[Any, ...]:  # one object per name, across processes too
        return (of, (self.name,))


def is_torch_dtype(o: object) -> bool:
    t = type(o)
    return t.__name__ == "dtype" and t.__module__ == "torch"


_ALL = (
    DType("float64", 8, "f", "F64", "DoubleStorage", "<f8"),
    DType("float32", 4, "f", "F32", "FloatStorage", "<f4"),
    DType("float16", 2, "f", "F16", "HalfStorage", "<f2"),
    DType("bfloat16", 2, "f", "BF16", "BFloat16Storage", None),
    DType("float8_e4m3fn", 1, "f", "F8_E4M3", None, None),
    DType("float8_e5m2", 1, "f", "F8_E5M2", None, None),
    DType("int64", 8, "i", "I64", "LongStorage", "<i8"),
    DType("int32", 4, "i", "I32", "IntStorage", "<i4"),
    DType("int16", 2, "i", "I16", "ShortStorage", "<i2"),
    DType("int8", 1, "i", "I8", "CharStorage", "|i1"),
    DType("uint64", 8, "u", "U64", None, "<u8"),
    DType("uint32", 4, "u", "U32", None, "<u4"),
    DType("uint16", 2, "u", "U16", None, "<u2"),
    DType("uint8", 1, "u", "U8", "ByteStorage", "|u1"),
    DType("bool", 1, "b", "BOOL", "BoolStorage", "|b1"),
    DType("complex64", 8, "c", "C64", "ComplexFloatStorage", "<c8"),
    DType("complex128", 16, "c", None, "ComplexDoubleStorage", "<c16"),
)
_STRUCT = {"float64": "<d", "float32": "<f", "float16": "<e", "int64": "<q", "int32": "<i", "int16": "<h",
           "int8": "<b", "uint64": "<Q", "uint32": "<I", "uint16": "<H", "uint8": "<B",
           "bool": "<?"}  # fmt: skip
BY_NAME: dict[str, DType] = {d.name: d for d in _ALL}
"""Every ``DType`` by torch's name (without ``torch.``)."""
_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "long": "int64", "int": "int32",
            "short": "int16", "cfloat": "complex64", "cdouble": "complex128"}  # fmt: skip
"""torch's other names of the same dtypes (``torch.half is torch.float16``)."""

float64, float32, float16, bfloat16 = (BY_NAME[n] for n in ("float64", "float32", "float16", "bfloat16"))
float8_e4m3fn, float8_e5m2 = BY_NAME["float8_e4m3fn"], BY_NAME["float8_e5m2"]
int64, int32, int16, int8, uint8 = (BY_NAME[n] for n in ("int64", "int32", "int16", "int8", "uint8"))
bool_ = BY_NAME["bool"]

BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _ALL if d.safetensors is not None}
"""safetensors header codes (``BF16``) -> ``DType``."""
BY_STORAGE: dict[str, DType] = {d.storage: d for d in _ALL if d.storage is not None}
"""Legacy torch storage class names (``FloatStorage``) -> ``DType``."""


def lookup(name: str) -> DType | None:
    """The ``DType`` of a torch name (``bfloat16``, ``torch.half``), None for any other name."""
    key = name.removeprefix("torch.")
    return BY_NAME.get(_ALIASES.get(key, key))


def of(dtype: DType | str | torch.dtype) -> DType:
    """``dtype`` as a ``DType``: a ``DType`` itself, a torch dtype or a torch name.

    Raises:
        ValueError: for a name (or torch dtype) zckpt does not know.
    """
    if isinstance(dtype, DType):
        return dtype
    got = lookup(dtype if isinstance(dtype, str) else str(dtype))
    if got is None:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(BY_NAME)}")
    return got


def torch_of(dtype: DType | torch.dtype) -> torch.dtype:
    """``dtype`` as a ``torch.dtype`` (where tensors are built; imports torch)."""
    return dtype.torch if isinstance(dtype, DType) else dtype
