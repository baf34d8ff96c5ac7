"""Pickles for mutation, never executed: a round trip through inert stand-ins, zip record rewriting, and
crafted pickles built opcode by opcode.

- ``load_opaque`` turns a torch ``data.pkl`` into plain containers plus ``Opaque`` stand-ins: every global
  outside a few builtins becomes an ``Opaque`` class named like the original (tensor rebuild functions,
  ``torch.Size``, DeepSpeed classes), every call or ``NEWOBJ`` an instance keeping its arguments and state,
  every persistent id a ``Persistent``. ``dump_opaque`` writes it back as protocol 2 under the same global
  names, so zckpt (or torch) reads the same structure. Nothing from the file is imported or called.
- Paths (tuples of steps) address nodes of that tree for the mutators: ``walk``, ``get_at``, ``set_at``,
  ``delete_at``, ``rename_at``.
- ``rewrite_records`` replaces records of a torch zip archive (the pickle, a storage) through torch's own
  archive writer, so CRCs and alignment are right and only the chosen content differs.
- ``bomb_*`` build hostile pickles from opcodes zckpt's allowlist accepts.
"""

from __future__ import annotations

import collections
import copyreg
import io
import os
import pickle
import struct
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Step = tuple[str, Any]  # ("key", k) | ("idx", i) | ("arg", i) | ("state", k)
NodePath = tuple[Step, ...]

_REAL = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "list"): list,
    ("builtins", "dict"): dict,
    ("builtins", "tuple"): tuple,
    ("builtins", "bytearray"): bytearray,
    ("__builtin__", "set"): set,
}
TENSOR_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch._tensor", "_rebuild_from_type_v2"),
}


class Opaque:
    """An inert object standing for a call of (or ``NEWOBJ`` on) a global named ``GLOBAL``."""

    GLOBAL: tuple[str, str] = ("", "")
    args: list[Any]
    newobj: bool
    state: Any
    items: list[Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        obj = object.__new__(cls)
        obj.args = list(args)
        obj.newobj = True
        obj.state = None
        obj.items = []
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.newobj = False  # reached only through a plain call (REDUCE)

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, item: Any) -> None:
        self.items.append(item)

    def extend(self, items: Any) -> None:
        self.items.extend(items)

    def __reduce_ex__(self, protocol: Any) -> Any:
        items = iter(self.items) if self.items else None
        if self.newobj:
            return (copyreg.__newobj__, (type(self), *self.args), self.state, items)  # type: ignore[attr-defined]
        return (type(self), tuple(self.args), self.state, items)

    def __repr__(self) -> str:
        return f"{'.'.join(self.GLOBAL)}{tuple(self.args)!r:.120}"


_CLASSES: dict[tuple[str, str], type[Opaque]] = {}


def opaque_class(module: str, name: str) -> type[Opaque]:
    key = (module, name)
    if key not in _CLASSES:
        _CLASSES[key] = type(name, (Opaque,), {"GLOBAL": key, "__module__": module, "__qualname__": name})
    return _CLASSES[key]


@dataclass(eq=False)
class Persistent:
    """A persistent id (torch: ``("storage", storage type, key, location, numel)``), kept as a list."""

    pid: list[Any]


class _Loader(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return _REAL.get((module, name)) or opaque_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        return Persistent(list(pid) if isinstance(pid, tuple) else [pid])


_PurePickler: Any = pickle._Pickler  # the pure-Python pickler: its save_global is a hook


class _Dumper(_PurePickler):
    def persistent_id(self, obj: Any) -> Any:
        return tuple(obj.pid) if isinstance(obj, Persistent) else None

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if isinstance(obj, type) and issubclass(obj, Opaque):
            module, qual = obj.GLOBAL
            self.write(pickle.GLOBAL + module.encode() + b"\n" + qual.encode() + b"\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)


def load_opaque(data: bytes) -> Any:
    return _Loader(io.BytesIO(data)).load()


def dump_opaque(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Dumper(buf, protocol=2).dump(obj)
    return buf.getvalue()


def is_tensor(o: Any) -> bool:
    return isinstance(o, Opaque) and o.GLOBAL in TENSOR_GLOBALS


def rebuild_args(o: Opaque) -> list[Any]:
    """The (mutable) argument list of the ``_rebuild_tensor_v2`` call inside a tensor rebuild:
    ``[storage, offset, size, stride, requires_grad, hooks]``; edits to it reach the pickle."""
    while o.GLOBAL != ("torch._utils", "_rebuild_tensor_v2"):
        if o.GLOBAL[1] == "_rebuild_from_type_v2":
            o.args[2] = list(o.args[2])  # func(*args) takes a list as well as a tuple
            inner: list[Any] = o.args[2]
            return inner
        o = o.args[0]
    return o.args


# ---- paths into the tree -----------------------------------------------------------------------------
def children(o: Any) -> Iterator[tuple[Step, Any]]:
    if isinstance(o, dict):
        for k, v in list(o.items()):
            yield ("key", k), v
    elif isinstance(o, (list, tuple)):
        for i, v in enumerate(o):
            yield ("idx", i), v
    elif isinstance(o, Opaque):
        for i, v in enumerate(o.args):
            yield ("arg", i), v
        if isinstance(o.state, dict):
            for k, v in o.state.items():
                yield ("state", k), v


def walk(o: Any, max_depth: int = 8, path: NodePath = ()) -> Iterator[tuple[NodePath, Any]]:
    """Every node under ``o`` (``o`` itself excluded) with its path, depth-first, up to ``max_depth``."""
    if len(path) >= max_depth:
        return
    for step, v in children(o):
        yield (*path, step), v
        if not is_tensor(v) and not isinstance(v, Persistent):
            yield from walk(v, max_depth, (*path, step))


def get_at(o: Any, path: NodePath) -> Any:
    for kind, k in path:
        if kind == "arg":
            o = o.args[k]
        elif kind == "state":
            o = o.state[k]
        else:
            o = o[k]
    return o


def set_at(root: Any, path: NodePath, value: Any) -> Any:
    """``root`` with the node at ``path`` replaced (tuples on the way are rebuilt); returns the root."""
    if not path:
        return value
    (kind, k), rest = path[0], path[1:]
    child = get_at(root, (path[0],))
    new = set_at(child, rest, value)
    if isinstance(root, tuple):
        lst = list(root)
        lst[k] = new
        return type(root)(lst) if type(root) is tuple else root
    if kind == "arg":
        root.args[k] = new
    elif kind == "state":
        root.state[k] = new
    else:
        root[k] = new
    return root


def _edit_parent(root: Any, path: NodePath, edit: Callable[[Any, Any], Any]) -> Any:
    parent = get_at(root, path[:-1])
    kind, k = path[-1]
    if isinstance(parent, tuple):
        lst = list(parent)
        edit(lst, k)
        return set_at(root, path[:-1], tuple(lst))
    edit(parent.state if kind == "state" else parent.args if kind == "arg" else parent, k)
    return root


def delete_at(root: Any, path: NodePath) -> Any:
    def drop(container: Any, k: Any) -> None:
        del container[k]

    return _edit_parent(root, path, drop)


def rename_at(root: Any, path: NodePath, new_key: Any) -> Any:
    """Rename a dict key in place, keeping its position."""
    parent = get_at(root, path[:-1])
    if not isinstance(parent, dict):
        raise TypeError("rename needs a dict parent")
    items = [(new_key if k == path[-1][1] else k, v) for k, v in parent.items()]
    parent.clear()
    parent.update(items)
    return root


def describe(path: NodePath) -> str:
    out = ""
    for kind, k in path:
        out += f".{k}" if kind == "key" and isinstance(k, str) else f"[{k!r}]" if kind != "arg" else f"<{k}>"
    return out.lstrip(".") or "<root>"


# ---- torch zip archives ------------------------------------------------------------------------------
_AUTO = {".format_version", ".storage_alignment", "byteorder", "version", ".data/serialization_id"}


def read_records(path: Path) -> tuple[str, dict[str, bytes]]:
    """(archive prefix, {record name without prefix: bytes}) of a torch zip archive."""
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        prefix = next(n for n in names if n.endswith("data.pkl"))[: -len("data.pkl")]
        return prefix, {n[len(prefix) :]: zf.read(n) for n in names}


def read_pickle(path: Path) -> bytes:
    return read_records(path)[1]["data.pkl"]


def rewrite_records(path: Path, changes: dict[str, bytes]) -> None:
    """Rewrite the torch zip archive ``path`` in place with some records replaced (or added)."""
    _, records = read_records(path)
    records.update(changes)
    stage = path.with_name(path.name + ".rewrite.d")
    stage.mkdir()
    target = stage / path.name  # torch names the archive folder after the file's stem
    w = torch._C.PyTorchFileWriter(str(target))
    for rel, data in records.items():
        if rel not in _AUTO:
            w.write_record(rel, data, len(data))
    w.write_end_of_file()
    del w
    os.replace(target, path)
    stage.rmdir()


# ---- crafted pickles (opcodes only) --------------------------------------------------------------------
def op_str(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def op_int(n: int) -> bytes:
    """An int of any size (LONG1 / LONG4)."""
    raw = n.to_bytes((n.bit_length() + 8) // 8 or 1, "little", signed=True)
    return (b"\x8a" + bytes([len(raw)]) if len(raw) < 256 else b"\x8b" + struct.pack("<I", len(raw))) + raw


def op_global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def op_call(fn: bytes, *args: bytes) -> bytes:
    return fn + b"(" + b"".join(args) + b"tR"


def with_item(pkl: bytes, key: str, value_ops: bytes) -> bytes:
    """A protocol-2 dict pickle with one more item ``key: value`` set after it is built."""
    if not (pkl[:2] == b"\x80\x02" and pkl[-1:] == b"."):
        raise ValueError("not a protocol-2 pickle")
    return pkl[:-1] + op_str(key) + value_ops + b"s."


def bomb_bytearray(nbytes: int = 3 << 30) -> bytes:
    """``bytearray(n)``: a multi-GiB allocation claimed by 10 bytes."""
    return op_call(op_global("builtins", "bytearray"), op_int(nbytes))


def bomb_memo(index: int = 1 << 28) -> bytes:
    """An empty dict stored at memo slot ``index`` (LONG_BINPUT) and fetched back."""
    return b"}r" + struct.pack("<I", index) + b"0j" + struct.pack("<I", index)


def bomb_nested_lists(depth: int = 200_000) -> bytes:
    """``[[[...]]]`` ``depth`` levels deep."""
    return b"]" * depth + b"a" * (depth - 1)


def bomb_nested_dicts(depth: int = 200_000) -> bytes:
    """``{"k": {"k": ...}}`` ``depth`` levels deep."""
    return (b"}" + op_str("k")) * (depth - 1) + b"}" + b"s" * (depth - 1)


def bomb_self_dict() -> bytes:
    """A dict holding itself: ``d = {}; d["self"] = d``."""
    return b"}q\x00" + op_str("self") + b"h\x00s"


def bomb_shared_chain(levels: int = 64) -> bytes:
    """``d_k = {"a": d_(k+1), "b": d_(k+1)}``: a DAG of ``levels`` dicts with 2**levels paths."""
    ops = b"}r" + struct.pack("<I", 0)
    for k in range(1, levels):
        ops += b"0}r" + struct.pack("<I", k)
        ops += op_str("a") + b"j" + struct.pack("<I", k - 1) + op_str("b") + b"j" + struct.pack("<I", k - 1)
        ops += b"s" * 2
    return ops


def bomb_device(kind: str = "bogus") -> bytes:
    """``torch.device("bogus")``: an allowlisted constructor given a value it rejects."""
    return op_call(op_global("torch", "device"), op_str(kind))


BOMBS: dict[str, Callable[[], bytes]] = {
    "bytearray-3GiB": bomb_bytearray,
    "memo-2^28": bomb_memo,
    "nested-lists-200k": bomb_nested_lists,
    "nested-dicts-200k": bomb_nested_dicts,
    "self-dict": bomb_self_dict,
    "shared-chain-64": bomb_shared_chain,
    "torch-device-bogus": bomb_device,
}
