"""Is a run's output the clean run's output? Byte comparison first, then a description of what differs.

Independent of zckpt: safetensors files are compared through their own headers (names, dtypes, shapes,
``__metadata__``, element-wise payload), torch zip archives record by record, JSON field by field, so the
report can say *how* an output is wrong ("emb.weight shape [13, 7] -> [0]", "manifest world_size differs").
``inspect --json`` outputs are compared on what defines the tensors (``INSPECT_FIELDS``), not on paths.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

from tests.fuzz.layout import safetensors_header

INSPECT_FIELDS = (
    "format",
    "world_size",
    "stage",
    "precision",
    "tied",
    "frozen",
    "optimizer_states",
    "dtypes",
    "params",
)
MAX_NOTES = 6


def is_debris(rel: str) -> bool:
    """A path inside a writer's hidden staging or trash folder (reported as ``leftover``, not compared)."""
    return "zckpt-tmp" in rel or "zckpt-old" in rel


def files_under(d: Path) -> dict[str, Path]:
    """{relative path: path} of the files under ``d``, staging debris excluded."""
    if d.is_file():
        return {d.name: d}
    files = (p for p in sorted(d.rglob("*")) if p.is_file() or p.is_symlink())
    return {r: p for p in files if not is_debris(r := str(p.relative_to(d)))}


def compare_trees(got: Path, want: Path) -> str | None:
    """None when ``got`` holds the same files with the same content as ``want``, else what differs."""
    a, b = files_under(got), files_under(want)
    notes: list[str] = []
    if set(a) != set(b):
        extra, missing = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        notes.append(f"files only in output: {extra[:4]}" if extra else "")
        notes.append(f"files missing: {missing[:4]}" if missing else "")
    for name in sorted(set(a) & set(b)):
        if name.endswith(".sha256"):
            continue
        note = compare_files(a[name], b[name])
        if note:
            notes.append(f"{name}: {note}")
    notes = [n for n in notes if n]
    return "; ".join(notes[:MAX_NOTES]) if notes else None


def compare_files(a: Path, b: Path) -> str | None:
    try:
        da, db = a.read_bytes(), b.read_bytes()
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if da == db:
        return None
    try:
        if a.name == ".metadata":
            return compare_dcp_metadata(da, db)
        if a.suffix == ".safetensors":
            return compare_safetensors(da, db) or "bytes differ, tensors equal"
        if a.suffix == ".json":
            return compare_json(json.loads(da), json.loads(db)) or "JSON text differs, values equal"
        if da[:4] == b"PK\x03\x04":
            return compare_zip(a, b)
    except (ValueError, KeyError, zipfile.BadZipFile) as e:
        return f"differs; unparseable ({type(e).__name__}: {e})"
    return f"bytes differ ({len(da)} vs {len(db)} bytes)"


def _tensors(data: bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    header, start = safetensors_header(data)
    meta = header.pop("__metadata__", {})
    payload = {}
    for name, info in header.items():
        lo, hi = info["data_offsets"]  # type: ignore[index]
        payload[name] = data[start + lo : start + hi]
    return {"meta": meta, "header": header}, payload


_ITEMSIZE = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}


def compare_safetensors(da: bytes, db: bytes) -> str | None:
    (ha, pa), (hb, pb) = _tensors(da), _tensors(db)
    notes = []
    if ha["meta"] != hb["meta"]:
        keys = sorted(k for k in set(ha["meta"]) | set(hb["meta"]) if ha["meta"].get(k) != hb["meta"].get(k))
        notes.append(f"__metadata__ {keys} differ")
    ta, tb = ha["header"], hb["header"]
    if set(ta) != set(tb):
        notes.append(
            f"tensors only in output {sorted(set(ta) - set(tb))[:3]}, missing {sorted(set(tb) - set(ta))[:3]}"
        )
    for name in sorted(set(ta) & set(tb)):
        ia, ib = ta[name], tb[name]
        if ia["shape"] != ib["shape"] or ia["dtype"] != ib["dtype"]:
            notes.append(f"{name} {ib['dtype']}{ib['shape']} -> {ia['dtype']}{ia['shape']}")
        elif pa[name] != pb[name]:
            notes.append(
                f"{name}: {_count_diff(pa[name], pb[name], _ITEMSIZE.get(ia['dtype'], 1))} values differ"
            )
    return "; ".join(notes[:MAX_NOTES]) or None


def _count_diff(a: bytes, b: bytes, size: int) -> str:
    n = len(b) // size
    diff = sum(a[i * size : (i + 1) * size] != b[i * size : (i + 1) * size] for i in range(n))
    return f"{diff} of {n}"


def compare_json(a: Any, b: Any, path: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if not keys:
            return None
        inner = [compare_json(a.get(k), b.get(k), f"{path}.{k}".lstrip(".")) for k in keys[:3]]
        return "; ".join(n for n in inner if n)
    if a != b:
        return f"{path or '<root>'}: {json.dumps(b, default=str)[:50]} -> {json.dumps(a, default=str)[:50]}"
    return None


def compare_zip(a: Path, b: Path) -> str | None:
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
        ra = {n.split("/", 1)[-1]: za.read(n) for n in za.namelist()}
        rb = {n.split("/", 1)[-1]: zb.read(n) for n in zb.namelist()}
    diff = sorted(k for k in set(ra) | set(rb) if ra.get(k) != rb.get(k))
    return f"zip records differ: {diff[:5]}" if diff else None


def compare_dcp_metadata(da: bytes, db: bytes) -> str | None:
    """Two DCP ``.metadata`` pickles (read inertly) equal but for ``storage_meta.save_id`` (a uuid4)."""
    from tests.fuzz import pickles

    def norm(data: bytes) -> bytes:
        md = pickles.load_opaque(data)
        sm = md.state.get("storage_meta") if isinstance(md.state, dict) else None
        if isinstance(sm, pickles.Opaque) and isinstance(sm.state, dict):
            sm.state.pop("save_id", None)
        return pickles.dump_opaque(md)

    return None if norm(da) == norm(db) else "DCP .metadata differs (save_id aside)"


def compare_inspect(got: str, want: str) -> str | None:
    """None when two ``inspect --json`` outputs describe the same tensors, else what differs."""
    try:
        a, b = json.loads(got), json.loads(want)
    except ValueError as e:
        return f"inspect --json output is not JSON ({e})"
    notes = [n for k in INSPECT_FIELDS if (n := compare_json(a.get(k), b.get(k), k))]
    ta = {t["key"]: (t["shape"], t["dtype"], t["role"], t["numel"]) for t in a.get("tensors") or []}
    tb = {t["key"]: (t["shape"], t["dtype"], t["role"], t["numel"]) for t in b.get("tensors") or []}
    if ta != tb:
        only_a, only_b = sorted(set(ta) - set(tb)), sorted(set(tb) - set(ta))
        changed = sorted(k for k in set(ta) & set(tb) if ta[k] != tb[k])
        notes.append(f"tensors: extra {only_a[:3]}, missing {only_b[:3]}, changed "
                     f"{[(k, tb[k], ta[k]) for k in changed[:2]]}")  # fmt: skip
    return "; ".join(notes[:MAX_NOTES]) or None
