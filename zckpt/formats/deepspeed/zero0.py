"""ZeRO-0 DeepSpeed checkpoints: naming the fp32 master copies by value.

A ZeRO-0 save is one ``mp_rank_00_model_states.pt``: the 16-bit ``module`` and, under ``optimizer``,
DeepSpeed's ``FP16_UnfusedOptimizer``/``FP16_Optimizer`` state dict: ``fp32_groups`` (one fp32 tensor per
trainable param, per param group, in the optimizer's order) and ``optimizer_state_dict`` (the torch
optimizer's per-index state and ``param_groups``). Nothing in the file names the fp32 tensors, and several
params can share a shape, so they are matched by VALUE: DeepSpeed copies each master into its 16-bit param
after every step, so for the right pairing ``fp32.to(module dtype)`` is bit-equal to the module tensor.

Module params are walked in order (buffers and tied aliases skipped); each is compared with the next
unused fp32 tensor of every group (same shape and bit-equal cast; groups may interleave in the model, each
group follows model order); the first group that matches takes it, a param nothing matches is FROZEN.
If an fp32 tensor stays unmatched, or two module params with bit-identical 16-bit values would receive
different things (one frozen and one trainable, different groups, different fp32 bits or optimizer states),
the mapping is not unique and the reader falls back to the 16-bit module weights as PARAM entries, saying
why in ``meta.extra["zero0_note"]`` (the reason alone in ``["zero0_unmapped"]``); it never guesses.

Cost: unlike every other reader, this reads tensor bytes at open time (each 16-bit param once, each fp32
master once; optimizer states only to settle a tie), and checks the CRC-32 of every record it read before
trusting the result: a damaged record is refused by name instead of changing the matching. That is
acceptable only here: ZeRO-0 is a single file, and the matching holds at most one tensor per param group
plus one param in memory at a time.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zckpt import dtypes
from zckpt.codecs.pickle_safe import TensorRef
from zckpt.errors import CorruptCheckpoint, ShardMismatch
from zckpt.formats._schema import Node
from zckpt.formats.deepspeed.common import is_scalar, ref, scalar_entry, whole
from zckpt.model import Piece, Role, TensorEntry, dtype_name, precision_of
from zckpt.state import to_json
from zckpt.storage import checks, fileio

if TYPE_CHECKING:
    import torch


@dataclass
class Zero0:
    """What the ZeRO-0 branch of the reader produces."""

    entries: list[TensorEntry] = field(default_factory=list)
    precision: str | None = None
    opt_groups: list[dict[str, Any]] = field(default_factory=list)
    state_names: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def _load(ref: TensorRef) -> torch.Tensor:
    """The tensor's values, reported to the checksum session (``read_zero0`` compares the records' CRC-32s
    before it trusts the matching it did with them)."""
    import torch  # ZeRO-0 names its fp32 masters by matching their values

    out = torch.empty(ref.numel, dtype=ref.dtype.torch)
    if ref.numel:
        fileio.read_into(ref.file, ref.byte_offset, out)
        checks.consumed(ref.check, ref.byte_offset, out)
    return out.view(tuple(ref.shape))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


def _digest(t: torch.Tensor) -> str:
    import torch

    return hashlib.blake2b(
        t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), digest_size=16
    ).hexdigest()


def _masters(opt: dict[str, Any]) -> list[list[TensorRef]] | str:
    """The fp32 copies per group, or why there are none we can match."""
    groups = opt.get("fp32_groups")
    if groups is None:
        if "fp32_groups_flat" in opt:
            return "fp32 masters are stored flat per group (FP16_Optimizer fused); not mapped to names"
        return "no fp32_groups in the optimizer state"
    for g, grp in enumerate(groups):  # lists of tensors (``_check_structure``)
        for i, t in enumerate(grp):
            if t.dtype != dtypes.float32 or not t.is_contiguous:
                return f"fp32_groups[{g}][{i}] is not a contiguous fp32 tensor"
    return groups


def _match(
    params: dict[str, TensorRef], groups: list[list[TensorRef]]
) -> tuple[dict[str, tuple[int, int]], dict[str, str]] | str:
    """{param name: (group, index)} and {param name: digest of its 16-bit bytes}, or why the mapping is
    not unique."""
    ptr = [0] * len(groups)
    head: list[torch.Tensor | None] = [None] * len(groups)
    got: dict[str, tuple[int, int]] = {}
    digest: dict[str, str] = {}
    for name, r in params.items():
        low = _load(r)
        digest[name] = f"{dtype_name(low.dtype)}{tuple(low.shape)}:{_digest(low)}"
        for g, grp in enumerate(groups):
            if ptr[g] >= len(grp) or tuple(grp[ptr[g]].shape) != tuple(low.shape):
                continue
            if head[g] is None:
                head[g] = _load(grp[ptr[g]]).to(low.dtype)
            if _bits_equal(head[g], low):  # type: ignore[arg-type]
                got[name] = (g, ptr[g])
                ptr[g] += 1
                head[g] = None
                break
    for g, grp in enumerate(groups):
        if ptr[g] < len(grp):
            return (
                f"fp32_groups[{g}][{ptr[g]}] (shape {list(grp[ptr[g]].shape)}) matches no 16-bit module "
                "param in order"
            )
    return got, digest


def _tie_problem(
    params: dict[str, TensorRef],
    groups: list[list[TensorRef]],
    got: dict[str, tuple[int, int]],
    digest: dict[str, str],
    states: dict[tuple[int, int], dict[str, Any]],
) -> str | None:
    """Params with bit-identical 16-bit values could swap masters: say why if that would change anything."""
    buckets: dict[str, list[str]] = {}
    for name, d in digest.items():
        buckets.setdefault(d, []).append(name)
    for names in buckets.values():
        if len(names) < 2 or not any(n in got for n in names):
            continue
        first = _load(params[names[0]])
        if not all(_bits_equal(_load(params[n]), first) for n in names[1:]):
            continue  # a digest collision, not equal values
        frozen = [n for n in names if n not in got]
        if frozen:
            live = next(n for n in names if n in got)
            return f"{live} and {frozen[0]} hold identical 16-bit values; which one is trainable is ambiguous"
        g0, i0 = got[names[0]]
        ref = _load(groups[g0][i0])
        for n in names[1:]:
            g, i = got[n]
            if g != g0:
                return f"{names[0]} and {n} hold identical 16-bit values but sit in param groups {g0} and {g}"
            if not _bits_equal(_load(groups[g][i]), ref):
                return f"{names[0]} and {n} hold identical 16-bit values but different fp32 masters"
            a, b = states.get((g0, i0), {}), states.get((g, i), {})
            if set(a) != set(b) or any(
                isinstance(a[k], TensorRef) != isinstance(b[k], TensorRef)
                or (isinstance(a[k], TensorRef) and not _bits_equal(_load(a[k]), _load(b[k])))
                or (not isinstance(a[k], TensorRef) and a[k] != b[k])
                for k in a
            ):
                return f"{names[0]} and {n} hold identical 16-bit values but different optimizer states"
    return None


def _states_by_slot(
    inner: dict[str, Any], groups: list[list[TensorRef]], file: str
) -> tuple[dict[tuple[int, int], dict[str, Any]], str | None]:
    """{(group, index in group): torch optimizer state}, each state's tensors checked against their master's
    shape (``_check_state_shapes``); the torch state is keyed by the flat param index listed in
    ``param_groups[g]["params"]``."""
    pgs = inner.get("param_groups") or []
    if len(pgs) != len(groups) or any(
        len(pg.get("params", [])) != len(grp) for pg, grp in zip(pgs, groups, strict=False)
    ):
        return {}, "optimizer param_groups do not line up with fp32_groups; optimizer states not mapped"
    state = inner.get("state") or {}
    out = {}
    for g, pg in enumerate(pgs):
        for i, idx in enumerate(pg["params"]):
            st = state.get(idx, state.get(str(idx)))
            if isinstance(st, dict):
                out[(g, i)] = st
    _check_state_shapes(out, groups, file)
    return out, None


def _check_state_keys(states: dict[tuple[int, int], dict[str, Any]], file: str) -> None:
    """A torch optimizer keeps the same states for every param it has stepped (a param never stepped has
    none): a param missing one the others hold is a damaged file, not a state to drop for all."""
    kinds = {(g, i): frozenset(st) for (g, i), st in states.items() if st}
    if len(set(kinds.values())) <= 1:
        return
    common = max(set(kinds.values()), key=lambda k: sum(v == k for v in kinds.values()))
    (g, i), odd = next((slot, k) for slot, k in kinds.items() if k != common)
    raise CorruptCheckpoint(
        f"{file}: optimizer state of fp32_groups[{g}][{i}] holds {sorted(odd)}, the other params "
        f"{sorted(common)}",
        hint="the file was altered or is damaged",
        path=file,
    )


def _check_state_shapes(
    states: dict[tuple[int, int], dict[str, Any]], groups: list[list[TensorRef]], file: str
) -> None:
    """Each optimizer state tensor has its fp32 master's shape (torch keeps ``exp_avg`` & co. per element of
    the param it steps), or is a scalar (``step``). Checked before the matching, so that a file whose module
    weights fall back to PARAM entries is still refused when a state was swapped with another tensor. A
    state is per element for every param or a scalar for every param (torch's optimizers keep one layout
    per state): an ``exp_avg_sq`` that is a scalar for one param of more than one element, when the other
    params hold theirs per element, is a damaged file (params of one element tell nothing: skipped)."""
    per_elem: dict[str, tuple[int, int]] = {}
    scalar: dict[str, tuple[int, int]] = {}
    dtypes: dict[str, tuple[str, tuple[int, int]]] = {}  # per-element state: (dtype, first slot holding it)
    for (g, i), st in states.items():
        want = tuple(groups[g][i].shape)
        for s, v in st.items():
            if isinstance(v, TensorRef) and not is_scalar(v) and tuple(v.shape) != want:
                raise ShardMismatch(
                    f"{file}: optimizer state {s!r:.40} of fp32_groups[{g}][{i}] has shape {list(v.shape)}, "
                    f"its fp32 master {list(want)}",
                    hint="the file was altered, or its optimizer keeps states zckpt does not know",
                    path=file,
                )
            if math.prod(want) > 1 and isinstance(s, str):
                if is_scalar(v):
                    scalar.setdefault(s, (g, i))
                elif isinstance(v, TensorRef):
                    per_elem.setdefault(s, (g, i))
                    _check_state_dtype(dtypes, s, str(v.dtype), (g, i), file)
    for s in per_elem.keys() & scalar.keys():
        (g, i), (eg, ei) = scalar[s], per_elem[s]
        raise ShardMismatch(
            f"{file}: optimizer state {s!r:.40} of fp32_groups[{g}][{i}] is a scalar, that of "
            f"fp32_groups[{eg}][{ei}] (and its master) has one value per element",
            hint="the file was altered or is damaged",
            path=file,
        )


def _check_state_dtype(
    seen: dict[str, tuple[str, tuple[int, int]]], s: str, dtype: str, slot: tuple[int, int], file: str
) -> None:
    """A torch optimizer keeps a per-element state in one dtype for every param (``exp_avg`` is
    ``zeros_like`` the fp32 master): one in another dtype is a tensor swapped in (fuzz seed 43 case 97: a
    bf16 module weight of the master's shape in place of an ``exp_avg_sq``)."""
    first = seen.setdefault(s, (dtype, slot))
    if first[0] != dtype:
        (g, i), (fg, fi) = slot, first[1]
        raise ShardMismatch(
            f"{file}: optimizer state {s!r:.40} of fp32_groups[{g}][{i}] is {dtype}, that of "
            f"fp32_groups[{fg}][{fi}] {first[0]}",
            hint="the file was altered or is damaged",
            path=file,
        )


def _check_indices(params: list[list[int]], state: dict[Any, Any], file: str) -> None:
    """torch's ``state_dict`` numbers the params of all groups once each and keys ``state`` by those numbers:
    a number listed twice, or a state under a number no group lists, is a damaged file (its state would
    be dropped or given to another param)."""
    listed: set[int] = set()
    for g, ps in enumerate(params):
        for i in ps:
            if i in listed:
                raise CorruptCheckpoint(f"{file}: optimizer param_groups[{g}] lists param index {i} again",
                                        hint="the file was altered or is damaged", path=file)  # fmt: skip
            listed.add(i)
    for k in state:
        if (int(k) if isinstance(k, str) and k.isdigit() else k) not in listed:
            raise CorruptCheckpoint(
                f"{file}: optimizer state for param index {k!r:.20}, which no param group lists",
                hint="the file was altered or is damaged",
                path=file,
            )


def _check_structure(opt: dict[str, Any], inner: Any, file: str) -> None:
    """The optimizer block's containers have the types torch and DeepSpeed give them: anything else is a
    damaged or altered file, refused naming it (a fallback would drop names or roles silently)."""

    def bad(where: str, what: object, want: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(
            f"{file}: optimizer {where} is {type(what).__name__}, expected {want}",
            hint="the file was altered or is damaged",
            path=file,
        )

    if not isinstance(inner, dict):
        raise bad("optimizer_state_dict", inner, "a dict")
    lost = [k for k in ("state", "param_groups") if k not in inner]
    if lost:  # torch's state_dict always holds both (``state`` empty before the first step)
        where = "optimizer.optimizer_state_dict" if "optimizer_state_dict" in opt else "optimizer"
        raise CorruptCheckpoint(
            f"{file}: {where}.{lost[0]} is missing",
            hint="the file was altered or is damaged",
            path=file,
        )
    pgs = inner.get("param_groups", [])
    if not isinstance(pgs, list):
        raise bad("param_groups", pgs, "a list")
    for g, pg in enumerate(pgs):
        if not isinstance(pg, dict):
            raise bad(f"param_groups[{g}]", pg, "a dict")
        ps = pg.get("params", [])
        if not isinstance(ps, list) or not all(type(i) is int for i in ps):  # noqa: E721 - not bool
            raise bad(f"param_groups[{g}].params", ps, "a list of ints")
    st = inner.get("state") or {}
    if not isinstance(st, dict) or not all(isinstance(v, dict) for v in st.values()):
        raise bad("state", st, "a dict of per-param dicts")
    _check_indices([pg.get("params", []) for pg in pgs], st, file)
    groups = opt.get("fp32_groups")
    if groups is not None:
        if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
            raise bad("fp32_groups", groups, "a list of lists of tensors")
        for g, grp in enumerate(groups):
            for i, t in enumerate(grp):
                if not isinstance(t, TensorRef):
                    raise bad(f"fp32_groups[{g}][{i}]", t, "a tensor")


def read_zero0(m0: Node, module: Node, buffer_names: list[str], tied: dict[str, str]) -> Zero0:
    z = Zero0()
    mfile = m0.file  # a path or a URL, as it was opened
    params = {
        n: ref(t)
        for n, t in module.items()
        if isinstance(t.value, TensorRef) and n not in buffer_names and n not in tied
    }
    for r in params.values():
        z.precision = precision_of(r.dtype)
        break
    opt = m0.value.get("optimizer")
    inner: dict[str, Any] = {}
    if isinstance(opt, dict):
        inner = opt.get("optimizer_state_dict", opt)
        _check_structure(opt, inner, str(mfile))
        z.opt_groups = [dict(pg) for pg in inner.get("param_groups", [])]
        for st in (inner.get("state") or {}).values():
            z.state_names += [k for k in st if k not in z.state_names]
        z.extra["zero0_optimizer"] = {
            k: to_json(v)
            for k, v in opt.items()
            if k not in ("optimizer_state_dict", "fp32_groups", "fp32_groups_flat", "state", "param_groups")
        }
    why: str | None
    if not isinstance(opt, dict):
        why = "no optimizer state in the file"
    elif z.precision == "fp32":
        why = "fp32 training: the module weights are the masters; frozen params can't be told apart"
    else:
        masters = _masters(opt)
        why = masters if isinstance(masters, str) else None
    if why is None:
        assert not isinstance(masters, str)
        states, state_note = _states_by_slot(inner, masters, str(mfile))
        with checks.verifying():  # a flipped bit must fail its record's CRC, not the matching
            res = _match(params, masters)
            if isinstance(res, str):
                why = res
            else:
                got, digest = res
                _check_state_keys(states, str(mfile))
                why = _tie_problem(params, masters, got, digest, states)
    if why is not None:
        z.entries = [whole(n, r, Role.PARAM) for n, r in params.items()]
        note = f"fp32 masters not mapped to names ({why}); PARAM entries are the module weights"
        z.extra.update(zero0_note=note, zero0_unmapped=why)  # the reason alone: for writers needing masters
        return z
    for name, r in params.items():
        if name in got:
            g, i = got[name]
            master = ref(Node(masters[g][i], str(mfile), f"optimizer.fp32_groups[{g}][{i}]"))
            z.entries.append(whole(name, master, Role.PARAM))
        else:
            z.entries.append(whole(name, r, Role.FROZEN))
    for name, (g, i) in got.items():
        for s, v in states.get((g, i), {}).items():
            if isinstance(v, TensorRef) and tuple(v.shape) == tuple(params[name].shape):
                st = ref(Node(v, str(mfile), f"optimizer state {s!r} of {name}"))
                piece = Piece(st.file, st.byte_offset, st.dtype, 0, st.numel, 0, check=st.check)
                z.entries.append(TensorEntry(name, tuple(v.shape), v.dtype, Role.OPTIM, (piece,), s))
            elif is_scalar(v):
                z.entries.append(scalar_entry(name, s, v, 0))
            else:
                raise ShardMismatch(
                    f"{mfile}: optimizer state {s!r:.40} of {name!r:.80} is neither a tensor of the param's "
                    f"shape {list(params[name].shape)} nor a scalar",
                    hint="the file was altered, or its optimizer keeps states zckpt does not know",
                    path=str(mfile),
                )
    by_slot = {gi: n for n, gi in got.items()}
    for g, pg in enumerate(z.opt_groups):
        if state_note is None:
            pg["params"] = [by_slot[(g, i)] for i in range(len(pg.get("params", [])))]
    z.extra["zero0_note"] = (
        f"fp32 masters mapped to names by value ({len(got)} trainable, {len(params) - len(got)} frozen)"
        + (f"; {state_note}" if state_note else "")
    )
    return z
