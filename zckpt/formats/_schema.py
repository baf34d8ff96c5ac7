"""Typed access to parsed structures (a JSON manifest, an unpickled DeepSpeed state dict): a value of the
wrong type, a missing key or a number out of range is one ``CorruptCheckpoint`` naming the file and the
key path, never a ``KeyError``/``TypeError`` from deep inside a reader.

``Node(value, file)`` wraps a value; ``node["key"]`` (required) / ``node.get("key")`` (optional) step in;
``.as_int()``, ``.as_str()``, ``.as_list()``, ``.as_dict()``... return the value checked.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from zckpt.errors import CorruptCheckpoint

_MAX_SHOWN = 60


def _show(v: Any) -> str:
    try:
        text = repr(v)
    except Exception:  # noqa: BLE001 - a damaged stand-in record (a field missing) cannot print itself
        text = f"a damaged {type(v).__name__}"
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


class Node:
    """A value at ``where`` (a key path such as ``tensors[3].shape``) inside ``file``."""

    __slots__ = ("value", "file", "where")

    def __init__(self, value: Any, file: str, where: str = "") -> None:
        self.value = value
        self.file = file
        self.where = where

    def fail(self, expected: str, hint: str | None = None) -> CorruptCheckpoint:
        where = self.where if len(self.where) <= 90 else f"{self.where[:45]}...{self.where[-42:]}"
        what = f"{where} is {_show(self.value)}" if where else f"top level is {type(self.value).__name__}"
        return CorruptCheckpoint(f"{self.file}: {what}, expected {expected}", hint=hint, path=self.file)

    def _child(self, value: Any, key: object) -> Node:
        step = f"[{key}]" if isinstance(key, int) else (f".{key}" if self.where else str(key))
        return Node(value, self.file, f"{self.where}{step}")

    # -- stepping in ------------------------------------------------------------------------------
    def __getitem__(self, key: str) -> Node:
        d = self.as_dict()
        if key not in d:
            where = f"{self.where}.{key}" if self.where else key
            raise CorruptCheckpoint(f"{self.file}: {where} is missing", path=self.file)
        return self._child(d[key], key)

    def get(self, key: str) -> Node | None:
        """The value under ``key``, or None when it is absent or null."""
        d = self.as_dict()
        return None if d.get(key) is None else self._child(d[key], key)

    def has(self, key: str) -> bool:
        return isinstance(self.value, Mapping) and key in self.value

    def items(self) -> Iterator[tuple[str, Node]]:
        """The entries of a dict whose keys must be strings (names)."""
        for k, v in self.as_dict().items():
            if not isinstance(k, str):
                raise self._child(k, "<key>").fail("a string key")
            yield k, self._child(v, k)

    def int_items(self) -> Iterator[tuple[int, Node]]:
        """The entries of a dict keyed by indices (ints, or strings of digits as some savers write them)."""
        for k, v in self.as_dict().items():
            if isinstance(k, str) and k.isdigit():
                k = int(k)
            if not isinstance(k, int) or isinstance(k, bool) or k < 0:
                raise self._child(k, "<key>").fail("an index key")
            yield k, self._child(v, str(k))

    def __iter__(self) -> Iterator[Node]:
        for i, v in enumerate(self.as_list()):
            yield self._child(v, i)

    # -- checked values ---------------------------------------------------------------------------
    def as_dict(self) -> Mapping[Any, Any]:
        if not isinstance(self.value, Mapping):
            raise self.fail("a dict")
        return self.value

    def as_list(self) -> list[Any]:
        if not isinstance(self.value, (list, tuple)):
            raise self.fail("a list")
        return list(self.value)

    def as_int(self, lo: int | None = None, hi: int | None = None) -> int:
        v = self.value
        if not isinstance(v, int) or isinstance(v, bool):
            if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
                v = int(v)
            else:
                raise self.fail("an integer")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
            raise self.fail(f"an integer {rng}")
        return int(v)  # a plain int, also for int subclasses (enums) found in pickles

    def as_float(self) -> float:
        v = self.value
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise self.fail("a finite number")
        return float(v)

    def as_bool(self) -> bool:
        if not isinstance(self.value, bool):
            raise self.fail("true or false")
        return self.value

    def as_str(self, max_len: int = 4096) -> str:
        if not isinstance(self.value, str) or len(self.value) > max_len:
            raise self.fail("a string")
        return self.value

    def as_shape(self, max_numel: int | None = None) -> tuple[int, ...]:
        """A tensor shape: a list of non-negative integers (whose product is at most ``max_numel``)."""
        dims = tuple(n.as_int(lo=0) for n in self)
        if len(dims) > 64 or (max_numel is not None and math.prod(dims) > max_numel):
            raise self.fail("a tensor shape that fits the file")
        return dims

    def of_type(self, cls: type, expected: str) -> Any:
        if not isinstance(self.value, cls):
            raise self.fail(expected)
        return self.value
