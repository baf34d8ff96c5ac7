"""Reader for DeepSpeed checkpoints (``DeepSpeedEngine.save_checkpoint``): ZeRO-0/1/2/3, BF16_Optimizer.

Owns: finding the tag folder (``latest``, ``--tag`` or the tag folder itself), classifying its rank files,
checking them against each other (world size, missing/extra/stale ranks, partition sizes), and turning
the pickled metadata into ``TensorEntry`` pieces that point into the files. Trainable params point at
the fp32 master partitions, optimizer states at the flat state partitions (same layout), frozen params
and buffers at the 16-bit ``module`` / ``frozen_param_fragments`` tensors. Only ``data.pkl`` of each file
is read here (``zckpt.io.torchzip.load_refs``); tensor bytes are read later, on demand, by
``zckpt.io.storage``.
The one exception is ZeRO-0 (``zckpt.formats._deepspeed_zero0``): its unnamed fp32 masters are matched to
names by value, which reads the 16-bit params and fp32 copies once at open time (a single file).
Layout math: ../shared/docs/deepspeed-format.md §4; ``deepspeed`` is never imported.
"""

from __future__ import annotations

import enum
import math
from pathlib import Path
from typing import Any

import torch

from zckpt import partition
from zckpt.checkpoint import Checkpoint
from zckpt.errors import CorruptCheckpoint, ShardMismatch, Unsupported
from zckpt.formats._deepspeed_files import check_ranks, detect, resolve, scan
from zckpt.io.pickle_safe import TensorRef, _Record
from zckpt.io.torchzip import load_refs
from zckpt.model import CheckpointMeta, OptimizerInfo, Piece, Role, TensorEntry, dtype_name

NAME = "deepspeed"
__all__ = ["NAME", "detect", "read"]

# Model-states keys DeepSpeed writes itself; anything else at the top level is client_state.
_DS_KEYS = (
    "module buffer_names optimizer param_shapes frozen_param_shapes shared_params frozen_param_fragments "
    "lr_scheduler data_sampler random_ltd sparse_tensor_module_names csr_tensor_module_names skipped_steps "
    "global_steps global_samples dp_world_size mp_world_size checkpoint_parallel_dimensions "
    "universal_checkpoint_info ds_config ds_version ds_autoep_layers autoep_layers"
)
_KNOWN_KEYS = frozenset(_DS_KEYS.split())


# ---- helpers -----------------------------------------------------------------------------------------
def _load(path: Path, trust: bool) -> dict[str, Any]:
    obj = load_refs(str(path), trust_pickle=trust)
    if not isinstance(obj, dict):
        raise CorruptCheckpoint(f"{path}: expected a dict, found {type(obj).__name__}", path=str(path))
    return obj


def _jsonable(o: Any) -> Any:
    if isinstance(o, TensorRef):
        return f"<tensor {list(o.shape)} {dtype_name(o.dtype)}>"
    if isinstance(o, _Record):
        return _jsonable(o.to_dict())
    if isinstance(o, enum.Enum):
        return o.value
    if isinstance(o, torch.dtype):
        return dtype_name(o)
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in o]
    if o is None or isinstance(o, (bool, int, float, str)):
        return o
    return repr(o)


def _ref(path: Path, what: str, obj: Any) -> TensorRef:
    if not isinstance(obj, TensorRef):
        raise CorruptCheckpoint(f"{path}: {what} is {type(obj).__name__}, expected a tensor", path=str(path))
    if not obj.is_contiguous:
        raise Unsupported(f"{path}: {what} is stored non-contiguous", path=str(path))
    return obj


def _whole(name: str, ref: TensorRef, role: Role, shape: tuple[int, ...] | None = None) -> TensorEntry:
    shape = tuple(ref.shape) if shape is None else shape
    return TensorEntry(
        name, shape, ref.dtype, role, (Piece(ref.file, ref.byte_offset, ref.dtype, 0, ref.numel, 0),)
    )


def _scalar_piece(val: Any, rank: int) -> Piece:
    if isinstance(val, TensorRef):
        return Piece(val.file, val.byte_offset, val.dtype, 0, 1, rank)
    t = torch.tensor(val)
    return Piece("", 0, t.dtype, 0, 1, rank, value=t)


class _Layout:
    """Where each trainable param lives in the flat per-rank vectors: {name: [(rank, slot, offset, start, n,
    pad)]}, slot = the flat tensor index (ZeRO-1/2 group or ZeRO-3 sub-group) in each rank's list."""

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.slot_of: dict[str, int] = {}
        self.runs: dict[str, list[tuple[int, int, int, int, int, int]]] = {}


def _param_entries(lay: _Layout, flats: list[list[Any]], role: Role, state: str | None) -> list[TensorEntry]:
    out = []
    for name, shape in lay.shapes.items():
        pieces = []
        dtype = torch.float32
        for r, slot, off, start, n, pad in lay.runs[name]:
            ref = flats[r][slot]
            dtype = ref.dtype
            pieces.append(
                Piece(ref.file, ref.byte_offset + off * ref.dtype.itemsize, ref.dtype, start, n, r, pad)
            )
        out.append(TensorEntry(name, shape, dtype, role, tuple(pieces), state))
    return out


def _is_scalar(v: Any) -> bool:
    if isinstance(v, TensorRef):
        return len(v.shape) == 0
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _optim_entries(
    lay: _Layout, states: list[dict[int, Any]], sizes: list[list[int]], files: list[Path], skipped: list[str]
) -> tuple[list[TensorEntry], list[str]]:
    """Per-param OPTIM entries from per-rank ``{slot: {state name: value}}``. A flat state (1-D, the
    rank's padded slot length ``sizes[r][slot]``) is cut like the fp32 partition; a scalar (``step``:
    0-dim tensor or Python number) becomes a shape-() entry per param pointing at it."""
    names: list[str] = []
    for per in states:
        for st in per.values():
            names += [k for k in st if k not in names]
    out: list[TensorEntry] = []
    for s in names:
        flats: list[list[Any]] = [[None] * len(sz) for sz in sizes]
        scalars: dict[tuple[int, int], Any] = {}
        for r, per in enumerate(states):
            for key, st in per.items():
                slot, v = int(key), st.get(s)
                if v is None:
                    continue
                if (
                    isinstance(v, TensorRef)
                    and len(v.shape) == 1
                    and slot < len(sizes[r])
                    and v.numel == sizes[r][slot]
                ):
                    flats[r][slot] = _ref(files[r], f"optimizer state {s!r} of group {slot}", v)
                elif _is_scalar(v):
                    scalars[(r, slot)] = v
                else:
                    skipped.append(f"{s}: group {slot} on rank {r} is neither a flat partition nor a scalar")
        for name in lay.shapes:
            runs, slot = lay.runs[name], lay.slot_of[name]
            r0 = runs[0][0] if runs else 0
            if any(f[slot] is not None for f in flats) and all(
                flats[r][sl] is not None for r, sl, *_ in runs
            ):
                out += _param_entries(_sub(lay, name), flats, Role.OPTIM, s)
            elif (r0, slot) in scalars:
                p = _scalar_piece(scalars[(r0, slot)], r0)
                out.append(TensorEntry(name, (), p.dtype, Role.OPTIM, (p,), s))
    return out, names


def _sub(lay: _Layout, name: str) -> _Layout:
    one = _Layout()
    one.shapes = {name: lay.shapes[name]}
    one.slot_of = {name: lay.slot_of[name]}
    one.runs = {name: lay.runs[name]}
    return one


def _fp32_flats(
    osds: list[dict[str, Any]], files: list[Path], key: str, groups: int, what: str
) -> list[list[Any]]:
    """Each rank's list of flat fp32 tensors under ``key`` (one per group or sub-group), counts checked."""
    flats: list[list[Any]] = []
    for r, osd in enumerate(osds):
        parts = osd.get(key)
        if not isinstance(parts, list) or len(parts) != groups:
            raise ShardMismatch(
                f"{files[r]}: {len(parts or [])} flat fp32 tensors in {key} but the model file lists "
                f"{groups} groups (files from different runs?)",
                path=str(files[r]),
            )
        flats.append([_ref(files[r], f"{what} {g}", t) for g, t in enumerate(parts)])
    return flats


# ---- ZeRO-1/2 and BF16_Optimizer ----------------------------------------------------------------------
def _zero12(
    osds: list[dict[str, Any]], files: list[Path], param_shapes: list[dict[str, Any]], ws: int, padded: bool
) -> tuple[_Layout, list[list[Any]], list[dict[str, Any]], list[list[int]]]:
    lay = _Layout()
    flats = _fp32_flats(
        osds, files, "single_partition_of_fp32_groups", len(param_shapes), "fp32 partition of group"
    )
    groups_info: list[dict[str, Any]] = []
    sizes: list[list[int]] = [[0] * len(param_shapes) for _ in range(ws)]
    for g, shapes in enumerate(param_shapes):
        apad = (osds[0].get("param_alignment_paddings") or [[]] * len(param_shapes))[g] or [0] * len(shapes)
        gpads = [int(osd.get("group_paddings", [0] * len(param_shapes))[g]) for osd in osds]
        lens = [flats[r][g].numel for r in range(ws)]
        psizes = {lens[r] + (0 if padded else gpads[r]) for r in range(ws)}
        if len(psizes) != 1:
            raise ShardMismatch(
                f"{files[-1]}: param group {g}: rank partitions disagree in size "
                f"(fp32 lengths {lens}, paddings {gpads})",
                hint="a rank file is stale from another run",
                path=str(files[-1]),
            )
        part = psizes.pop()
        names = list(shapes)
        placed = []  # (name, shape, numel, flat offset)
        offset = 0
        for k, (name, shp) in enumerate(shapes.items()):
            shape = tuple(int(d) for d in shp)
            placed.append((name, shape, math.prod(shape), offset))
            offset += math.prod(shape) + int(apad[k] if k < len(apad) else 0)
        n_g = offset
        available = sum(lens) - (sum(gpads) if padded else 0)
        if n_g != available or ws * part - n_g != sum(gpads):
            raise ShardMismatch(
                f"{files[0]}: param group {g}: param_shapes consumed {n_g} elements of "
                f"{available} stored across {ws} ranks (padding {gpads})",
                hint="model and optimizer files come from different runs",
                path=str(files[0]),
            )
        for name, shape, n, off in placed:
            lay.shapes[name], lay.slot_of[name] = shape, g
            lay.runs[name] = [
                (o.rank, g, o.offset_in_partition, o.offset_in_segment, o.length, 0)
                for o in partition.overlaps(off, n, part, ws)
            ]
        for r in range(ws):
            sizes[r][g] = part
            for name in names:
                for rr, _, off, _, n, _ in lay.runs[name]:
                    if rr == r and off + n > lens[r]:
                        raise ShardMismatch(
                            f"{files[r]}: {name} needs elements up to {off + n} of group {g} "
                            f"but the partition holds {lens[r]}",
                            path=str(files[r]),
                        )
            _check_slices(files[r], osds[r], g, lay, names, r)
        groups_info.append(
            {
                "params": names,
                "numel": n_g,
                "partition_size": part,
                "group_paddings": gpads,
                "param_alignment_paddings": [int(a) for a in apad],
            }
        )
    return lay, flats, groups_info, sizes


def _check_slices(f: Path, osd: dict[str, Any], g: int, lay: _Layout, names: list[str], r: int) -> None:
    """Cross-check our math against DeepSpeed's own ``param_slice_mappings`` of rank r, group g."""
    maps = osd.get("param_slice_mappings")
    if not isinstance(maps, list) or g >= len(maps):
        return
    ours = {n: (off, ln) for n in names for rr, _, off, _, ln, _ in lay.runs[n] if rr == r}
    theirs = {n: (int(a.start), int(a.numel)) for n, a in maps[g].items() if getattr(a, "numel", 0)}
    if ours != theirs:
        bad = sorted(set(ours.items()) ^ set(theirs.items()))[:2]
        raise ShardMismatch(
            f"{f}: group {g}: param_slice_mappings disagree with param_shapes ({bad})",
            hint="model and optimizer files come from different runs",
            path=str(f),
        )


# ---- ZeRO-3 ------------------------------------------------------------------------------------------
def _zero3(
    osds: list[dict[str, Any]], files: list[Path], param_shapes: list[dict[str, Any]], ws: int
) -> tuple[_Layout, list[list[Any]], list[dict[str, Any]], list[list[int]]]:
    lay = _Layout()
    flats = _fp32_flats(osds, files, "fp32_flat_groups", len(param_shapes), "fp32 sub-group")
    subs: list[dict[str, Any]] = []
    for s, shapes in enumerate(param_shapes):
        off = 0
        for name, shp in shapes.items():
            shape = tuple(int(d) for d in shp)
            n = 1
            for d in shape:
                n *= d
            c = partition.chunk_size(n, ws)
            lay.shapes[name], lay.slot_of[name] = shape, s
            lay.runs[name] = []
            for r in range(ws):
                start, valid = partition.chunk_range(n, ws, r)
                if valid:
                    lay.runs[name].append((r, s, off, start, valid, c - valid))
            off += c
        for r in range(ws):
            if flats[r][s].numel != off:
                hint = (
                    "ZeRO-3 NVMe offload keeps the masters in offloaded_tensors/"
                    if flats[r][s].numel == 0
                    else "model and optimizer files come from different runs"
                )
                raise ShardMismatch(
                    f"{files[r]}: sub-group {s} holds {flats[r][s].numel} fp32 elements but "
                    f"param_shapes need {off} per rank (world size {ws})",
                    hint=hint,
                    path=str(files[r]),
                )
        subs.append({"params": list(shapes), "partition_numel": off})
    return lay, flats, subs, [[int(s["partition_numel"]) for s in subs] for _ in range(ws)]


# ---- model tensors: frozen params, buffers, tied -----------------------------------------------------
def _tied_from_module(module: dict[str, Any], skip: set[str]) -> dict[str, str]:
    """Old files / ZeRO-0 have no ``shared_params``: aliases share storage, offset, shape and stride."""
    seen: dict[tuple[Any, ...], str] = {}
    tied = {}
    for name, t in module.items():
        if not isinstance(t, TensorRef) or name in skip or t.numel == 0:
            continue
        k = (t.storage.key, t.offset, t.shape, t.stride)
        if k in seen:
            tied[name] = seen[k]
        else:
            seen[k] = name
    return tied


def _frozen3(models: list[dict[str, Any]], mfiles: list[Path], ws: int) -> list[TensorEntry]:
    out = []
    for name, shp in (models[0].get("frozen_param_shapes") or {}).items():
        shape = tuple(int(d) for d in shp)
        n = 1
        for d in shape:
            n *= d
        pieces = []
        for r in range(ws):
            frag = _ref(
                mfiles[r],
                f"frozen fragment {name}",
                (models[r].get("frozen_param_fragments") or {}).get(name),
            )
            c = partition.chunk_size(n, ws)
            if frag.numel != c:
                raise ShardMismatch(
                    f"{mfiles[r]}: frozen fragment {name} has {frag.numel} elements, expected {c} "
                    f"(numel {n} over {ws} ranks)",
                    path=str(mfiles[r]),
                )
            start, valid = partition.chunk_range(n, ws, r)
            if valid:
                pieces.append(Piece(frag.file, frag.byte_offset, frag.dtype, start, valid, r, c - valid))
        out.append(
            TensorEntry(name, shape, pieces[0].dtype if pieces else torch.float16, Role.FROZEN, tuple(pieces))
        )
    return out


# ---- entry point -------------------------------------------------------------------------------------
def read(path: Path, *, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
    save_dir, tag, td = resolve(Path(path), tag)
    mfiles_by_rank, ofiles_by_rank = scan(td)
    if 0 not in mfiles_by_rank:
        f0 = td / "zero_pp_rank_0_mp_rank_00_model_states.pt"
        raise ShardMismatch(f"{f0}: missing model-states file of rank 0", path=str(f0))
    m0 = _load(mfiles_by_rank[0], trust_pickle)
    if int(m0.get("mp_world_size", 1) or 1) > 1:
        raise Unsupported(
            f"{mfiles_by_rank[0]}: mp_world_size {m0['mp_world_size']}; tensor/pipeline parallel "
            "checkpoints are not supported yet",
            path=str(mfiles_by_rank[0]),
        )
    module = m0.get("module")
    if not isinstance(module, dict):
        raise Unsupported(
            f"{mfiles_by_rank[0]}: `module` is {type(module).__name__} (pipeline-parallel layer files?)",
            path=str(mfiles_by_rank[0]),
        )
    buffer_names = list(m0.get("buffer_names") or [])
    files_read = [mfiles_by_rank[0]]
    entries: list[TensorEntry] = []
    extra: dict[str, Any] = {}
    skipped: list[str] = []
    opt_groups: list[dict[str, Any]] = []
    state_names: list[str] = []
    if not ofiles_by_rank:
        stage, ws, precision = 0, int(m0.get("dp_world_size", 1) or 1), None
        if len(mfiles_by_rank) > 1:
            raise ShardMismatch(f"{td}: ZeRO-3 model-state files without optimizer files", path=str(td))
        tied = dict(m0.get("shared_params") or _tied_from_module(module, set(buffer_names)))
        from zckpt.formats._deepspeed_zero0 import read_zero0  # it imports this module's helpers

        z0 = read_zero0(mfiles_by_rank[0], m0, module, buffer_names, tied)
        entries, precision, opt_groups, state_names = z0.entries, z0.precision, z0.opt_groups, z0.state_names
        extra.update(z0.extra)
        skipped += z0.skipped
    else:
        first = ofiles_by_rank[min(ofiles_by_rank)]
        o_first = _load(first, trust_pickle)["optimizer_state_dict"]
        pc = o_first.get("partition_count")
        pcs = {int(x) for x in pc} if isinstance(pc, list) else {int(pc)}
        if len(pcs) != 1:
            raise Unsupported(
                f"{first}: param groups with different partition counts {sorted(pcs)} (MoE expert "
                "groups) are not supported yet",
                path=str(first),
            )
        ws = pcs.pop()
        check_ranks(td, ofiles_by_rank, ws, "optimizer-states", first, first.name)
        ofiles = [ofiles_by_rank[r] for r in range(ws)]
        osds = [o_first if f == first else _load(f, trust_pickle)["optimizer_state_dict"] for f in ofiles]
        for f, o in zip(ofiles, osds, strict=True):
            if o.get("partition_count") != pc:
                raise ShardMismatch(
                    f"{f}: partition_count {o.get('partition_count')} but {first.name} has {pc}",
                    hint="the file is stale from another run; move it away",
                    path=str(f),
                )
        dp = int(m0.get("dp_world_size", ws) or ws)
        if dp != ws:
            raise ShardMismatch(
                f"{mfiles_by_rank[0]}: dp_world_size {dp} but the optimizer files were partitioned "
                f"over {ws} ranks",
                hint="files from two runs are mixed",
                path=str(mfiles_by_rank[0]),
            )
        zero3 = "fp32_flat_groups" in o_first
        bf16_opt = not zero3 and "zero_stage" not in o_first
        stage = 3 if zero3 else (1 if bf16_opt else int(o_first["zero_stage"]))
        models = [m0]
        if zero3:
            check_ranks(td, mfiles_by_rank, ws, "model-states", first, mfiles_by_rank[0].name)
            models += [_load(mfiles_by_rank[r], trust_pickle) for r in range(1, ws)]
            files_read = [mfiles_by_rank[r] for r in range(ws)]
        elif len(mfiles_by_rank) != 1:
            raise ShardMismatch(
                f"{td}: ZeRO-{stage} checkpoint with per-rank model-state files",
                hint="files from a ZeRO-3 run are mixed in",
                path=str(td),
            )
        files_read += ofiles
        param_shapes = m0.get("param_shapes")
        if isinstance(param_shapes, dict):
            param_shapes = [param_shapes]
        if not isinstance(param_shapes, list):
            raise Unsupported(
                f"{mfiles_by_rank[0]}: no param_shapes (DeepSpeed < 0.6.0 checkpoint)",
                path=str(mfiles_by_rank[0]),
            )
        if zero3:
            lay, flats, subs, sizes = _zero3(osds, ofiles, param_shapes, ws)
            base = [o.get("optimizer_state_dict") or {} for o in osds]
            extra["sub_groups"] = subs
        else:
            lay, flats, subs, sizes = _zero12(osds, ofiles, param_shapes, ws, bf16_opt)
            base = [o.get("base_optimizer_state") or {} for o in osds]
            if not all(isinstance(b, dict) for b in base):
                raise Unsupported(
                    f"{first}: elastic ZeRO checkpoint (list-shaped base_optimizer_state)", path=str(first)
                )
        sp = m0.get("shared_params")
        tied = dict(sp) if isinstance(sp, dict) else _tied_from_module(module, set(buffer_names))
        precision = "fp32"
        for name in lay.shapes:
            t = module.get(name)
            if isinstance(t, TensorRef):
                precision = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype_name(t.dtype), "fp32")
                break
        entries += _param_entries(lay, flats, Role.PARAM, None)
        opt_entries, state_names = _optim_entries(
            lay, [dict(b.get("state") or {}) for b in base], sizes, ofiles, skipped
        )
        # frozen params (stage 1: only `module` has them; stage 2: full fragments; stage 3: per-rank chunks)
        frozen_shapes = m0.get("frozen_param_shapes") or {}
        if zero3:
            entries += _frozen3(models, files_read[:ws], ws)
        elif frozen_shapes:
            frags = m0.get("frozen_param_fragments") or {}
            for name, shp in frozen_shapes.items():
                ref = _ref(mfiles_by_rank[0], f"frozen fragment {name}", frags.get(name, module.get(name)))
                entries.append(_whole(name, ref, Role.FROZEN, tuple(int(d) for d in shp)))
        else:
            for name, t in module.items():
                if name not in lay.shapes and name not in tied and name not in buffer_names:
                    entries.append(_whole(name, _ref(mfiles_by_rank[0], f"module[{name!r}]", t), Role.FROZEN))
        entries += opt_entries
        opt_groups = [dict(pg) for pg in base[0].get("param_groups", [])]
        by_slot: dict[int, list[str]] = {}
        for name, slot in lay.slot_of.items():
            by_slot.setdefault(slot, []).append(name)
        for pg in opt_groups:
            pg["params"] = [n for s in pg.get("params", []) for n in by_slot.get(int(s), [])]
        extra["param_groups"] = (
            subs
            if not zero3
            else [{"sub_groups": list(pg.get("params", []))} for pg in base[0].get("param_groups", [])]
        )
        extra["loss_scaler"] = _jsonable(o_first.get("loss_scaler"))
        extra["dynamic_loss_scale"] = o_first.get("dynamic_loss_scale")
        extra["clip_grad"] = _jsonable(o_first.get("clip_grad"))
        extra["bf16_optimizer"] = bf16_opt
    for name in buffer_names:
        if name in module:
            entries.append(_whole(name, _ref(mfiles_by_rank[0], f"buffer {name}", module[name]), Role.BUFFER))
    kind = (
        (m0.get("ds_config") or {}).get("optimizer", {}).get("type")
        if isinstance(m0.get("ds_config"), dict)
        else None
    )
    if not kind:
        adam = {"exp_avg", "exp_avg_sq"} <= set(state_names)
        decoupled = any(pg.get("decoupled_weight_decay") for pg in opt_groups)
        kind = (
            ("AdamW-like" if decoupled else "Adam-like")
            if adam
            else "SGD-like"
            if "momentum_buffer" in state_names
            else "torch"
        )
    groups = tuple(
        {k: _jsonable(v) for k, v in pg.items() if not isinstance(v, TensorRef)} for pg in opt_groups
    )
    extra.update(
        {
            "ds_version": m0.get("ds_version"),
            "lr_scheduler": _jsonable(m0.get("lr_scheduler")),
            "skipped_steps": m0.get("skipped_steps"),
            "global_samples": m0.get("global_samples"),
            "buffer_names": buffer_names,
            "client_state": {k: _jsonable(v) for k, v in m0.items() if k not in _KNOWN_KEYS},
        }
    )
    if skipped:
        extra["skipped_states"] = skipped
    meta = CheckpointMeta(
        format=NAME,
        path=str(save_dir),
        world_size=ws,
        stage=stage,
        tag=tag,
        step=m0.get("global_steps"),
        precision=precision,
        optimizer=OptimizerInfo(str(kind), groups, tuple(state_names)) if opt_groups else None,
        tied=tied,
        config=_jsonable(m0.get("ds_config")),
        files=tuple(str(f) for f in files_read),
        extra=extra,
    )
    return Checkpoint(meta, entries)
