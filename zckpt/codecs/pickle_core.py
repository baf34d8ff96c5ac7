"""The bounded, allowlisted unpickle, without torch: what every zckpt unpickle shares.

``bounded_loads`` runs ``zckpt.codecs.pickle_scan.prescan`` (lengths, memo indices and the stack bounded
before the C unpickler allocates anything), then a ``RestrictedUnpickler`` that resolves globals through an
allowlist only (plain containers, the few builtins protocol-2 pickles spell bytes with, and a caller's inert
stand-ins), then ``check_graph`` (no cycles, bounded depth and expansion). Any failure is one
``CorruptCheckpoint`` or ``UnsafePickle`` naming the file. ``zckpt.codecs.pickle_safe`` adds torch's tensors,
dtypes and storages on top; DCP's ``.metadata`` loads through this module alone, so that the command line can
parse it in a process that has not imported torch (``zckpt.storage.preopen``).
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

from zckpt.codecs.pickle_scan import prescan
from zckpt.errors import CorruptCheckpoint, UnsafePickle
from zckpt.storage import collector

MAX_STACK = 10_000
"""Deepest unpickler stack a pickle may build (real checkpoints stay under a few thousand: one batch of
1000 dict items plus their nesting)."""
MAX_DEPTH = 256
"""Deepest nesting of containers in an unpickled object (real checkpoints: under 20)."""
MAX_NODES_PER_BYTE = 8
"""An unpickled structure, expanded as a tree (shared sub-objects counted at every use), may have at most
this many nodes per byte of its file (plus a constant): shared-reference bombs are refused."""


class _Record:
    """An inert object whose pickled ``__dict__`` is kept as-is (NEWOBJ + BUILD)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _codecs_encode(obj: str, encoding: str = "utf-8") -> bytes:
    if encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise UnsafePickle(f"refusing _codecs.encode with encoding {encoding!r}")
    return obj.encode(encoding)


def _bytearray(source: bytes | str = b"", encoding: str = "latin1") -> bytearray:
    """``bytearray`` for what pickles spell it with (bytes, or a str and an encoding), never from a size."""
    if isinstance(source, str):
        return bytearray(_codecs_encode(source, encoding))
    if not isinstance(source, (bytes, bytearray)):
        raise UnsafePickle(
            f"refusing bytearray({type(source).__name__}): a pickle may not size an allocation"
        )
    return bytearray(source)


PLAIN: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "list"): list,
    ("builtins", "dict"): dict,
    ("builtins", "tuple"): tuple,
    ("builtins", "bytearray"): _bytearray,  # never bytearray(n), which allocates n bytes
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("_codecs", "encode"): _codecs_encode,  # protocol-2 pickles spell bytes with it
}
"""The globals any pickle may name: constructors of plain values."""
_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}

LEAVES: frozenset[type] = frozenset({int, float, complex, str, bytes, bool, type(None)})
"""Types whose objects hold nothing to walk."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler whose globals come from ``allowed`` (on top of ``PLAIN``) or ``resolve`` (a hook for
    families of names, such as torch's dtypes), never from an import; no persistent ids."""

    def __init__(
        self, f: BinaryIO, *, source: str, allowed: Mapping[tuple[str, str], Any] | None = None
    ) -> None:
        super().__init__(f, encoding="utf-8")
        self.source = source
        self.allowed = allowed or {}

    def resolve(self, module: str, name: str) -> Any:
        """A global outside the tables, or None to refuse it (subclasses widen this)."""
        return None

    def find_class(self, module: str, name: str) -> Any:
        module = _PY2_MODULES.get(module, module)
        hit = self.allowed.get((module, name), PLAIN.get((module, name)))
        if hit is None:
            hit = self.resolve(module, name)
        if hit is not None:
            return hit
        raise UnsafePickle(
            f"{self.source}: the pickle asks for {module}.{name}, which is not on zckpt's allowlist; "
            f"nothing from it was run",
            hint="if you made this file yourself and trust it, pass --trust-pickle",
            path=self.source,
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle(f"{self.source}: unexpected persistent id {pid!r:.80}", path=self.source)


def children(o: Any) -> list[Any]:
    """What ``check_graph`` walks into: containers' items and inert records' fields."""
    if isinstance(o, dict):
        return [*o.keys(), *o.values()]
    if isinstance(o, (list, tuple, set, frozenset)):
        return list(o)
    if isinstance(o, _Record):
        return list(o.__dict__.values())
    return []


def check_graph(
    obj: Any,
    source: str,
    max_nodes: int,
    leaves: frozenset[type] = LEAVES,
    kids: Callable[[Any], list[Any]] = children,
) -> None:
    """Refuse cycles, nesting deeper than ``MAX_DEPTH`` and structures that expand (shared sub-objects
    counted at every use) to more than ``max_nodes``: every later walk over the object then terminates
    quickly, recursive or not. Iterative, each distinct object visited once (``leaves`` not at all)."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    # (object, level, None) to visit; (object, number of children, inner children) once they are sized.
    # A leaf child counts 1 (leaves are never in ``size``), so a container of leaves alone is sized at once:
    # most of a DCP ``.metadata`` (its storage records and chunk boxes), which halves the walk there.
    stack: list[tuple[Any, int, list[Any] | None]] = [(obj, 1, None)]
    while stack:
        o, level, inner = stack.pop()
        k = id(o)
        if inner is not None:  # its children are all sized (``level`` holds their number here)
            on_path.discard(k)
            n = 1 + level
            for c in inner:
                n += size.get(id(c), 1) - 1
            size[k] = n
            if n > max_nodes:
                raise _expands(source, max_nodes)
            continue
        if type(o) in leaves or k in size:
            continue
        got = kids(o)
        if not got:
            continue
        if k in on_path:
            raise UnsafePickle(f"{source}: pickled structure refers to itself", path=source)
        if level > MAX_DEPTH:
            raise UnsafePickle(f"{source}: pickled structure nests deeper than {MAX_DEPTH}", path=source)
        inner = [c for c in got if type(c) not in leaves]
        if not inner:
            size[k] = 1 + len(got)
            if 1 + len(got) > max_nodes:
                raise _expands(source, max_nodes)
            continue
        on_path.add(k)
        stack.append((o, len(got), inner))
        stack.extend([(c, level + 1, None) for c in inner])


def _expands(source: str, max_nodes: int) -> UnsafePickle:
    return UnsafePickle(f"{source}: pickled structure expands to more than {max_nodes} objects", path=source)


@collector.paused()  # the objects it unpickles and walks would each trigger a full GC rescan
def bounded_loads(
    data: bytes,
    *,
    source: str,
    unpickler: Callable[[BinaryIO], pickle.Unpickler],
    max_bytes: int | None = None,
    leaves: frozenset[type] = LEAVES,
    kids: Callable[[Any], list[Any]] = children,
) -> Any:
    """Unpickle ``data`` with ``unpickler(file)``, bounded (see the module doc). Any failure is one
    ``CorruptCheckpoint`` or ``UnsafePickle`` naming ``source``."""
    prescan(data, source, MAX_STACK)
    try:
        obj = unpickler(io.BytesIO(data)).load()
    except UnsafePickle as e:
        if e.path is None:  # raised by an allowlisted constructor, which does not know the file
            raise UnsafePickle(f"{source}: {e}", hint=e.hint, path=source) from None
        raise
    except Exception as e:  # noqa: BLE001 - whatever a damaged pickle makes a constructor raise
        msg = f"{source}: unreadable pickle ({type(e).__name__}: {str(e)[:120]})"
        raise CorruptCheckpoint(msg, path=source) from None
    check_graph(obj, source, MAX_NODES_PER_BYTE * max(len(data), max_bytes or 0) + 100_000, leaves, kids)
    return obj


__all__ = [
    "LEAVES",
    "MAX_DEPTH",
    "MAX_NODES_PER_BYTE",
    "MAX_STACK",
    "PLAIN",
    "RestrictedUnpickler",
    "bounded_loads",
    "check_graph",
    "children",
]
