"""Streaming safetensors writer: the header (names, dtypes, shapes, offsets) first, then each tensor's bytes
as it is produced, so the writer never holds more than one tensor. Output goes to a temporary name in the
destination folder and is renamed into place by ``commit``; the sha256 and size of the bytes written are
returned for the manifest.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from zckpt.formats.hf import ST_DTYPES
from zckpt.io.outputs import HashingSink, tensor_bytes

_ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


class SafetensorsStream:
    """Write ``specs`` (name, dtype, shape), in order, one ``write(name, tensor)`` at a time."""

    def __init__(
        self,
        path: Path,
        specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        if self.tmp.exists():
            self.tmp.unlink()
        header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        self._order: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        offset = 0
        for name, dtype, shape in specs:
            n = 1
            for d in shape:
                n *= d
            nbytes = n * dtype.itemsize
            header[name] = {
                "dtype": _ST_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            self._order.append((name, dtype, tuple(shape)))
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._sink = HashingSink(self.tmp)
        try:
            self._sink.write(struct.pack("<Q", len(raw)))
            self._sink.write(raw)
        except BaseException:
            self.abort()
            raise
        self._next = 0

    def write(self, name: str, t: torch.Tensor) -> None:
        want, dtype, shape = self._order[self._next]
        if name != want or t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(
                f"{self.path}: expected {want} {dtype} {list(shape)}, got {name} {t.dtype} {list(t.shape)}"
            )
        self._sink.write(tensor_bytes(t.detach().to("cpu").reshape(-1)))
        self._next += 1

    def commit(self) -> tuple[str, int]:
        """Close, rename into place; return (sha256, size in bytes)."""
        if self._next != len(self._order):
            raise ValueError(f"{self.path}: {len(self._order) - self._next} tensors were never written")
        size = self._sink.tell()
        try:
            self._sink.close()
        except BaseException:
            self.abort()
            raise
        os.replace(self.tmp, self.path)
        return self._sink.hexdigest(), size

    def abort(self) -> None:
        """Remove the temporary file (also when closing it fails: a full disk fails the final flush)."""
        try:
            self._sink.close()
        except OSError:
            pass
        finally:
            self.tmp.unlink(missing_ok=True)


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
                  ) -> tuple[str, int]:  # fmt: skip
    """Write a dict of tensors (already in memory) atomically; return (sha256, size)."""
    w = SafetensorsStream(path, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], metadata)
    try:
        for k, t in tensors.items():
            w.write(k, t)
    except BaseException:
        w.abort()
        raise
    return w.commit()
