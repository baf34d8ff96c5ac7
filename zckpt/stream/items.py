"""What writers write: ``WriteItem`` (one tensor: a source ``TensorEntry`` — or a range of its flattened
elements followed by zero padding, as partitions are written — and the output dtype, its bytes produced in
bounded chunks) and the helpers that build items from in-memory tensors."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zckpt import dtypes
from zckpt.dtypes import DType, torch_of
from zckpt.model import Piece, Role, TensorEntry
from zckpt.stream.spans import CHUNK_BYTES, iter_chunks, windows

if TYPE_CHECKING:  # a WriteItem is metadata: the writers that make tensors import torch
    import torch


@dataclass(frozen=True)
class WriteItem:
    """One tensor to write: its output name, source entry and output dtype (zckpt's or torch's). With
    ``span=(lo, hi)`` only the entry's flattened elements ``[lo, hi)`` are written, followed by ``pad`` zeros,
    as a 1-D tensor."""

    name: str
    entry: TensorEntry
    dtype: DType | torch.dtype
    span: tuple[int, int] | None = None
    pad: int = 0

    @property
    def range(self) -> tuple[int, int]:
        return self.span if self.span is not None else (0, self.entry.numel)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape if self.span is None and not self.pad else (self.numel,)

    @property
    def numel(self) -> int:
        lo, hi = self.range
        return hi - lo + self.pad

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def role(self) -> Role:
        return self.entry.role

    def chunks(self, max_bytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
        """The tensor's bytes in order, as contiguous 1-D tensors of the output dtype."""
        import torch

        lo, hi = self.range
        yield from iter_chunks(self.entry, self.dtype, max_bytes, lo, hi)
        for a, b in windows(0, self.pad, max(1, max_bytes // self.dtype.itemsize)):
            yield torch.zeros(b - a, dtype=torch_of(self.dtype))


def entry_from_tensor(name: str, t: torch.Tensor, role: Role = Role.PARAM) -> TensorEntry:
    """A ``TensorEntry`` over an in-memory tensor (for writing state dicts built in Python)."""
    flat = t.detach().reshape(-1).contiguous().cpu()
    dtype = dtypes.of(flat.dtype)
    piece = Piece("", 0, dtype, 0, flat.numel(), value=flat)
    return TensorEntry(name, tuple(t.shape), dtype, role, (piece,))


def items_from_state_dict(
    sd: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None
) -> tuple[list[WriteItem], dict[str, str]]:
    """``WriteItem``s for a state dict plus its tied aliases (names sharing storage, offset and shape).

    The first name of each tied group owns the data; ``dtype`` casts floating tensors.
    """
    items: list[WriteItem] = []
    tied: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, t in sd.items():
        sig = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and sig in seen:
            tied[name] = seen[sig]
            continue
        seen[sig] = name
        out = dtype if dtype is not None and t.is_floating_point() else t.dtype
        items.append(WriteItem(name, entry_from_tensor(name, t), out))
    return items, tied


def tensor_bytes(chunk: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous tensor, without a copy."""
    import torch

    return memoryview(chunk.contiguous().view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
