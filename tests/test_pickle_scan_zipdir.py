"""The two hand-written parsers under every DCP open, against the standard library as the oracle.

``zckpt.codecs.pickle_scan.prescan`` (a table-driven opcode walk) must never pass a pickle that a walk through
``pickletools.genops`` with the same rules finds hostile (lying length, out-of-sequence memo index, stack
too deep), over thousands of damaged pickles of every protocol; it may leave argument parsing to the C
unpickler. ``zckpt.codecs.zipdir`` must read the same entries (names, offsets, sizes, CRC-32s) as ``zipfile``
from real ``torch.save`` archives, zip64 ones included, and refuse damaged directories with ``ZipError``.
The graph check after unpickling (``pickle_safe._check_graph``) must bound exactly the tree a naive recursive
walk would see, and refuse cycles, deep nesting and shared-reference bombs.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import random
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from zckpt.codecs import zipdir
from zckpt.codecs.pickle_safe import MAX_STACK, Size, _check_graph, safe_loads
from zckpt.codecs.pickle_scan import prescan
from zckpt.errors import CorruptCheckpoint, UnsafePickle


def _reference(data: bytes) -> None:
    """The rules, walked by ``pickletools.genops`` (the independent oracle)."""
    memo = depth = 0
    marks: list[int] = []
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                if arg > memo:
                    raise UnsafePickle("memo")
                memo = max(memo, arg + 1)
            elif op.name == "MEMOIZE":
                memo += 1
            elif op.name in ("GET", "BINGET", "LONG_BINGET") and arg >= memo:
                raise UnsafePickle("memo")
            before, after = op.stack_before, op.stack_after
            if pickletools.markobject in before:
                if not marks:
                    raise UnsafePickle("mark")
                depth = marks.pop()
                before = [x for x in before if x not in (pickletools.markobject, pickletools.stackslice)]
            depth = max(0, depth - len(before))
            if pickletools.markobject in after:
                marks.append(depth)
            depth += len([x for x in after if x is not pickletools.markobject])
            if depth + len(marks) > MAX_STACK:
                raise UnsafePickle("deep")
    except UnsafePickle:
        raise
    except Exception as e:  # noqa: BLE001
        raise CorruptCheckpoint(str(e)) from None


def _outcome(f, data: bytes) -> str:  # type: ignore[no-untyped-def]
    try:
        f(data)
    except UnsafePickle:
        return "unsafe"
    except CorruptCheckpoint:
        return "corrupt"
    return "ok"


SAMPLES = [
    {"a": [1, 2.5, None, True, "x" * 300, b"y" * 70000, (1, 2, 3)], "b": {1, 2}, "c": frozenset([3])},
    list(range(1000)),
    [[[]]] * 5,
    10**100,
    "é" * 10,
    bytearray(b"zz"),
    {"nested": {"deeper": [{"k": i} for i in range(50)]}},
]


def test_prescan_never_weaker_than_the_genops_walk() -> None:
    rng = random.Random(7)
    seen: dict[tuple[str, str], int] = {}
    for obj in SAMPLES:
        for proto in range(6):
            clean = pickle.dumps(obj, protocol=proto)
            assert _outcome(lambda d: prescan(d, "x", MAX_STACK), clean) == "ok"
            for _ in range(400):
                b = bytearray(clean)
                for _ in range(rng.randint(1, 3)):
                    b[rng.randrange(len(b))] = rng.randrange(256)
                data = bytes(b[: rng.randint(1, len(b))]) if rng.random() < 0.2 else bytes(b)
                ref = _outcome(_reference, data)
                new = _outcome(lambda d: prescan(d, "x", MAX_STACK), data)
                seen[(ref, new)] = seen.get((ref, new), 0) + 1
                assert not (ref == "unsafe" and new != "unsafe"), (proto, data[:80])
                assert not (ref == "corrupt" and new == "unsafe" and _outcome(safe_loads_x, data) == "ok")
    assert seen.get(("unsafe", "unsafe"), 0) > 100 and seen.get(("ok", "ok"), 0) > 1000, seen


def safe_loads_x(data: bytes) -> object:
    return safe_loads(data, source="x")


@pytest.mark.parametrize(
    ("data", "kind", "why"),
    [
        (b"\x80\x02]r\x00\x00\x00\x80.", "unsafe", "memo index"),  # LONG_BINPUT 2**31: a 16 GiB memo
        (b"\x80\x02Nh\x05.", "unsafe", "before writing it"),  # BINGET of an unwritten slot
        (b"\x80\x04B\xff\xff\xff\x7f.", "corrupt", "past the end"),  # BINBYTES of 2 GiB in 8 bytes
        (b"\x80\x04\x8e" + (1 << 62).to_bytes(8, "little") + b".", "corrupt", "past the end"),
        (b"\x80\x02" + b"(" * (MAX_STACK + 1) + b".", "unsafe", "deeper than"),
        (b"\x80\x02" + b"N" * (MAX_STACK + 1) + b".", "unsafe", "deeper than"),
        (b"\x80\x02N", "corrupt", "before seeing STOP"),
        (b"\x80\x02\xff.", "corrupt", "unknown"),
        (b"\x80\x02e.", "unsafe", "mark it never pushed"),
        (b"p99\nN.", "unsafe", "out of sequence"),  # text PUT (protocol 0)
        (b"cos\nsystem", "corrupt", "newline"),
    ],
)
def test_prescan_hostile_pickles(data: bytes, kind: str, why: str) -> None:
    exc = UnsafePickle if kind == "unsafe" else CorruptCheckpoint
    with pytest.raises(exc, match=why):
        prescan(data, "f.pkl", MAX_STACK)
    with pytest.raises(exc):  # and safe_loads refuses it the same way, before the unpickler runs
        safe_loads(data, source="f.pkl")


def _tree_size(o: object) -> int:
    """The oracle: the object as a tree, shared sub-objects counted at every use (leaves and empty ones 1; a
    ``Size`` (the unpickler's ``torch.Size``) is a leaf: it holds ints only)."""
    kids = [*o.keys(), *o.values()] if type(o) is dict else list(o) if type(o) in (list, tuple) else []
    return 1 + sum(_tree_size(c) for c in kids)


def _random_dag(rng: random.Random) -> object:
    made: list[object] = [rng.choice([0, 1.5, "s", b"b", None, True, Size([2, 3])])]
    for _ in range(rng.randrange(1, 40)):
        kids = [rng.choice(made) for _ in range(rng.randrange(0, 5))]  # earlier objects, shared or leaves
        kind = rng.randrange(3)
        made.append(
            kids if kind == 0 else tuple(kids) if kind == 1 else {f"k{i}": k for i, k in enumerate(kids)}
        )
    return made[-1]


def test_graph_check_bounds_the_tree_a_walk_would_see() -> None:
    """``_check_graph`` (each distinct object visited once) passes at exactly the expanded tree size that a
    naive recursive walk counts, and refuses one below it; cycles and deep nesting are refused."""
    rng = random.Random(5)
    for _ in range(300):
        obj = _random_dag(rng)
        n = _tree_size(obj)
        _check_graph(obj, "x", n)
        if n > 1 and isinstance(obj, (list, tuple, dict)) and obj:
            with pytest.raises(UnsafePickle, match="expands to more than"):
                _check_graph(obj, "x", n - 1)
    loop: list[object] = [1]
    loop.append([loop])
    with pytest.raises(UnsafePickle, match="refers to itself"):
        safe_loads(pickle.dumps(loop, protocol=2), source="x")
    deep: list[object] = []
    for _ in range(300):
        deep = [deep, 0]
    with pytest.raises(UnsafePickle, match="nests deeper"):
        safe_loads(pickle.dumps(deep, protocol=4), source="x")
    bomb: object = [0] * 16
    for _ in range(7):  # 16**8 nodes as a tree from a few hundred bytes
        bomb = [bomb] * 16
    with pytest.raises(UnsafePickle, match="expands to more than"):
        safe_loads(pickle.dumps(bomb, protocol=4), source="x")


def test_prescan_passes_what_pickle_writes() -> None:
    for obj in SAMPLES:
        for proto in range(6):
            data = pickle.dumps(obj, protocol=proto)
            prescan(data, "x", MAX_STACK)
            assert pickle.loads(data) == obj


# ---- zipdir ---------------------------------------------------------------------------------------------
def _torch_archive(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _same_as_zipfile(data: bytes) -> zipdir.Directory:
    d = zipdir.read(lambda n, at: data[at : at + n], len(data))
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        infos = zf.infolist()
        assert list(d.entries) == [i.filename for i in infos]
        for i in infos:
            e = d.entries[i.filename]
            assert (e.header_offset, e.compress_size, e.file_size, e.CRC, e.compress_type) == (
                i.header_offset, i.compress_size, i.file_size, i.CRC, i.compress_type,
            )  # fmt: skip
            start = zipdir.data_start(e, data[e.header_offset : e.header_offset + 200], len(data))
            assert data[start : start + e.file_size] == zf.read(i)
        assert d.start_dir == zf.start_dir
    return d


@pytest.mark.parametrize(
    "obj",
    [
        torch.arange(10.0),
        {"a": torch.ones(3, 4, dtype=torch.bfloat16), "b": [torch.zeros(0), 3]},
        1.5,
        "text",
    ],
)
def test_zipdir_reads_torch_archives_like_zipfile(obj: object) -> None:
    _same_as_zipfile(_torch_archive(obj))


def test_zipdir_reads_zip64_entries_and_end_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """zipfile writes zip64 extra fields and end records past its ZIP64_LIMIT; lowered, small ones too."""
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 64)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", allowZip64=True) as zf:
        for k in range(4):
            zf.writestr(f"arc/data/{k}", bytes(range(256)) * (k + 1))
        zf.writestr("arc/data.pkl", pickle.dumps([1, 2]))
    data = buf.getvalue()
    assert b"PK\x06\x06" in data and b"PK\x06\x07" in data
    monkeypatch.undo()
    d = _same_as_zipfile(data)
    assert max(e.header_offset for e in d.entries.values()) > 64


def _damaged(data: bytes, at: int, value: bytes) -> bytes:
    return data[:at] + value + data[at + len(value) :]


def test_zipdir_refuses_damaged_directories(tmp_path: Path) -> None:
    data = _torch_archive(torch.arange(100.0))
    cd = struct.unpack_from("<L", data, len(data) - 6)[0]
    n = struct.unpack_from("<H", data, len(data) - 12)[0]
    cases = {
        "no end record": data[:-22] + b"\0" * 22,
        "count": _damaged(data, len(data) - 12, struct.pack("<H", n + 1)),
        "offset": _damaged(data, len(data) - 6, struct.pack("<L", cd + 1)),
        "entry magic": _damaged(data, cd, b"PK\x09\x09"),
        "multi-disk": _damaged(data, len(data) - 18, b"\x01\x00"),
        "short": data[-21:],
    }
    for what, bad in cases.items():
        with pytest.raises(zipdir.ZipError):
            zipdir.read(lambda n, at, bad=bad: bad[at : at + n], len(bad))
        assert what


def test_zipdir_local_header_must_name_the_entry() -> None:
    data = _torch_archive(torch.arange(4.0))
    d = zipdir.read(lambda n, at: data[at : at + n], len(data))
    e = next(e for name, e in d.entries.items() if name.endswith("data/0"))
    head = bytearray(data[e.header_offset : e.header_offset + 200])
    head[30] ^= 0x20  # first letter of the name
    with pytest.raises(zipdir.ZipError, match="differs from the directory"):
        zipdir.data_start(e, bytes(head), len(data))
