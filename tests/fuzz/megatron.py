"""Megatron families: Megatron-Core ``torch_dist`` save folders (``fixtures/megatron``) damaged.

The bases are real megatron-core 0.16.1 saves (TP2 x DP2 distributed optimizer with ``dp_reshardable`` flat
buckets, TP2 x PP2 bf16, TP1 fp32, GPT-2 style TP2), given as the save folder. Families (run them with
``--megatron`` or by name):

- ``megatron-metadata`` / ``megatron-chunks``: the DCP families' ``.metadata`` and ``.distcp`` damage
  (``tests.fuzz.dcp``) on these bases (``.metadata`` here also holds Megatron's ``all_local_plans``; it has no
  ``planner_data``, so the mutators of that table are left out);
- ``megatron-common``: ``common.pt``'s pickle re-written: a global outside the allowlist, ``args`` removed or
  not a Namespace, model arguments that disagree with the tensors (layers, hidden size, heads, query groups,
  FFN size, SwiGLU, vocab), the file truncated or emptied;
- ``megatron-flat``: a distributed-optimizer flat bucket shortened in ``.metadata`` (its last chunk too);
  ``args`` naming another TP size (refused where flat buckets depend on it, else a value nothing checks);
- ``megatron-latest``: ``latest_checkpointed_iteration.txt`` not a number, naming a missing iteration,
  leaving the folder, empty, binary, huge.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.fuzz import dcp, pickles
from tests.fuzz.mutation import Mutation, NotApplicable, Op, Touch, fresh_copy, new, rel

KIND = ("megatron",)
LATEST = "latest_checkpointed_iteration.txt"


def _iter_dir(root: Path) -> Path:
    ckpt = root / "ckpt"
    return ckpt / f"iter_{int((ckpt / LATEST).read_text().strip()):07d}"


# ---- megatron-common ---------------------------------------------------------------------------------------
def _args(obj: Any) -> dict[str, Any]:
    ns = obj.get("args") if isinstance(obj, dict) else None
    if not isinstance(ns, pickles.Opaque) or not isinstance(ns.state, dict):
        raise LookupError("no args Namespace")
    state: dict[str, Any] = ns.state
    return state


ArgEdit = Callable[[dict[str, Any], random.Random], str]


def _arg(name: str, change: Callable[[Any], Any]) -> ArgEdit:
    def edit(args: dict[str, Any], rng: random.Random) -> str:
        if name not in args:
            raise LookupError(f"no args.{name}")
        old = args[name]
        args[name] = change(old)
        return f"args.{name}: {old!r} -> {args[name]!r}"

    return edit


def _gqa(edit: ArgEdit) -> ArgEdit:
    """Only where the groups are read (``group_query_attention``; else every head is its own group)."""

    def gated(args: dict[str, Any], rng: random.Random) -> str:
        if not args.get("group_query_attention"):
            raise LookupError("no grouped-query attention: num_query_groups is not read")
        return edit(args, rng)

    return gated


def _planner_free(fn: Any) -> Any:
    """A DCP mutator on a save without ``planner_data``: the ones that edit it are not applicable."""

    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        try:
            m: Mutation = fn(case_dir, rng)
        except TypeError as e:  # ``planner_data`` is None here
            raise NotApplicable(None, f"edits planner_data, which Megatron does not save ({e})") from None
        return m

    return mutate


ARG_EDITS: dict[str, ArgEdit] = {
    "num-layers": _arg("num_layers", lambda v: v + 1),
    "hidden-size": _arg("hidden_size", lambda v: v + 8),
    "heads": _arg("num_attention_heads", lambda v: v * 2),
    "query-groups": _gqa(_arg("num_query_groups", lambda v: max(1, v // 2) if v > 1 else 2)),
    "ffn": _arg("ffn_hidden_size", lambda v: v + 16),
    "swiglu": _arg("swiglu", lambda v: not v),
    "padded-vocab": _arg("padded_vocab_size", lambda v: v + 16),
    "num-layers-zero": _arg("num_layers", lambda v: 0),
    "hidden-str": _arg("hidden_size", lambda v: "32"),
}


def _common_op(op: str, edit: Callable[[Any, random.Random], str], *, must_refuse: bool = True,
               value_only: bool = False) -> Any:  # fmt: skip
    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        f = _iter_dir(root) / "common.pt"
        obj = pickles.load_opaque(pickles.read_pickle(f))
        try:
            detail = edit(obj, rng)
        except LookupError as e:
            raise NotApplicable(root, str(e)) from None
        data = pickles.dump_opaque(obj)
        pickles.rewrite_records(f, {"data.pkl": data})
        return new("megatron-common", op, detail, base, root, touches=[Touch(rel(root, f), op)],
                   inconsistent=not value_only, must_refuse=must_refuse, value_only=value_only,
                   related=(".metadata",))  # fmt: skip

    return mutate


def _arg_op(name: str) -> Any:
    return _common_op(f"args-{name}", lambda obj, rng: ARG_EDITS[name](_args(obj), rng))


def _drop_args(obj: Any, rng: random.Random) -> str:
    if not isinstance(obj, dict) or "args" not in obj:
        raise LookupError("no args")
    obj["args"] = {"num_layers": 2} if rng.random() < 0.5 else None
    return f"args replaced by {obj['args']!r}"


def _foreign(case_dir: Path, rng: random.Random) -> Mutation:
    base, root = fresh_copy(case_dir)
    f = _iter_dir(root) / "common.pt"
    pkl = pickles.dump_opaque(pickles.load_opaque(pickles.read_pickle(f)))
    call = pickles.op_call(pickles.op_global("os", "system"), pickles.op_str("true"))
    pickles.rewrite_records(f, {"data.pkl": pickles.with_item(pkl, "hook", call)})
    return new("megatron-common", "foreign-global", "common.pt calls os.system", base, root,
               touches=[Touch(rel(root, f), "foreign-global")], must_refuse=True)  # fmt: skip


def _cut(how: str) -> Any:
    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        f = _iter_dir(root) / "common.pt"
        data = f.read_bytes()
        f.write_bytes(b"" if how == "empty" else data[: rng.randrange(1, len(data))])
        return new("megatron-common", f"common-{how}", f"common.pt {how}", base, root,
                   touches=[Touch(rel(root, f), how)], must_refuse=True)  # fmt: skip

    return mutate


COMMON_OPS = [
    *[Op(f"args-{n}", _arg_op(n), KIND) for n in ARG_EDITS],
    Op("args-dropped", _common_op("args-dropped", _drop_args), KIND),
    Op("foreign-global", _foreign, KIND),
    Op("common-truncated", _cut("truncated"), KIND),
    Op("common-empty", _cut("empty"), KIND),
]


# ---- megatron-flat -----------------------------------------------------------------------------------------
def _flat_keys(md: Any) -> list[str]:
    sdm = md.state.get("state_dict_metadata") if isinstance(md.state, dict) else None
    return [k for k in (sdm or {}) if isinstance(k, str) and ".bucket_idx_" in k]


def _shorten(case_dir: Path, rng: random.Random) -> Mutation:
    base, root = fresh_copy(case_dir)
    folder = _iter_dir(root)
    md = dcp.load_md(folder)
    keys = _flat_keys(md)
    if not keys:
        raise NotApplicable(root, "no flat buckets")
    key = rng.choice(keys)
    t = md.state["state_dict_metadata"][key]
    last = max(t.state["chunks"], key=lambda c: _first(c.state["offsets"]))
    if _first(last.state["sizes"]) <= 64:
        raise NotApplicable(root, "last chunk too small")
    _shrink(t.state["size"], 64)
    _shrink(last.state["sizes"], 64)
    (folder / dcp.MD).write_bytes(pickles.dump_opaque(md))
    f = folder / dcp.MD
    # consolidate reads the masters only: a shortened moment bucket must be refused by what reads it
    return new("megatron-flat", "bucket-shorter", f"{key} 64 elements shorter", base, root,
               touches=[Touch(rel(root, f), "bucket-shorter")], inconsistent=True,
               must_refuse=key.endswith(".param"), related=(".distcp",))  # fmt: skip


def _shrink(size: Any, n: int) -> None:
    """``torch.Size((d0, ...))`` (an ``Opaque`` call) with ``d0`` made ``n`` smaller, in place."""
    dims = list(size.args[0])
    dims[0] -= n
    size.args[0] = dims


def _first(size: Any) -> int:
    dims = size.args[0] if isinstance(size, pickles.Opaque) else size
    return int(dims[0])


FLAT_OPS = [
    Op("bucket-shorter", _shorten, KIND),
    Op("args-tp", _common_op("args-tp", lambda obj, rng: _arg("tensor_model_parallel_size",
                                                              lambda v: 1 if v > 1 else 2)(_args(obj), rng),
                             must_refuse=False, value_only=True), KIND),
]  # fmt: skip


# ---- megatron-latest ---------------------------------------------------------------------------------------
LATEST_TEXT = {
    "word": b"three\n", "missing": b"99\n", "dotdot": b"../iter_0000003\n", "empty": b"",
    "binary": b"\xff\x00\x01", "huge": b"9" * 40, "negative": b"-3\n",
}  # fmt: skip


def _latest(op: str) -> Any:
    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        f = root / "ckpt" / LATEST
        f.write_bytes(LATEST_TEXT[op])
        return new("megatron-latest", op, f"{LATEST}: {LATEST_TEXT[op]!r:.40}", base, root,
                   touches=[Touch(rel(root, f), op)], must_refuse=True)  # fmt: skip

    return mutate


LATEST_OPS = [Op(op, _latest(op), KIND) for op in LATEST_TEXT]

FAMILIES: dict[str, list[Op]] = {
    "megatron-metadata": [
        Op(o.name, o.fn, KIND)
        for o in dcp.METADATA_OPS
        if "planner" not in o.name and not o.name.startswith("path-")
    ],  # Megatron saves no planner_data
    "megatron-chunks": [Op(o.name, o.fn, KIND) for o in dcp.CHUNK_OPS],
    "megatron-common": COMMON_OPS,
    "megatron-flat": FLAT_OPS,
    "megatron-latest": LATEST_OPS,
}
