"""DCP families: torch.distributed.checkpoint folders (``.metadata`` + ``__<rank>_<n>.distcp``) damaged.

The bases are the real torch saves of ``fixtures/dcp`` (FSDP2, FSDP1, HSDP, TP, 2-D, torchtitan, accelerate,
several files per rank, safetensors items, model only). Families (run them with ``--dcp`` or by name):

- ``dcp-metadata``: ``.metadata`` re-pickled through ``tests.fuzz.pickles`` (inert stand-ins, nothing
  imported): a global outside the allowlist, allowlisted-opcode bombs (3 GiB bytearray, memo 2**28, 200k
  nesting, self dict, 2**64-path DAG), huge / negative / wrong-type sizes and offsets, entries dropped or
  duplicated (``state_dict_metadata``, ``planner_data``, ``storage_data``, chunk lists), boxes that overlap,
  leave gaps or fall outside the tensor, dtype or shape disagreeing with the chunk archives, ``planner_data``
  paths misspelled or swapped, items pointed at another item, another file, outside the folder;
- ``dcp-chunks``: ``.distcp`` files truncated, grown, swapped, duplicated as another rank, missing, emptied;
  a bit flipped in an item's storage record (CRC-covered), its ``data.pkl`` or small records, a local header,
  its name, the central directory or the end record (regions of each embedded archive, found from
  ``.metadata`` and ``zipfile``); HSDP replicas disagreeing (a replicated box listed again with other sizes);
  a tied alias's bytes changed;
- ``dcp-files``: stray files (another save's rank file, a text file, a folder), a symlink to a file outside
  the folder in place of a rank file (another rank's bytes), ``.metadata`` missing, special files;
- ``dcp-paths`` / ``dcp-signals``: outputs that overlap the input (equal, inside, containing, through a
  symlink), ``reshard`` onto its input, two concurrent writers; SIGINT/SIGTERM/SIGKILL mid-write (the
  ``paths`` / ``signals`` scenarios on DCP bases).
"""

from __future__ import annotations

import io
import os
import random
import shutil
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.fuzz import layout, pickles, scenarios
from tests.fuzz.mutation import Mutation, Mutator, NotApplicable, Op, Touch, fresh_copy, new, rel

KIND = ("dcp",)
MD = ".metadata"
Edit = Callable[[dict[str, Any], random.Random], tuple[str, bool]]
"""Edits ``Metadata``'s field dict in place -> (detail, inconsistent)."""


# ---- the folder ------------------------------------------------------------------------------------------
def folders(root: Path) -> list[Path]:
    """The DCP folders of a case copy (one, or accelerate's two)."""
    return sorted(p.parent for p in (root / "ckpt").rglob(MD) if p.is_file())


def distcp_files(root: Path) -> list[Path]:
    return sorted(p for d in folders(root) for p in d.iterdir() if p.suffix == ".distcp" and p.is_file())


def load_md(folder: Path) -> Any:
    return pickles.load_opaque((folder / MD).read_bytes())


def items(folder: Path) -> list[tuple[str, Any, str, int, int]]:
    """(fqn, chunk offsets or None, file, offset, length) of every stored item, in file order."""
    out = []
    for ix, info in load_md(folder).state["storage_data"].items():
        off = ix.state.get("offset")
        offsets = tuple(off.args[0]) if isinstance(off, pickles.Opaque) and off.args else None
        s = info.state
        out.append((ix.state["fqn"], offsets, s["relative_path"], s["offset"], s["length"]))
    return sorted(out, key=lambda t: (t[2], t[3]))


def _tensors(st: dict[str, Any]) -> list[str]:
    return [k for k, v in st["state_dict_metadata"].items() if isinstance(v, pickles.Opaque) and v.state]


def _chunks(st: dict[str, Any], key: str) -> list[Any]:
    chunks: list[Any] = st["state_dict_metadata"][key].state["chunks"]
    return chunks


def _size(o: Any) -> list[int]:
    """The dims of a ``torch.Size`` stand-in."""
    return list(o.args[0])


def _mk_size(template: Any, dims: list[int]) -> Any:
    s = type(template)(tuple(dims))
    return s


def _pick_box(st: dict[str, Any], rng: random.Random, *, min_dims: int = 1) -> tuple[str, int]:
    cands = [(k, i) for k in _tensors(st) for i, c in enumerate(_chunks(st, k))
             if len(_size(c.state["sizes"])) >= min_dims and all(_size(c.state["sizes"]))]  # fmt: skip
    if not cands:
        raise LookupError("no box")
    return rng.choice(cands)


# ---- dcp-metadata ----------------------------------------------------------------------------------------
ARCHIVE_EDITS = ("size", "box-", "dtype", "shape", "item-", "duplicate-storage")
"""Edits that make ``.metadata`` disagree with a chunk file: an error may name either (``related``)."""
VALUE_EDITS = ("path-resplit",)
"""Edits no reader can tell from a real save (``value_only``): the path still spells its key."""


def _md_op(op: str, edit: Edit, *, must_refuse: bool = False) -> Mutator:
    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        folder = rng.choice(folders(root))
        md = load_md(folder)
        try:
            detail, inconsistent = edit(md.state, rng)
        except LookupError as e:
            raise NotApplicable(root, str(e)) from None
        data = pickles.dump_opaque(md)
        if "@@BOMB@@" in detail:
            detail, data = _plant(detail, data)
        (folder / MD).write_bytes(data)
        f = folder / MD
        related = (".distcp",) if any(a in op for a in ARCHIVE_EDITS) else ()
        return new("dcp-metadata", op, detail, base, root, touches=[Touch(rel(root, f), op, 0, len(data))],
                   inconsistent=inconsistent, must_refuse=must_refuse, related=related,
                   value_only=op in VALUE_EDITS)  # fmt: skip

    return mutate


def _plant(detail: str, data: bytes) -> tuple[str, bytes]:
    """Replace the placeholder string ``@@BOMB@@:<name>`` in the pickle by that bomb's opcodes."""
    name = detail.split("@@BOMB@@:")[1].split()[0]
    marker = pickles.op_str(f"@@BOMB@@:{name}")
    assert marker in data
    return detail.replace("@@BOMB@@:", "bomb "), data.replace(marker, pickles.BOMBS[name](), 1)


def _bomb(name: str) -> Edit:
    def edit(st: dict[str, Any], rng: random.Random) -> tuple[str, bool]:
        key = rng.choice(list(st["state_dict_metadata"]))
        where = rng.choice(("entry", "chunks", "path"))
        tag = f"@@BOMB@@:{name}"
        if where == "entry" or key not in _tensors(st):
            st["state_dict_metadata"][key] = tag
        elif where == "chunks":
            st["state_dict_metadata"][key].state["chunks"] = tag
        elif st.get("planner_data") is None:  # Megatron's metadata records none: plant the whole of it
            where, st["planner_data"] = "planner_data", tag
        else:
            st["planner_data"][key] = tag
        return f"{tag} as the {where} of {key!r}", True

    return edit


FOREIGN = (("os", "system"), ("builtins", "eval"), ("subprocess", "Popen"), ("torch", "load"),
           ("torch.distributed.checkpoint.metadata", "Evil"), ("pathlib", "Path.unlink"))  # fmt: skip


def _foreign_global(st: dict[str, Any], rng: random.Random) -> tuple[str, bool]:
    g = rng.choice(FOREIGN)
    cls = pickles.opaque_class(*g)
    key = rng.choice(list(st["state_dict_metadata"]))
    obj = cls("x")
    obj.newobj = False
    st["state_dict_metadata"][key] = obj
    return f"state_dict_metadata[{key!r}] := {g[0]}.{g[1]}('x')", True


def _value(kind: str, rng: random.Random, old: int) -> Any:
    return {
        "huge": lambda: rng.choice((2**40, 2**62, 2**70, 10**12)),
        "negative": lambda: rng.choice((-1, -old - 1, -(2**40))),
        "wrong-type": lambda: rng.choice(("7", None, 3.5, True, [1], b"\x01")),
        "off-by-one": lambda: old + rng.choice((-1, 1)),
    }[kind]()


def _size_edit(kind: str) -> Edit:
    """A tensor's size, a box's offsets or sizes, or an item's offset/length made ``kind``."""

    def edit(st: dict[str, Any], rng: random.Random) -> tuple[str, bool]:
        what = rng.choice(("tensor-size", "box-offset", "box-size", "item-offset", "item-length"))
        if what.startswith("item"):
            ix, info = rng.choice(list(st["storage_data"].items()))
            field = what.removeprefix("item-")
            old = info.state[field]
            info.state[field] = _value(kind, rng, old)
            return f"{ix.state['fqn']!r} item {field} {old} -> {info.state[field]!r:.40}", True
        key, i = _pick_box(st, rng)
        t = st["state_dict_metadata"][key].state
        holder, field = (t, "size") if what == "tensor-size" else (
            t["chunks"][i].state, "offsets" if what == "box-offset" else "sizes")  # fmt: skip
        dims = _size(holder[field])
        if not dims:
            raise LookupError("0-d")
        d = rng.randrange(len(dims))
        old = dims[d]
        dims[d] = _value(kind, rng, old)
        holder[field] = _mk_size(holder[field], dims)
        return f"{key!r} {what} dim {d}: {old} -> {dims[d]!r:.40}", True

    return edit


def _drop(table: str) -> Edit:
    def edit(st: dict[str, Any], rng: random.Random) -> tuple[str, bool]:
        if table == "chunk":
            key, i = _pick_box(st, rng)
            if len(_chunks(st, key)) < 2:
                raise LookupError("one chunk")
            del _chunks(st, key)[i]
            return f"chunk {i} of {key!r} dropped from its chunk list", True
        t = st[table]
        k = rng.choice(list(t))
        del t[k]
        name = k.state["fqn"] if isinstance(k, pickles.Opaque) else k
        return f"{table} entry {name!r} dropped", True

    return edit


def _duplicate(table: str) -> Edit:
    def edit(st: dict[str, Any], rng: random.Random) -> tuple[str, bool]:
        if table == "chunk":  # the same box listed twice: a replica, as HSDP's metadata may hold
            key, i = _pick_box(st, rng)
            _chunks(st, key).append(_chunks(st, key)[i])
            return f"chunk {i} of {key!r} listed twice (a replica)", False
        if table == "storage_data":  # a second entry for one chunk, pointing at another item's bytes
            sd = st[table]
            (ia, a), (ib, b) = rng.sample(list(sd.items()), 2)
            twin = type(ia)()
            twin.state = dict(ia.state)
            sd[twin] = b
            return f"storage_data entry of {ia.state['fqn']!r} listed twice, the second at " \
                   f"{b.state['relative_path']}@{b.state['offset']}", True  # fmt: skip
        t = st[table]  # a key renamed onto another key: two entries under one name, the last wins
        a, b = rng.sample(list(t), 2)
        pickles.rename_at(st, (("key", table), ("key", a)), b)
        return f"{table} key {a!r} renamed onto {b!r} (duplicate key)", True

    return edit


def _box_edit(how: str) -> Edit:
    def edit(st: dict[str, Any], rng: random.Random) -> tuple[str, bool]:
        key, i = _pick_box(st, rng)
        c = _chunks(st, key)[i].state
        t = _size(st["state_dict_metadata"][key].state["size"])
        off, size = _size(c["offsets"]), _size(c["sizes"])
        d = rng.randrange(len(size))
        if how == "overlap":  # grow into the neighbour (or start earlier)
            if off[d] > 0:
                off[d] -= 1
            else:
                size[d] += 1
        elif how == "gap":
            size[d] -= 1
        elif how == "outside":
            off[d] = t[d] - size[d] + rng.randint(1, 3)
        else:  # replica-disagree: the box listed again with other sizes
            other = dict(c)
            s2 = list(size)
            s2[d] = max(0, s2[d] + rng.choice((-1, 1)))
            rep = type(_chunks(st, key)[i])()
            rep.state = {**other, "sizes": _mk_size(c["sizes"], s2)}
            _chunks(st, key).append(rep)
            return f"{key!r} box {i} listed again with sizes {s2} (replicas disagree)", True
        c["offsets"], c["sizes"] = _mk_size(c["offsets"], off), _mk_size(c["sizes"], size)
        return f"{key!r} box {i} {how}: offsets {off} sizes {size} (tensor {t})", True

    return edit


_SAME_SIZE = {"float32": ("int32",), "int32": ("float32",), "int64": ("float64",), "float64": ("int64",),
              "bfloat16": ("float16", "int16"), "float16": ("bfloat16",)}  # fmt: skip


def _dtype_edit(st: dict[str, Any], rng: random.Random) -> tuple[str, bool]:
    key = rng.choice(_tensors(st))
    props = st["state_dict_metadata"][key].state["properties"]
    state = list(props.state)
    old = state[0].GLOBAL[1]
    new_name = rng.choice(_SAME_SIZE.get(old, ("float32",)) + ("bfloat16", "float64", "uint8"))
    if new_name == old:
        new_name = "int8"
    state[0] = pickles.opaque_class("torch", new_name)
    props.state = tuple(state)
    return f"{key!r} dtype {old} -> {new_name} (the chunk archives hold {old})", True


def _shape_edit(st: dict[str, Any], rng: random.Random) -> tuple[str, bool]:
    """Tensor and its boxes reshaped consistently (same numel), the archives keep the saved shape."""
    cands = [k for k in _tensors(st) if len(_size(st["state_dict_metadata"][k].state["size"])) == 2]
    if not cands:
        raise LookupError("no 2-d tensor")
    key = rng.choice(cands)
    t = st["state_dict_metadata"][key].state
    r, c = _size(t["size"])
    t["size"] = _mk_size(t["size"], [c, r])
    for ch in t["chunks"]:
        (o0, o1), (s0, s1) = _size(ch.state["offsets"]), _size(ch.state["sizes"])
        ch.state["offsets"], ch.state["sizes"] = _mk_size(ch.state["offsets"], [o1, o0]), _mk_size(
            ch.state["sizes"], [s1, s0])  # fmt: skip
    return f"{key!r} shape [{r}, {c}] -> [{c}, {r}], boxes transposed", True


def _path_edit(how: str) -> Edit:
    def edit(st: dict[str, Any], rng: random.Random) -> tuple[str, bool]:
        pd = st["planner_data"]
        key = rng.choice(list(pd))
        path = list(pd[key])
        if how == "flip":  # one character of one part changed (a bit flip in a name)
            i = rng.choice([j for j, p in enumerate(path) if isinstance(p, str) and p])
            s = path[i]
            at = rng.randrange(len(s))
            path[i] = s[:at] + chr(ord(s[at]) ^ (1 << rng.randrange(6))) + s[at + 1 :]
        elif how == "swap":
            other = rng.choice([k for k in pd if k != key])
            path = list(pd[other])
        elif how == "resplit":  # same characters, other nesting: spells the key, nests differently
            joined = ".".join(map(str, path))
            if "." not in joined:
                raise LookupError("no dot")
            cut = rng.choice([j for j, ch in enumerate(joined) if ch == "."])
            path = [joined[:cut], joined[cut + 1 :]]
            return f"planner_data[{key!r}] := {path} (spells the key)", False
        else:  # wrong-type
            path = rng.choice([[None], [], [1.5], [["model"]], "model"])
        pd[key] = tuple(path) if isinstance(path, list) else path
        return f"planner_data[{key!r}] := {pd[key]!r:.80}", True

    return edit


def _retarget(how: str) -> Edit:
    def edit(st: dict[str, Any], rng: random.Random) -> tuple[str, bool]:
        sd = st["storage_data"]
        ix, info = rng.choice(list(sd.items()))
        s = info.state
        if how == "other-item":  # another item's bytes (same file)
            same = [
                i for i in sd.values() if i is not info and i.state["relative_path"] == s["relative_path"]
            ]
            if not same:
                raise LookupError("alone in its file")
            o = rng.choice(same).state
            s["offset"], s["length"] = o["offset"], o["length"]
            return f"{ix.state['fqn']!r} pointed at the item at {o['offset']} of {s['relative_path']}", True
        if how == "other-file":
            files = sorted({i.state["relative_path"] for i in sd.values()} - {s["relative_path"]})
            if not files:
                raise LookupError("one file")
            old, s["relative_path"] = s["relative_path"], rng.choice(files)
            return f"{ix.state['fqn']!r} item moved from {old} to {s['relative_path']} (same offset)", True
        old, s["relative_path"] = (
            s["relative_path"],
            rng.choice(
                (
                    "../" + s["relative_path"],
                    "/etc/passwd",
                    "",
                    "sub/../../x.distcp",
                    s["relative_path"] + "\x00",
                )
            ),
        )
        return f"{ix.state['fqn']!r} relative_path {old!r} -> {s['relative_path']!r}", True

    return edit


METADATA_OPS = [
    Op("foreign-global", _md_op("foreign-global", _foreign_global, must_refuse=True), KIND),
    *[Op(f"bomb-{n}", _md_op(f"bomb-{n}", _bomb(n), must_refuse=True), KIND) for n in pickles.BOMBS],
    *[Op(f"{k}-size", _md_op(f"{k}-size", _size_edit(k)), KIND)
      for k in ("huge", "negative", "wrong-type", "off-by-one")],
    *[Op(f"drop-{t}", _md_op(f"drop-{t}", _drop(t)), KIND)
      for t in ("state_dict_metadata", "planner_data", "storage_data", "chunk")],
    *[Op(f"duplicate-{t}", _md_op(f"duplicate-{t}", _duplicate(t)), KIND)
      for t in ("state_dict_metadata", "planner_data", "storage_data", "chunk")],
    *[Op(f"box-{h}", _md_op(f"box-{h}", _box_edit(h)), KIND)
      for h in ("overlap", "gap", "outside", "replica-disagree")],
    Op("dtype-disagrees", _md_op("dtype-disagrees", _dtype_edit), KIND),
    Op("shape-disagrees", _md_op("shape-disagrees", _shape_edit), KIND),
    *[Op(f"path-{h}", _md_op(f"path-{h}", _path_edit(h)), KIND)
      for h in ("flip", "swap", "resplit", "wrong-type")],
    *[Op(f"item-{h}", _md_op(f"item-{h}", _retarget(h)), KIND)
      for h in ("other-item", "other-file", "escape")],
]  # fmt: skip


# ---- dcp-chunks ----------------------------------------------------------------------------------------
def regions(path: Path, folder: Path) -> list[layout.Region]:
    """Regions of every embedded archive of ``path`` (``layout.zip_regions`` of each item, shifted)."""
    data = path.read_bytes()
    out: list[layout.Region] = []
    seen: set[int] = set()
    for _, _, f, off, length in items(folder):
        if f != path.name or off in seen or data[off : off + 4] != b"PK\x03\x04":
            continue
        seen.add(off)
        blob = data[off : off + length]
        tmp = io.BytesIO(blob)
        try:
            with zipfile.ZipFile(tmp) as zf:
                infos, start_dir = zf.infolist(), zf.start_dir
        except zipfile.BadZipFile:
            continue
        regs = [r for i in infos for r in layout._local_regions(blob, i)] + layout._central_regions(
            blob, start_dir)  # fmt: skip
        out += [
            layout.Region(r.start + off, r.end + off, r.kind, r.name, r.checksummed, r.value) for r in regs
        ]
    return out


def _unread(r: layout.Region, data: bytearray, at: int) -> bool:
    """Bytes no zip reader uses, which no check can cover: "version made by", timestamps and attributes of
    directory entries and local headers, the header id and padding of torch's local extra field (its size is
    read: readers that walk the extra field's parts refuse one whose sizes do not add up), the zip64 end
    record's versions. A flip there changes nothing a reader sees (judged value-level)."""
    i = at - r.start
    return (
        (r.kind == "zip-dir-entry" and (4 <= i < 6 or 12 <= i < 16 or 36 <= i < 42))
        or (r.kind == "zip-local-header" and 10 <= i < 14)
        or (r.kind == "zip-local-extra" and not 2 <= i < 4)
        or (r.kind == "zip-end" and data[r.start : r.start + 4] == b"PK\x06\x06" and 12 <= i < 16)
    )


def _chunk_flip(op: str, kinds: tuple[str, ...], *, storage: bool | None = None) -> Mutator:
    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        files = distcp_files(root)
        path = rng.choice(files)
        regs = [r for r in regions(path, path.parent) if r.kind in kinds and r.size > 0]
        if storage is not None:
            regs = [r for r in regs if r.value == storage]
        if not regs:
            raise NotApplicable(root, f"no {kinds} region in {path.name}")
        r = rng.choice(regs)
        data = bytearray(path.read_bytes())
        at = rng.randrange(r.start, r.end)
        bit = rng.randrange(8)
        free = _unread(r, data, at)
        data[at] ^= 1 << bit
        path.write_bytes(bytes(data))
        return new("dcp-chunks", op, f"flip bit {bit} of byte {at} of {path.name} ({r.kind} {r.name})", base,
                   root, touches=[Touch(rel(root, path), f"{r.kind} {r.name}", at, 1, r.checksummed)],
                   inconsistent=not r.checksummed and not free, value_only=free, related=(MD,))  # fmt: skip

    return mutate


def _file_op(op: str) -> Mutator:
    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        files = distcp_files(root)
        a = rng.choice(files)
        size = a.stat().st_size
        touches = [Touch(rel(root, a), op)]
        if op == "truncate":
            at = rng.randrange(0, size)
            os.truncate(a, at)
            detail = f"{a.name} cut to {at} of {size} bytes"
        elif op == "grow":
            extra = rng.choice((b"\x00" * rng.randint(1, 4096), rng.randbytes(rng.randint(1, 4096))))
            with open(a, "ab") as f:
                f.write(extra)
            detail = f"{len(extra)} bytes appended to {a.name}"
            touches = [Touch(rel(root, a), op, size, len(extra))]
            m = new("dcp-chunks", op, detail, base, root, touches=touches, related=(MD,))
            m.inconsistent = True  # DCP writes items back to back to EOF: trailing bytes are not its output
            return m
        elif op == "missing":
            a.unlink()
            detail = f"{a.name} deleted"
        elif op == "empty":
            a.write_bytes(b"")
            detail = f"{a.name} emptied"
        elif op in ("swap", "duplicate"):
            others = [p for p in files if p != a and p.parent == a.parent]
            if not others:
                raise NotApplicable(root, "one file")
            b = rng.choice(others)
            touches.append(Touch(rel(root, b), op))
            if op == "swap":
                tmp = a.with_name(a.name + ".swap")
                os.rename(a, tmp)
                os.rename(b, a)
                os.rename(tmp, b)
                detail = f"{a.name} <-> {b.name}"
            else:
                shutil.copy(b, a)
                detail = f"{a.name} replaced by a copy of {b.name}"
        else:
            raise AssertionError(op)
        return new("dcp-chunks", op, detail, base, root, touches=touches, inconsistent=True, related=(MD,))

    return mutate


def _tied_alias(case_dir: Path, rng: random.Random) -> Mutation:
    """A tied alias's (``head.weight``) stored bytes changed in one chunk, its CRC recomputed: the pair no
    longer holds the same values (a saver writes both names from one tensor)."""
    base, root = fresh_copy(case_dir)
    for folder in folders(root):
        its = [
            it for it in items(folder) if it[0].split(".")[-2:] == ["head", "weight"] and it[1] is not None
        ]
        data = [it for it in its if (folder / it[2]).read_bytes()[it[3] : it[3] + 4] == b"PK\x03\x04"]
        if data:
            _, offs, f, off, length = rng.choice(data)
            path = folder / f
            blob = bytearray(path.read_bytes())
            arc = bytearray(blob[off : off + length])
            with zipfile.ZipFile(io.BytesIO(bytes(arc))) as zf:
                info = next(i for i in zf.infolist() if "/data/" in i.filename)
            regs = [r for r in layout._local_regions(bytes(arc), info) if r.kind == "zip-record"]
            if not regs or regs[0].size == 0:
                break
            r = regs[0]
            at = rng.randrange(r.start, r.end)
            arc[at] ^= 0x40
            crc = zlib.crc32(bytes(arc[r.start : r.end]))
            k = info.header_offset + 14  # the local header's CRC field
            arc[k : k + 4] = crc.to_bytes(4, "little")
            _fix_central_crc(arc, info.filename, crc)
            blob[off : off + length] = arc
            path.write_bytes(bytes(blob))
            # DCP records no ties: a pair whose bytes differ is two tensors (an untied head), as valid a save
            return new("dcp-chunks", "tied-alias-differs", f"{f}@{off + at}: head.weight chunk {list(offs)} "
                       "changed, CRCs recomputed", base, root,
                       touches=[Touch(rel(root, path), "tied alias", off + at, 1)], value_only=True,
                       related=(MD,))  # fmt: skip
    raise NotApplicable(root, "no stored head.weight chunk")


def _fix_central_crc(arc: bytearray, name: str, crc: int) -> None:
    at = 0
    raw = bytes(arc)
    while True:
        at = raw.find(b"PK\x01\x02", at)
        if at < 0:
            return
        n = int.from_bytes(raw[at + 28 : at + 30], "little")
        if raw[at + 46 : at + 46 + n].decode("utf-8", "replace") == name:
            arc[at + 16 : at + 20] = crc.to_bytes(4, "little")
            return
        at += 4


CHUNK_OPS = [
    Op("storage-flip", _chunk_flip("storage-flip", ("zip-record",), storage=True), KIND),
    Op("record-flip", _chunk_flip("record-flip", ("zip-record",), storage=False), KIND),
    Op("local-header-flip", _chunk_flip("local-header-flip", ("zip-local-header",)), KIND),
    Op("local-name-flip", _chunk_flip("local-name-flip", ("zip-local-name", "zip-local-extra")), KIND),
    Op("directory-flip", _chunk_flip("directory-flip", ("zip-dir-entry", "zip-dir-name")), KIND),
    Op("end-record-flip", _chunk_flip("end-record-flip", ("zip-end",)), KIND),
    *[Op(op, _file_op(op), KIND) for op in ("truncate", "grow", "missing", "empty", "swap", "duplicate")],
    Op("tied-alias-differs", _tied_alias, KIND),
]


# ---- dcp-files -----------------------------------------------------------------------------------------
def _files_op(op: str) -> Mutator:
    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        folder = rng.choice(folders(root))
        files = [p for p in distcp_files(root) if p.parent == folder]
        inconsistent, value_only = True, False
        if op == "stray-rank-file":
            src = rng.choice(files)
            t = folder / "__97_0.distcp"
            shutil.copy(src, t)
            detail = f"copy of {src.name} added as {t.name}"
        elif op == "stray-text":
            t = folder / rng.choice(("notes.txt", "__0_0.distcp.bak", "README"))
            t.write_text("stray\n")
            detail = f"{t.name} added"
        elif op == "stray-folder":
            t = folder / "extra"
            t.mkdir()
            (t / "x.distcp").write_bytes(b"x")
            detail, inconsistent = "a folder 'extra' added (not a file of the save)", False
        elif op == "symlink-outside":
            a = rng.choice(files)
            others = [p for p in files if p != a]
            src = rng.choice(others) if others else a
            outside = root / "elsewhere" / a.name
            outside.parent.mkdir()
            shutil.copy(src, outside)
            same_size = src.stat().st_size == a.stat().st_size
            a.unlink()
            a.symlink_to(outside)
            t = a
            # a copy of another file of the same size can hold archives laid out as the replaced ones, of
            # the same shapes and dtypes: every check holds, the values are another tensor's (seed 38 case
            # 161; torch's serialization id is derived from the records' names and CRC-32s, so equal tensors
            # share it and it cannot tell a copy either). Otherwise the items no longer fit their file.
            inconsistent = src != a and not same_size
            value_only = src != a and same_size
            detail = f"{a.name} -> symlink to a copy of {src.name} outside the folder"
        elif op == "metadata-missing":
            t = folder / MD
            t.unlink()
            detail = f"{rel(root, t)} deleted"
        elif op in ("metadata-fifo", "distcp-fifo", "distcp-dev-zero", "distcp-folder"):
            t = folder / MD if op.startswith("metadata") else rng.choice(files)
            t.unlink()
            if op.endswith("fifo"):
                os.mkfifo(t)
            elif op.endswith("dev-zero"):
                t.symlink_to("/dev/zero")
            else:
                t.mkdir()
            detail = f"{op.split('-', 1)[1]} in place of {rel(root, t)}"
        else:
            raise AssertionError(op)
        return new("dcp-files", op, detail, base, root, touches=[Touch(rel(root, t), op)],
                   inconsistent=inconsistent, value_only=value_only, related=(MD,))  # fmt: skip

    return mutate


FILES_OPS = [
    Op(op, _files_op(op), KIND)
    for op in ("stray-rank-file", "stray-text", "stray-folder", "symlink-outside", "metadata-missing",
               "metadata-fifo", "distcp-fifo", "distcp-dev-zero", "distcp-folder")
]  # fmt: skip


# ---- dcp-paths / dcp-signals: the invocation scenarios on DCP bases ------------------------------------
def _renamed(family: str, fn: Mutator) -> Mutator:
    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        m = fn(case_dir, rng)
        m.family = family
        return m

    return mutate


_RESHARD_SELF = ["reshard", "{in}", "{in}", "--world", "2", "--overwrite", scenarios.NO_PROGRESS]
_RESHARD_INSIDE = ["reshard", "{in}", "{in}/sub", "--world", "2", scenarios.NO_PROGRESS]


def _scenario_ops() -> dict[str, list[Op]]:
    kinds = {o.name: o for fam in scenarios.FAMILIES.values() for o in fam}
    paths = [
        Op(n, _renamed("dcp-paths", kinds[n].fn), KIND)
        for n in (
            "out-equals-input",
            "out-inside-input",
            "out-contains-input",
            "out-symlink-into-input",
            "concurrent-consolidates",
            "overwrite-fewer-shards",
            "overwrite-sharded-with-one-file",
        )
    ]
    paths += [
        Op(
            "reshard-onto-input",
            _renamed("dcp-paths", scenarios._plain("reshard-onto-input", _RESHARD_SELF, must_refuse=True)),
            KIND,
        ),
        Op(
            "reshard-inside-input",
            _renamed(
                "dcp-paths", scenarios._plain("reshard-inside-input", _RESHARD_INSIDE, must_refuse=True)
            ),
            KIND,
        ),
    ]
    signals = [Op(o.name, _renamed("dcp-signals", o.fn), KIND) for o in scenarios.FAMILIES["signals"]]
    return {"dcp-paths": paths, "dcp-signals": signals}  # fmt: skip


FAMILIES: dict[str, list[Op]] = {
    "dcp-metadata": METADATA_OPS,
    "dcp-chunks": CHUNK_OPS,
    "dcp-files": FILES_OPS,
    **_scenario_ops(),
}
