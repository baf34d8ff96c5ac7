"""Structural mutations that keep each file parseable, so the damage reaches the readers' logic.

- ``ds-pickle``: a DeepSpeed model/optim pickle re-pickled (``tests.fuzz.pickles``, valid CRCs) with a key
  removed or renamed, a value replaced by a wrong type / huge int / negative / NaN, two tensors swapped,
  a tensor view running past its storage, or ``partition_count`` made absurd;
- ``pickle-bomb``: crafted pickles of allowlisted opcodes planted in a ``.pt`` / ``.bin`` (3 GiB bytearray,
  memo index 2**28, 200k-deep nesting, a self-referencing dict, a 2**64-path shared-dict chain,
  ``torch.device("bogus")``, a tensor claiming 2**40 elements);
- ``manifest``: every native ``manifest.json`` field made the wrong type, null, negative, huge or missing;
  unknown versions; tensor entries dropped, renamed, duplicated or disagreeing with the rank files' headers
  (shape, dtype, partitioned, role, world); ``files`` and ``tied`` tables damaged;
- ``st-header``: safetensors headers: JSON ``true`` in a shape, offsets outside the file or overlapping,
  unknown or reinterpreting dtypes, extra/missing fields, duplicate names, ``__metadata__`` self-ties,
  aliases shadowing a real tensor, ties to nothing, unknown roles;
- ``hf-index``: ``*.index.json`` entries dropped, moved, pointing outside the folder or at missing shards,
  wrong types, a missing index, a stale extra shard.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.fuzz import layout, pickles
from tests.fuzz.corpus import Base
from tests.fuzz.mutation import (
    Mutation,
    Mutator,
    NotApplicable,
    Op,
    Touch,
    covered,
    fresh_copy,
    new,
    rel,
    tag_dir,
    tensor_files,
)
from zckpt.formats.native.layout import VERSION as NATIVE_VERSION  # the newest version a reader knows

# Keys whose damage (anywhere below them) changes which tensors a DeepSpeed checkpoint holds, or where
# their bytes are; CONTAINERS matter only as a whole (their other contents are hyperparameters, counters).
LAYOUT_KEYS = frozenset((
    "module", "buffer_names", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "dp_world_size", "mp_world_size", "partition_count", "fp32_flat_groups",
    "single_partition_of_fp32_groups", "zero_stage", "group_paddings", "param_slice_mappings",
    "param_alignment_paddings", "exp_avg", "exp_avg_sq",
))  # fmt: skip
CONTAINERS = frozenset(("optimizer", "optimizer_state_dict", "base_optimizer_state", "state"))
OTHER_KEYS = frozenset((
    "global_steps", "global_samples", "ds_config", "ds_version", "lr_scheduler", "loss_scaler",
    "param_groups", "skipped_steps", "dynamic_loss_scale", "clip_grad", "step",
))  # fmt: skip


def _value(kind: str, rng: random.Random) -> Any:
    choices: dict[str, list[Any]] = {
        "wrong-type": ["oops", None, [], {}, 3.5, True, ("a", 1), b"\x00bytes"],
        "huge-int": [2**70, 10**12, 2**63, 2**31],
        "negative": [-1, -7, -(2**40)],
        "nan": [float("nan"), float("inf"), -float("inf")],
    }
    return rng.choice(choices[kind])


# ---- ds-pickle -----------------------------------------------------------------------------------------
def _zip_files(base: Base, root: Path, contains: str = "") -> list[Path]:
    return [p for p in tensor_files(base, root) if layout.is_zip(p) and contains in p.name]


def _keys_on(path: pickles.NodePath) -> set[Any]:
    return {k for kind, k in path if kind in ("key", "state")}


def _layout(path: pickles.NodePath, old: Any) -> bool:
    """Whether damaging the node at ``path`` (holding ``old``) changes the checkpoint's tensors or layout."""
    keys = [k for kind, k in path if kind in ("key", "state") and isinstance(k, str)]
    if pickles.is_tensor(old) or (keys and keys[-1] in CONTAINERS):
        return True
    group_params = any(a == "param_groups" and b == "params" for a, b in zip(keys, keys[1:], strict=False))
    return group_params or any(k in LAYOUT_KEYS for k in keys)  # (a scheduler's "params" is not layout)


def _pick_node(
    obj: Any, rng: random.Random, want: Callable[[pickles.NodePath, Any], bool]
) -> pickles.NodePath:
    nodes = [(p, v) for p, v in pickles.walk(obj, 7) if want(p, v)]
    if not nodes:
        raise LookupError("no node fits")
    hot = [n for n in nodes if _keys_on(n[0]) & (LAYOUT_KEYS | CONTAINERS | OTHER_KEYS)]
    return rng.choice(hot if hot and rng.random() < 0.8 else nodes)[0]


def _is_dict_key(path: pickles.NodePath, v: Any) -> bool:
    return path[-1][0] in ("key", "state")


def _not_inside_tensor(path: pickles.NodePath, v: Any) -> bool:
    return True


def _edit_pickle(op: str, edit: Callable[[Any, random.Random], tuple[Any, str, bool]],
                 contains: str = "") -> Mutator:  # fmt: skip
    """Load a DeepSpeed file's pickle opaquely, ``edit`` it -> (obj, detail, layout?), write it back."""

    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        files = _zip_files(base, root, contains)
        if not files:
            raise NotApplicable(root, f"no {contains or 'zip'} file")
        path = rng.choice(files)
        obj = pickles.load_opaque(pickles.read_pickle(path))
        try:
            obj, detail, is_layout = edit(obj, rng)
        except LookupError as e:
            raise NotApplicable(root, str(e)) from None
        pickles.rewrite_records(path, {"data.pkl": pickles.dump_opaque(obj)})
        return new("ds-pickle", op, f"{path.name}: {detail}", base, root,
                   touches=[Touch(rel(root, path), f"data.pkl {detail[:80]}")],
                   inconsistent=is_layout, value_only=not is_layout)  # fmt: skip

    return mutate


def _named_once(obj: Any, path: pickles.NodePath) -> bool:
    """A ``module`` entry of a checkpoint that records no ``param_shapes`` (ZeRO-0): its name is written
    nowhere else, so a renamed entry is a valid checkpoint of another model (DeepSpeed's own
    ``load_checkpoint`` finds out only against the live model's keys), not an inconsistent one."""
    first = path[0][1] if path and path[0][0] == "key" else None
    return first == "module" and len(path) == 2 and isinstance(obj, dict) and obj.get("param_shapes") is None


def _remove(obj: Any, rng: random.Random) -> tuple[Any, str, bool]:
    path = _pick_node(obj, rng, _is_dict_key)
    is_layout = _layout(path, pickles.get_at(obj, path))
    return pickles.delete_at(obj, path), f"remove {pickles.describe(path)}", is_layout


def _rename(obj: Any, rng: random.Random) -> tuple[Any, str, bool]:
    path = _pick_node(obj, rng, lambda p, v: p[-1][0] == "key" and isinstance(p[-1][1], str))
    new_key = path[-1][1] + "_renamed"
    detail = f"rename {pickles.describe(path)} -> {new_key}"
    is_layout = _layout(path, pickles.get_at(obj, path)) and not _named_once(obj, path)
    return pickles.rename_at(obj, path, new_key), detail, is_layout


def _replace(kind: str) -> Callable[[Any, random.Random], tuple[Any, str, bool]]:
    def edit(obj: Any, rng: random.Random) -> tuple[Any, str, bool]:
        path = _pick_node(obj, rng, _not_inside_tensor)
        old, value = pickles.get_at(obj, path), _value(kind, rng)
        detail = f"{pickles.describe(path)}: {_short(old)} -> {value!r:.40}"
        return pickles.set_at(obj, path, value), detail, _layout(path, old)

    return edit


def _short(v: Any) -> str:
    return "<tensor>" if pickles.is_tensor(v) else f"{v!r:.40}"


def _swap_tensors(obj: Any, rng: random.Random) -> tuple[Any, str, bool]:
    tensors = [p for p, v in pickles.walk(obj, 8) if pickles.is_tensor(v)]
    if len(tensors) < 2:
        raise LookupError("fewer than two tensors")
    a, b = rng.sample(tensors, 2)
    ta, tb = pickles.get_at(obj, a), pickles.get_at(obj, b)
    same = _signature(ta) == _signature(tb)  # same dtype and shape: a consistent file with other values
    obj = pickles.set_at(pickles.set_at(obj, a, tb), b, ta)
    kind = "same shape and dtype" if same else "different shape or dtype"
    return obj, f"swap tensors {pickles.describe(a)} <-> {pickles.describe(b)} ({kind})", not same


def _signature(t: Any) -> tuple[Any, ...]:
    args = pickles.rebuild_args(t)
    storage = args[0].pid[1] if isinstance(args[0], pickles.Persistent) and len(args[0].pid) > 1 else None
    return (getattr(storage, "GLOBAL", storage), tuple(args[2]))


def _tensor_view(obj: Any, rng: random.Random) -> tuple[Any, str, bool]:
    """A tensor whose view (offset, size, stride) or storage length no longer fits its storage."""
    tensors = [p for p, v in pickles.walk(obj, 8) if pickles.is_tensor(v)]
    if not tensors:
        raise LookupError("no tensor")
    path = rng.choice(tensors)
    args = pickles.rebuild_args(pickles.get_at(obj, path))
    storage, offset, size = args[0], args[1], tuple(args[2])
    how = rng.choice(("offset", "size", "stride", "storage-numel"))
    if how == "offset":
        args[1] = offset + rng.choice((1, 7, 64, 10**6))
    elif how == "size":
        args[2] = tuple(d * rng.choice((2, 3)) + 1 for d in size) if size else (2,)
        args[3] = _contiguous_stride(args[2])
    elif how == "stride":
        args[3] = tuple(rng.choice((0, -1, 2, 10**6)) for _ in size)
    elif isinstance(storage, pickles.Persistent) and len(storage.pid) >= 5:
        storage.pid[4] = rng.choice((0, storage.pid[4] * 4 + 1, 2**40))
    # a tensor of no elements (a ZeRO-3 param placeholder) reads as the same empty tensor whatever its
    # offset and (non-negative) strides: torch.load gives the same value, nothing disagrees
    unseen = how in ("offset", "stride") and math.prod(size) == 0 and min(args[3], default=0) >= 0
    return obj, f"tensor {pickles.describe(path)}: {how} changed", not unseen


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _partition_count(obj: Any, rng: random.Random) -> tuple[Any, str, bool]:
    osd = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
    if not isinstance(osd, dict) or "partition_count" not in osd:
        raise LookupError("no partition_count")
    old = osd["partition_count"]
    value: Any = rng.choice((2**70, 10**12, -2, 0, "2", None, [2**70], 3, 1))
    if isinstance(old, list) and not isinstance(value, list) and rng.random() < 0.5:
        value = [value] * len(old)
    osd["partition_count"] = value
    return obj, f"optimizer_state_dict.partition_count: {old!r} -> {value!r}", True


DS_PICKLE = [
    Op("remove-key", _edit_pickle("remove-key", _remove), ("deepspeed",)),
    Op("rename-key", _edit_pickle("rename-key", _rename), ("deepspeed",)),
    Op("wrong-type", _edit_pickle("wrong-type", _replace("wrong-type")), ("deepspeed",)),
    Op("huge-int", _edit_pickle("huge-int", _replace("huge-int")), ("deepspeed",)),
    Op("negative", _edit_pickle("negative", _replace("negative")), ("deepspeed",)),
    Op("nan", _edit_pickle("nan", _replace("nan")), ("deepspeed",)),
    Op("swap-tensors", _edit_pickle("swap-tensors", _swap_tensors), ("deepspeed",)),
    Op("tensor-view", _edit_pickle("tensor-view", _tensor_view), ("deepspeed", "bin", "hf-bin")),
    Op("partition-count", _edit_pickle("partition-count", _partition_count, "optim_states"), ("deepspeed",)),
]


# ---- pickle-bomb ---------------------------------------------------------------------------------------
def _bomb(name: str) -> Mutator:
    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        path = rng.choice(_zip_files(base, root))
        raw = pickles.read_pickle(path)
        top = pickles.load_opaque(raw)
        keys = [k for k in top if isinstance(k, str)] if isinstance(top, dict) else []
        hot = [k for k in keys if k in LAYOUT_KEYS | CONTAINERS | OTHER_KEYS or base.kind != "deepspeed"]
        key = rng.choice(hot) if hot and rng.random() < 0.5 else "fuzz_client_value"
        planted = pickles.with_item(raw, key, pickles.BOMBS[name]())
        pickles.rewrite_records(path, {"data.pkl": planted})
        # a .bin entry replaced by a non-tensor is another (odd) state dict, not broken layout
        is_layout = base.kind == "deepspeed" and key in LAYOUT_KEYS | CONTAINERS
        return new("pickle-bomb", name, f"{path.name}: [{key!r}] := {name}", base, root,
                   touches=[Touch(rel(root, path), f"data.pkl [{key!r}]")], inconsistent=is_layout,
                   value_only=not is_layout)  # fmt: skip

    return mutate


def _tensor_claim(case_dir: Path, rng: random.Random) -> Mutation:
    """A tensor whose storage claims 2**40 elements and whose shape matches the claim."""
    base, root = fresh_copy(case_dir)
    path = rng.choice(_zip_files(base, root))
    obj = pickles.load_opaque(pickles.read_pickle(path))
    tensors = [p for p, v in pickles.walk(obj, 8) if pickles.is_tensor(v)]
    tp = rng.choice(tensors)
    args = pickles.rebuild_args(pickles.get_at(obj, tp))
    if isinstance(args[0], pickles.Persistent) and len(args[0].pid) >= 5:
        args[0].pid[4] = 2**40
    args[2], args[3] = (2**20, 2**20), (2**20, 1)
    pickles.rewrite_records(path, {"data.pkl": pickles.dump_opaque(obj)})
    return new("pickle-bomb", "tensor-claim-2^40", f"{path.name}: {pickles.describe(tp)} claims 2**40 "
               "elements", base, root, touches=[Touch(rel(root, path), "data.pkl tensor")],
               inconsistent=True)  # fmt: skip


ZIP_KINDS = ("deepspeed", "bin", "hf-bin")
PICKLE_BOMB = [Op(name, _bomb(name), ZIP_KINDS) for name in pickles.BOMBS] + [
    Op("tensor-claim-2^40", _tensor_claim, ZIP_KINDS)
]


# ---- manifest ------------------------------------------------------------------------------------------
MANIFEST_CORE = frozenset(("format", "version", "world_size", "partition_world", "tensors", "optim_states",
                           "tied", "files"))  # fmt: skip


def _json_paths(obj: Any, path: tuple[Any, ...] = (), depth: int = 4) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    if depth == 0:
        return out
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for k, v in items:
        out.append((*path, k))
        if isinstance(v, (dict, list)) and (len(path) < 1 or k in (0, 1) or not isinstance(k, int)):
            out += _json_paths(v, (*path, k), depth - 1)
    return out


def _json_get(obj: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def _manifest_edit(op: str, edit: Callable[[dict[str, Any], random.Random, Base, Path], str]) -> Mutator:
    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        path = tag_dir(base, root) / "manifest.json"
        man = json.loads(path.read_text())
        try:
            detail = edit(man, rng, base, path.parent)
        except LookupError as e:
            raise NotApplicable(root, str(e)) from None
        path.write_text(json.dumps(man, indent=1))
        core = re.match(r"[a-z_]*", detail).group(0) in MANIFEST_CORE  # type: ignore[union-attr]
        ranks = (*(p.name for p in sorted(path.parent.glob("rank_*.safetensors"))), "rank_0")
        return new("manifest", op, f"manifest.json {detail}", base, root,
                   touches=[Touch(rel(root, path), f"manifest {detail[:80]}")], related=ranks,
                   inconsistent=core, value_only=not core)  # fmt: skip

    return mutate


def _field(kind: str) -> Callable[[dict[str, Any], random.Random, Base, Path], str]:
    def edit(man: dict[str, Any], rng: random.Random, base: Base, td: Path) -> str:
        value = None if kind == "null" else _value(kind, rng)
        if isinstance(value, (bytes, tuple)):
            value = str(value)
        # a field that already holds the value is no edit (seed 321/136: null -> null, counted as damage)
        paths = [p for p in _json_paths(man) if kind == "missing" or _json_get(man, p) != value]
        hot = [p for p in paths if p[0] in MANIFEST_CORE]
        path = rng.choice(hot if hot and rng.random() < 0.7 else paths)
        parent, key = _json_get(man, path[:-1]), path[-1]
        where = ".".join(map(str, path))
        if kind == "missing":
            del parent[key]
            return f"{where} removed"
        old, parent[key] = parent[key], value
        return f"{where}: {json.dumps(old)[:40]} -> {json.dumps(value)}"

    return edit


def _set(key: str, values: tuple[Any, ...]) -> Callable[[dict[str, Any], random.Random, Base, Path], str]:
    def edit(man: dict[str, Any], rng: random.Random, base: Base, td: Path) -> str:
        old, man[key] = man.get(key), rng.choice(values)
        return f"{key}: {old!r} -> {man[key]!r}"

    return edit


def _world_mismatch(man: dict[str, Any], rng: random.Random, base: Base, td: Path) -> str:
    key = rng.choice(("world_size", "partition_world"))
    old = man[key]
    man[key] = max(1, old + rng.choice((-1, 1)))
    if man[key] == old:
        man[key] = old + 1
    return f"{key}: {old} -> {man[key]}"


def _entry(man: dict[str, Any], rng: random.Random, table: str) -> dict[str, Any]:
    entries = [e for e in man.get(table, []) if isinstance(e, dict)]
    if not entries:
        raise LookupError(f"no {table}")
    return rng.choice(entries)


def _tensor_edit(table: str, how: str) -> Callable[[dict[str, Any], random.Random, Base, Path], str]:
    def edit(man: dict[str, Any], rng: random.Random, base: Base, td: Path) -> str:
        e = _entry(man, rng, table)
        name = f"{table}[{e.get('name') or e.get('param')}{'/' + e['state'] if 'state' in e else ''}]"
        if how == "drop":
            man[table].remove(e)
            return f"{name} dropped"
        if how == "rename":
            key = "name" if "name" in e else "param"
            e[key] += "_renamed"
            return f"{name} renamed"
        if how == "duplicate":
            man[table].append(dict(e))
            return f"{name} listed twice"
        if how == "shape":
            old = list(e["shape"])
            e["shape"] = rng.choice((old[:-1], [*old, 1], [d + 1 for d in old] or [2], [math.prod(old)],
                                     [True, *old], [-1, *old], [2**62, *old]))  # fmt: skip
            return f"{name}.shape: {old} -> {e['shape']}"
        if how == "dtype":
            old = e["dtype"]
            dtypes = ("float16", "bfloat16", "int32", "int8", "float128", "F32", "")
            e["dtype"] = rng.choice([d for d in dtypes if d != old])  # the value it had is no mutation
            return f"{name}.dtype: {old} -> {e['dtype']}"
        if how == "partitioned":
            e["partitioned"] = rng.choice((not e.get("partitioned"), "yes", None, 1))
            return f"{name}.partitioned -> {e['partitioned']!r}"
        roles = ("buffer", "frozen", "optim", "bogus", None, 3)
        e["role"] = rng.choice([r for r in roles if r != e.get("role")])
        return f"{name}.role -> {e['role']!r}"

    return edit


def _files_edit(how: str) -> Callable[[dict[str, Any], random.Random, Base, Path], str]:
    def edit(man: dict[str, Any], rng: random.Random, base: Base, td: Path) -> str:
        name = rng.choice(sorted(man["files"]))
        rec = man["files"][name]
        if how == "drop":
            del man["files"][name]
            return f"files[{name}] dropped"
        if how == "bytes":
            rec["bytes"] = rng.choice((rec["bytes"] + 1, rec["bytes"] - 8, -1, 2**63, "10", None))
            return f"files[{name}].bytes -> {rec['bytes']!r}"
        if "sha256" in rec:  # a version-1 manifest: one whole-file digest
            rec["sha256"] = rng.choice(("0" * 64, rec["sha256"][::-1], "not-hex", None, 7))
            return f"files[{name}].sha256 -> {rec['sha256']!r:.20}"
        blocks = rec["sha256_blocks"]
        i = rng.randrange(len(blocks["sha256"]))
        what = rng.choice(("digest", "count", "block", "both"))
        if what == "digest":
            blocks["sha256"][i] = rng.choice(("0" * 64, blocks["sha256"][i][::-1], "not-hex", None, 7))
            return f"files[{name}].sha256_blocks[{i}] -> {blocks['sha256'][i]!r:.20}"
        if what == "count":
            blocks["sha256"] = blocks["sha256"] + ["0" * 64] if rng.random() < 0.5 else blocks["sha256"][1:]
            return f"files[{name}].sha256_blocks: {len(blocks['sha256'])} digests"
        if what == "block":
            # another block size describes the same bytes when the file fits in one block either way (then the
            # one digest is the whole file's): pick sizes that change which bytes a digest covers
            size = rec["bytes"] if isinstance(rec.get("bytes"), int) else 0
            smaller = 4096 if size > 8192 else 2048  # 2048: below the smallest block the reader accepts
            while smaller * 4 < size:
                smaller *= 2
            bigger = blocks["block"] * 2 if len(blocks["sha256"]) > 1 else smaller
            blocks["block"] = rng.choice((smaller, bigger, 0, -1, "64", None))
            return f"files[{name}].sha256_blocks.block -> {blocks['block']!r}"
        rec["sha256"] = "0" * 64
        return f"files[{name}]: both sha256 and sha256_blocks"

    return edit


def _tied_edit(how: str) -> Callable[[dict[str, Any], random.Random, Base, Path], str]:
    def edit(man: dict[str, Any], rng: random.Random, base: Base, td: Path) -> str:
        names = [e["name"] for e in man.get("tensors", []) if e.get("role") == "param"]
        a, b = rng.sample(names, 2)
        pair = {"self": (a, a), "missing": ("ghost.weight", "nowhere.weight"), "shadow": (b, a)}[how]
        man["tied"] = {**(man.get("tied") or {}), pair[0]: pair[1]}
        return f"tied[{pair[0]}] -> {pair[1]} ({how})"

    return edit


def _manifest_ops() -> list[Op]:
    edits: dict[str, Callable[[dict[str, Any], random.Random, Base, Path], str]] = {
        **{f"field-{k}": _field(k) for k in ("wrong-type", "missing", "negative", "huge-int", "null")},
        "version-unknown": _set("version", (NATIVE_VERSION + 1, 99, "1", 1.5, -1, None, True)),
        "format-other": _set("format", ("zckpt-native2", "", None, 1)),
        "world-size-huge": _set("world_size", (10**12, 2**62, 10**12 + 0.5)),
        "world-mismatch": _world_mismatch,
        **{f"tensor-{h}": _tensor_edit("tensors", h)
           for h in ("drop", "rename", "duplicate", "shape", "dtype", "partitioned", "role")},
        **{f"optim-{h}": _tensor_edit("optim_states", h) for h in ("drop", "shape", "dtype", "partitioned")},
        **{f"files-{h}": _files_edit(h) for h in ("drop", "bytes", "sha256")},
        **{f"tied-{h}": _tied_edit(h) for h in ("self", "missing", "shadow")},
    }  # fmt: skip
    return [Op(name, _manifest_edit(name, fn), ("native",)) for name, fn in edits.items()]


# ---- st-header -----------------------------------------------------------------------------------------
HeaderEdit = Callable[[dict[str, Any], random.Random, bytes], str]
"""Edits a header in place, given the file's data section; returns what it did."""


def _st_edit(op: str, edit: HeaderEdit, *, self_consistent: bool = False,
             raw: Callable[[dict[str, Any], random.Random], bytes] | None = None) -> Mutator:  # fmt: skip
    """Rewrite one safetensors file's header (data section unchanged). ``self_consistent``: the result is
    a valid file with another meaning (undetectable without a checksum or a manifest)."""

    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        files = [p for p in tensor_files(base, root) if p.suffix == ".safetensors"]
        if not files:
            raise NotApplicable(root, "no safetensors file")
        path = rng.choice(files)
        data = path.read_bytes()
        header, start = layout.safetensors_header(data)
        payload = data[start:]
        try:
            detail = edit(header, rng, payload)
        except LookupError as e:
            raise NotApplicable(root, str(e)) from None
        text = raw(header, rng) if raw is not None else json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(len(text).to_bytes(8, "little") + text + payload)
        checked = covered(base, path)
        consistent = self_consistent and not checked and base.kind != "native"
        return new("st-header", op, f"{path.name}: {detail}", base, root,
                   touches=[Touch(rel(root, path), f"st-header {detail[:80]}", 0, len(text) + 8, checked)],
                   value_only=consistent, inconsistent=not consistent)  # fmt: skip

    return mutate


def _tensors(header: dict[str, Any]) -> list[str]:
    names = [k for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    if not names:
        raise LookupError("no tensors")
    return names


def _shape_edit(how: str) -> HeaderEdit:
    def edit(h: dict[str, Any], rng: random.Random, payload: bytes) -> str:
        name = rng.choice(_tensors(h))
        old = list(h[name]["shape"])
        new_shape: list[Any] = {
            "bool": lambda: [True, *old],
            "float": lambda: [float(d) for d in old] or [1.0],
            "negative": lambda: [-1, *[abs(d) for d in old]] if old else [-1],
            "huge": lambda: [2**62, *old],
            "reshape": lambda: [math.prod(old)] if len(old) != 1 else [1, *old],
            "string": lambda: [str(d) for d in old] or ["1"],
        }[how]()
        h[name]["shape"] = new_shape
        return f"{name}.shape {old} -> {json.dumps(new_shape)}"

    return edit


def _offsets_edit(how: str) -> HeaderEdit:
    def edit(h: dict[str, Any], rng: random.Random, payload: bytes) -> str:
        names = _tensors(h)
        name = rng.choice(names)
        lo, hi = h[name]["data_offsets"]
        if how == "past-end":
            h[name]["data_offsets"] = [len(payload) - (hi - lo) + 8, len(payload) + 8]
        elif how == "negative":
            h[name]["data_offsets"] = [lo - 8, hi - 8] if lo >= 8 else [-8, hi - lo - 8]
        elif how == "reversed":
            h[name]["data_offsets"] = [hi, lo]
        return f"{name}.data_offsets [{lo}, {hi}] -> {h[name]['data_offsets']} ({how})"

    return edit


def _nbytes(info: dict[str, Any]) -> int:
    lo, hi = info["data_offsets"]
    return int(hi - lo)


def _swap_offsets(h: dict[str, Any], rng: random.Random, payload: bytes) -> str:
    names = _tensors(h)
    pairs = [(a, b) for a in names for b in names if a < b and _nbytes(h[a]) == _nbytes(h[b])]
    same = [(a, b) for a, b in pairs if h[a]["dtype"] == h[b]["dtype"] and h[a]["shape"] == h[b]["shape"]]
    # two tensors of equal bytes (the optimizer's per-param ``step`` scalars) swapped are the same file in
    # meaning: no edit (seed 330/70: diff's true EQUAL was counted as missed damage)
    same = [(a, b) for a, b in same if _bytes_of(h[a], payload) != _bytes_of(h[b], payload)]
    if not same:
        raise LookupError("no two tensors of one shape and dtype")
    a, b = rng.choice(same)
    h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]
    return f"data_offsets of {a} and {b} swapped"


def _bytes_of(entry: dict[str, Any], payload: bytes) -> bytes:
    lo, hi = entry["data_offsets"]
    return payload[lo:hi]


def _overlap_offsets(h: dict[str, Any], rng: random.Random, payload: bytes) -> str:
    names = _tensors(h)
    pairs = [(a, b) for a in names for b in names if a != b and _nbytes(h[a]) == _nbytes(h[b])]
    if not pairs:
        raise LookupError("no two tensors of one size")
    a, b = rng.choice(pairs)
    h[a]["data_offsets"] = list(h[b]["data_offsets"])
    return f"{a} data_offsets := {b}'s (overlap)"


_SAME_SIZE = {"F32": ("I32",), "I32": ("F32",), "F16": ("BF16", "I16"), "BF16": ("F16", "I16"),
              "I64": ("F64",), "F64": ("I64",), "I16": ("F16",), "U8": ("I8", "BOOL"), "I8": ("U8",),
              "BOOL": ("U8",)}  # fmt: skip


def _dtype_edit(how: str) -> HeaderEdit:
    def edit(h: dict[str, Any], rng: random.Random, payload: bytes) -> str:
        name = rng.choice(_tensors(h))
        old = h[name]["dtype"]
        if how == "same-size":
            h[name]["dtype"] = rng.choice(_SAME_SIZE.get(old, ("F32",)))
        else:
            h[name]["dtype"] = rng.choice(("F128", "f32", "", "float32", "C64", 7))
        return f"{name}.dtype {old} -> {h[name]['dtype']!r}"

    return edit


def _info_edit(how: str) -> HeaderEdit:
    def edit(h: dict[str, Any], rng: random.Random, payload: bytes) -> str:
        name = rng.choice(_tensors(h))
        if how == "extra-field":
            h[name]["offsets"] = [0, 0]
        elif how == "missing-field":
            del h[name][rng.choice(("dtype", "shape", "data_offsets"))]
        else:
            h[name] = rng.choice(([1, 2], "tensor", None, 3))
        return f"{name} info {how}"

    return edit


def _meta(key: str, make: Callable[[list[str], random.Random], Any]) -> HeaderEdit:
    def edit(h: dict[str, Any], rng: random.Random, payload: bytes) -> str:
        names = _tensors(h)
        md = h.setdefault("__metadata__", {"format": "pt"})
        value = make(names, rng)
        md[key] = value if isinstance(value, str) else json.dumps(value)
        return f"__metadata__[{key!r}] := {md[key][:60]}"

    return edit


def _meta_whole(h: dict[str, Any], rng: random.Random, payload: bytes) -> str:
    h["__metadata__"] = rng.choice((["format", "pt"], {"format": 1}, {"zckpt.tied": {"a": "b"}}, "pt"))
    return f"__metadata__ := {json.dumps(h['__metadata__'])}"


def _duplicate_raw(h: dict[str, Any], rng: random.Random) -> bytes:
    """The header text with one tensor name listed twice (JSON parsers keep the last)."""
    names = _tensors(h)
    a, b = rng.sample(names, 2) if len(names) > 1 else (names[0], names[0])
    body = json.dumps(h, separators=(",", ":"))
    dup = json.dumps({a: h[b]}, separators=(",", ":"))[1:-1]
    return (body[:-1] + "," + dup + "}").encode()


def _note(detail: str) -> HeaderEdit:
    return lambda h, rng, payload: detail


def _st_ops() -> list[Op]:
    kinds = ("safetensors", "hf", "native")
    shape = {f"shape-{h}": _st_edit(f"shape-{h}", _shape_edit(h), self_consistent=h == "reshape")
             for h in ("bool", "float", "negative", "huge", "reshape", "string")}  # fmt: skip
    offs = {
        f"offsets-{h}": _st_edit(f"offsets-{h}", _offsets_edit(h))
        for h in ("past-end", "negative", "reversed")
    }
    offs["offsets-overlap"] = _st_edit("offsets-overlap", _overlap_offsets)
    offs["offsets-swap"] = _st_edit("offsets-swap", _swap_offsets, self_consistent=True)
    dt = {"dtype-unknown": _st_edit("dtype-unknown", _dtype_edit("unknown")),
          "dtype-same-size": _st_edit("dtype-same-size", _dtype_edit("same-size"),
                                      self_consistent=True)}  # fmt: skip
    info = {
        f"info-{h}": _st_edit(f"info-{h}", _info_edit(h))
        for h in ("extra-field", "missing-field", "not-dict")
    }
    meta = {
        "meta-self-tie": _meta("zckpt.tied", lambda n, r: {(x := r.choice(n)): x}),
        "meta-alias-shadow": _meta("zckpt.tied", lambda n, r: dict([r.sample(n, 2)]) if len(n) > 1 else {}),
        "meta-tie-missing": _meta("zckpt.tied", lambda n, r: {"ghost.weight": "nowhere.weight"}),
        "meta-tie-cycle": _meta("zckpt.tied", lambda n, r: {"a.weight": "b.weight", "b.weight": "a.weight"}),
        "meta-unknown-role": _meta("zckpt.roles", lambda n, r: {r.choice(n): r.choice(("bogus", "", "PRM"))}),
        "meta-roles-not-json": _meta("zckpt.roles", lambda n, r: "{not json"),
        "meta-tied-not-object": _meta("zckpt.tied", lambda n, r: r.choice(([1, 2], "x", 3))),
    }  # fmt: skip
    out = {**shape, **offs, **dt, **info}
    out.update({k: _st_edit(k, fn) for k, fn in meta.items()})
    out["meta-not-string-map"] = _st_edit("meta-not-string-map", _meta_whole)
    out["duplicate-name"] = _st_edit(
        "duplicate-name", _note("a tensor name listed twice"), raw=_duplicate_raw
    )
    return [Op(name, fn, kinds) for name, fn in out.items()]


# ---- hf-index ------------------------------------------------------------------------------------------
def _index_edit(op: str) -> Mutator:
    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        idx = next((root / "ckpt").glob("*.index.json"))
        doc = json.loads(idx.read_text())
        wm: dict[str, Any] = doc["weight_map"]
        shards = sorted(set(wm.values()))
        name = rng.choice(sorted(wm))
        before = {p.name for p in idx.parent.iterdir()}
        detail = _apply_index_op(op, doc, wm, shards, name, rng, root, idx)
        if op != "delete-index":
            idx.write_text(json.dumps(doc, indent=2))
        added = sorted({p.name for p in idx.parent.iterdir()} - before)
        touches = [Touch(rel(root, idx), f"index {detail[:80]}")]
        touches += [Touch(rel(root, idx.parent / n), "added") for n in added]
        return new(
            "hf-index", op, detail, base, root, touches=touches, related=tuple(shards), inconsistent=True
        )

    return mutate


def _apply_index_op(op: str, doc: dict[str, Any], wm: dict[str, Any], shards: list[str], name: str,
                    rng: random.Random, root: Path, idx: Path) -> str:  # fmt: skip
    if op == "drop-entry":
        del wm[name]
        return f"weight_map[{name}] dropped"
    if op == "other-shard":
        others = [s for s in shards if s != wm[name]]
        wm[name] = rng.choice(others) if others else wm[name]
        return f"weight_map[{name}] -> {wm[name]} (wrong shard)"
    if op == "missing-shard":
        wm[name] = "model-00009-of-00009.safetensors"
        return f"weight_map[{name}] -> a shard that does not exist"
    if op == "escape":
        wm[name] = rng.choice(("../" + wm[name], "/etc/passwd", "..", ".", ""))
        return f"weight_map[{name}] -> {wm[name]!r}"
    if op == "wrong-type":
        target = rng.choice(("entry", "weight_map", "metadata", "total_size", "tied"))
        return _index_wrong_type(doc, wm, name, target, rng)
    if op == "delete-index":
        idx.unlink()
        return f"{idx.name} deleted"
    if op == "stale-shard":
        src = idx.parent / shards[0]
        stem, _, suffix = shards[0].partition(".")
        extra = idx.parent / f"{stem.rsplit('-', 3)[0]}-00003-of-00003.{suffix}"
        shutil.copy(src, extra)
        return f"stale extra shard {extra.name} beside the index"
    doc["metadata"] = {**(doc.get("metadata") or {}), "zckpt.tied": {name: name}}
    return f"metadata zckpt.tied self-tie {name}"


def _index_wrong_type(doc: dict[str, Any], wm: dict[str, Any], name: str, target: str,
                      rng: random.Random) -> str:  # fmt: skip
    value: Any = rng.choice((None, 7, [], {"a": 1}, True))
    if target == "entry":
        wm[name] = value
    elif target == "weight_map":
        doc["weight_map"] = rng.choice(([], None, "x"))
    elif target == "metadata":
        doc["metadata"] = rng.choice(([], "x", 3))
    elif target == "total_size":
        doc.setdefault("metadata", {})["total_size"] = rng.choice(("big", -1, 2**70, None))
    else:
        doc.setdefault("metadata", {})["zckpt.tied"] = rng.choice(([1], "x", {"a": 3}))
    return f"index {target} made a wrong type"


HF_INDEX = [
    Op(op, _index_edit(op), ("hf", "hf-bin"))
    for op in ("drop-entry", "other-shard", "missing-shard", "escape", "wrong-type", "delete-index",
               "stale-shard", "tied-self")
]  # fmt: skip

FAMILIES: dict[str, list[Op]] = {
    "ds-pickle": DS_PICKLE,
    "pickle-bomb": PICKLE_BOMB,
    "manifest": _manifest_ops(),
    "st-header": _st_ops(),
    "hf-index": HF_INDEX,
}
