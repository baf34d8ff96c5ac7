"""Writer of DeepSpeed ZeRO-1/2/3 checkpoints at any data-parallel world size (never imports deepspeed).

Owns the layouts DeepSpeed's own ``load_checkpoint`` reads without universal conversion
(../shared/docs/deepspeed-format.md §2–§4), rebuilt for a new world size from any ``Checkpoint``:

- ZeRO-1/2: per param group, the flat fp32 group padded to a multiple of ``2 * world`` and cut into
  ``world`` equal slices; each rank file holds its slice with the padding stripped
  (``single_partition_of_fp32_groups``, ``group_paddings``), the inner optimizer's state with the
  *padded* slice length, ``param_slice_mappings`` (``fragment_address``), ``partition_count`` and the
  ``ZeroStageEnum``/loss-scaler objects; one ``mp_rank_00_model_states.pt`` with the 16-bit module.
- ZeRO-3: every param cut on its own into ``ceil(n/world)`` chunks; sub-groups re-formed with
  DeepSpeed's rule (cut when the running sum of partition sizes reaches ``sub_group_size``); per rank a
  model-states file (size-0 params, full buffers, re-chunked ``frozen_param_fragments``) and an optim
  file (``fp32_flat_groups`` + the inner optimizer's per-sub-group state).

Tensor bytes are streamed from the source entries (``zckpt.io.flat``) into ``zckpt.io.torchzip_write``
archives, one storage at a time. What the writer needs besides tensors comes from a ``DsTemplate``:
taken verbatim from the source files when the source is DeepSpeed, synthesised otherwise.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zckpt import partition
from zckpt.checkpoint import Checkpoint
from zckpt.errors import Unsupported
from zckpt.io.flat import FlatSource, Segment, chunk_of, source, whole
from zckpt.io.outputs import HashingSink
from zckpt.io.pickle_safe import LossScaler, TensorRef, ZeroStageEnum, _Record, fragment_address
from zckpt.io.torchzip_write import StorageSlot, TensorSlot, TorchZipWriter, dumps
from zckpt.model import Role, TensorEntry, parse_dtype

LP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DS_VERSION = "0.19.8"


# ---- pure layout math ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Zero12Rank:
    """One rank's slice of one ZeRO-1/2 flat group."""

    partition_size: int  # padded slice length (same on every rank)
    valid: int  # slice length without the trailing group padding
    runs: tuple[tuple[int, int, int, int], ...]  # (param index, offset in param, offset in slice, length)

    @property
    def padding(self) -> int:
        return self.partition_size - self.valid


def zero12_layout(numels: list[int], world: int) -> list[Zero12Rank]:
    """Per-rank slices of a flat group of params with ``numels`` at ``world`` (alignment ``2*world``)."""
    total = sum(numels)
    part = partition.group_partition_size(total, world)
    runs: list[list[tuple[int, int, int, int]]] = [[] for _ in range(world)]
    off = 0
    for k, n in enumerate(numels):
        for o in partition.overlaps(off, n, part, world):
            runs[o.rank].append((k, o.offset_in_segment, o.offset_in_partition, o.length))
        off += n
    return [Zero12Rank(part, max(0, min(part, total - r * part)), tuple(runs[r])) for r in range(world)]


def zero3_sub_groups(numels: list[int], world: int, sub_group_size: int | None) -> list[list[int]]:
    """DeepSpeed's ``_create_fp16_sub_groups``: indices of each sub-group of one param group."""
    sizes = [partition.chunk_size(n, world) for n in numels]
    if not numels:
        return []
    if sub_group_size is None or sub_group_size >= sum(sizes):
        return [list(range(len(numels)))]
    out: list[list[int]] = []
    cur: list[int] = []
    acc = 0
    for k, s in enumerate(sizes):
        cur.append(k)
        acc += s
        if acc >= sub_group_size or k == len(sizes) - 1:
            out.append(cur)
            cur, acc = [], 0
    return out


def adjust_batch(cfg: dict[str, Any], old_world: int, new_world: int) -> tuple[dict[str, Any], str | None]:
    """``ds_config`` for the new world: keep the global batch (``train_batch_size``) and
    ``gradient_accumulation_steps``, recompute the micro batch when it divides; otherwise keep the micro
    batch and let the global batch change (returned note says so)."""
    cfg = copy.deepcopy(cfg)
    micro = cfg.get("train_micro_batch_size_per_gpu")
    gas = int(cfg.get("gradient_accumulation_steps") or 1)
    tbs = cfg.get("train_batch_size")
    if tbs is None and micro is not None:
        tbs = int(micro) * gas * old_world
    if tbs is None:
        return cfg, None
    note = None
    if int(tbs) % (gas * new_world) == 0:
        new_micro = int(tbs) // (gas * new_world)
    else:
        new_micro = int(micro) if micro is not None else max(1, int(tbs) // (gas * old_world))
        new_tbs = new_micro * gas * new_world
        note = (
            f"global batch {tbs} is not divisible by gradient_accumulation_steps {gas} x world {new_world}; "
            f"kept micro batch {new_micro}, global batch becomes {new_tbs}"
        )
        tbs = new_tbs
    if "train_micro_batch_size_per_gpu" in cfg or "train_batch_size" not in cfg:
        cfg["train_micro_batch_size_per_gpu"] = new_micro
    if "train_batch_size" in cfg:
        cfg["train_batch_size"] = int(tbs)
    return cfg, note


# ---- what the writer needs besides tensors ------------------------------------------------------
@dataclass
class DsTemplate:
    """Non-tensor state of a DeepSpeed checkpoint, in DeepSpeed's own shapes."""

    precision: str  # bf16 | fp16 | fp32
    module_order: list[str]  # state-dict key order: params, frozen, buffers, aliases
    group_params: list[list[str]]  # trainable names per optimizer param group, flat order
    group_hparams: list[dict[str, Any]]  # param_groups without "params"
    top: dict[str, Any]  # model-states keys other than the layout ones (scheduler, steps, client_state...)
    loss_scaler: Any = field(default_factory=lambda: _loss_scaler_default())
    dynamic_loss_scale: bool = False
    overflow: bool = False
    clip_grad: float = 0.0
    ds_version: str = DS_VERSION
    sub_group_size: int | None = None


def _loss_scaler_default() -> LossScaler:
    ls = LossScaler()
    ls.__dict__.update(cur_scale=1.0, dynamic=False)
    return ls


_LAYOUT_KEYS = frozenset(
    ["module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params"]
    + ["frozen_param_fragments", "dp_world_size"]
)


def template_from_deepspeed(ckpt: Checkpoint, *, trust_pickle: bool = False) -> DsTemplate:
    """Everything non-tensor from a DeepSpeed source, verbatim (rank 0's model and optim files)."""
    from zckpt.io.torchzip import load_refs

    files = [Path(f) for f in ckpt.meta.files]
    mfile = next(f for f in files if f.name.endswith("_model_states.pt"))
    ofiles = [f for f in files if f.name.endswith("_optim_states.pt")]
    if not ofiles:
        raise Unsupported(
            f"{mfile}: ZeRO-0 checkpoint (no optimizer partitions); only ZeRO-1/2/3 can be written"
        )
    m0 = load_refs(str(mfile), trust_pickle=trust_pickle)
    o0 = load_refs(str(ofiles[0]), trust_pickle=trust_pickle)["optimizer_state_dict"]
    inner = o0.get("optimizer_state_dict") if "fp32_flat_groups" in o0 else o0.get("base_optimizer_state")
    hparams = [{k: v for k, v in pg.items() if k != "params"} for pg in (inner or {}).get("param_groups", [])]
    opt = ckpt.meta.optimizer
    groups = [list(pg.get("params", [])) for pg in (opt.param_groups if opt else ())]
    cfg = m0.get("ds_config") or {}
    sgs = (cfg.get("zero_optimization") or {}).get("sub_group_size") if isinstance(cfg, dict) else None
    return DsTemplate(
        precision=ckpt.meta.precision or "fp32",
        module_order=list(m0["module"]),
        group_params=groups,
        group_hparams=hparams,
        top={k: v for k, v in m0.items() if k not in _LAYOUT_KEYS},
        loss_scaler=o0.get("loss_scaler", _loss_scaler_default()),
        dynamic_loss_scale=bool(o0.get("dynamic_loss_scale", False)),
        overflow=bool(o0.get("overflow", False)),
        clip_grad=float(o0.get("clip_grad", (cfg or {}).get("gradient_clipping", 0.0)) or 0.0),
        ds_version=str(m0.get("ds_version") or DS_VERSION),
        sub_group_size=int(sgs) if sgs else None,
    )


def template_from_native(ckpt: Checkpoint) -> DsTemplate:
    """DeepSpeed metadata synthesised from a native (engine) checkpoint: its config is DeepSpeed-shaped."""
    from zckpt.formats import native
    from zckpt.io.pickle_safe import DynamicLossScaler

    extra = ckpt.meta.extra
    opt = ckpt.meta.optimizer
    if opt is None:
        raise Unsupported(f"{ckpt.meta.path}: no optimizer recorded; DeepSpeed ZeRO files need one")
    groups = [list(pg.get("params", [])) for pg in opt.param_groups]
    hparams = [
        {k: (tuple(v) if k == "betas" and isinstance(v, list) else v) for k, v in pg.items() if k != "params"}
        for pg in opt.param_groups
    ]
    cfg = copy.deepcopy(dict(ckpt.meta.config or {}))
    sd = dict(extra.get("loss_scaler") or {})
    if sd.get("dynamic"):
        ls: Any = DynamicLossScaler()
        ls.__dict__.update(sd)
        dt = sd.get("dtype")
        ls.dtype = (
            parse_dtype(dt)
            if isinstance(dt, str)
            else LP_DTYPES.get(ckpt.meta.precision or "", torch.float16)
        )
    else:
        ls = _loss_scaler_default()
        ls.__dict__.update(cur_scale=float(sd.get("cur_scale", 1.0)), dynamic=False)
    counters = dict(extra.get("counters") or {})
    rank0 = Path(ckpt.meta.files[0])

    def join(o: Any) -> Any:
        if isinstance(o, dict):
            if set(o) == {"__tensor__"}:
                return native.read_rank_tensor(rank0, o["__tensor__"])
            return {k: join(v) for k, v in o.items()}
        if isinstance(o, list):
            return [join(v) for v in o]
        return o

    top: dict[str, Any] = {
        "lr_scheduler": extra.get("scheduler"),
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": int(counters.get("skipped_steps", 0)),
        "global_steps": int(counters.get("global_steps", 0)),
        "global_samples": int(counters.get("global_samples", 0)),
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": cfg,
        "ds_version": DS_VERSION,
    }
    for k, v in (join(extra.get("client_state")) or {}).items():
        top.setdefault(k, v)
    zc = cfg.get("zero_optimization") or {}
    tied = dict(ckpt.meta.tied)
    return DsTemplate(
        precision=ckpt.meta.precision or "fp32",
        module_order=[e.name for e in ckpt.model_entries()] + list(tied),
        group_params=groups,
        group_hparams=hparams,
        top=top,
        loss_scaler=ls,
        dynamic_loss_scale=bool(sd.get("dynamic", False)),
        overflow=False,
        clip_grad=float(cfg.get("gradient_clipping", 0.0) or 0.0),
        sub_group_size=int(zc["sub_group_size"]) if zc.get("sub_group_size") else None,
    )


# ---- torch-zip files built from lazy tensors -----------------------------------------------------
class _File:
    """One torch.save archive: ``tensor()`` registers a lazy storage; ``save()`` streams it out."""

    def __init__(self) -> None:
        self.storages: list[tuple[StorageSlot, FlatSource]] = []
        self._refs: dict[tuple[str, str], StorageSlot] = {}

    def tensor(
        self, src: FlatSource, shape: tuple[int, ...] | None = None, requires_grad: bool = False
    ) -> TensorSlot:
        slot = StorageSlot(str(len(self.storages)), src.dtype, src.numel)
        self.storages.append((slot, src))
        shp = (src.numel,) if shape is None else tuple(shape)
        return TensorSlot(slot, shp, 0, requires_grad)

    def scalar(self, t: torch.Tensor) -> TensorSlot:
        from zckpt.io.outputs import entry_from_tensor

        e = entry_from_tensor("scalar", t)
        return self.tensor(whole(e), tuple(t.shape))

    def convert(self, obj: Any) -> Any:
        """A copy of a pickled source object with every ``TensorRef`` (or in-memory tensor) turned into a
        lazy tensor."""
        if isinstance(obj, torch.Tensor):
            return self.scalar(obj.detach().cpu().contiguous())
        if isinstance(obj, TensorRef):
            key = (obj.file, obj.storage.key)
            slot = self._refs.get(key)
            if slot is None:
                from zckpt.model import Piece

                base = obj.byte_offset - obj.offset * obj.dtype.itemsize
                e = TensorEntry(
                    "ref",
                    (obj.storage.numel,),
                    obj.dtype,
                    Role.BUFFER,
                    (Piece(obj.file, base, obj.dtype, 0, obj.storage.numel),),
                )
                slot = StorageSlot(str(len(self.storages)), obj.dtype, obj.storage.numel)
                self.storages.append((slot, whole(e)))
                self._refs[key] = slot
            if not obj.is_contiguous:
                raise Unsupported(f"{obj.file}: non-contiguous tensor in pickled state cannot be copied")
            return TensorSlot(slot, tuple(obj.shape), obj.offset, obj.requires_grad)
        if isinstance(obj, OrderedDict):
            return OrderedDict((k, self.convert(v)) for k, v in obj.items())
        if isinstance(obj, dict):
            return {k: self.convert(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.convert(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self.convert(v) for v in obj)
        if isinstance(obj, _Record):
            new = copy.copy(obj)
            new.__dict__ = {k: self.convert(v) for k, v in obj.__dict__.items()}
            return new
        return obj

    def save(self, path: Path, obj: Any) -> int:
        sink = HashingSink(path)
        try:
            w = TorchZipWriter(sink, prefix=path.stem)
            w.write_header_records(dumps(obj))
            for slot, src in self.storages:
                w.write_record(f"data/{slot.key}", src.chunks(), src.nbytes)
            w.close()
        finally:
            sink.close()
        sink.write_sidecar()
        return sum(s.nbytes for _, s in self.storages)


# ---- the writer ----------------------------------------------------------------------------------
def _scalar_state(e: TensorEntry) -> torch.Tensor:
    from zckpt.io.flat import read_range

    return read_range(e, 0, 1).reshape(())


def write_deepspeed(
    ckpt: Checkpoint,
    tag_dir: Path,
    *,
    world: int,
    stage: int,
    tmpl: DsTemplate,
    on_file: Callable[[str, int], None] | None = None,
    part: tuple[int, int] = (0, 1),
) -> list[str]:
    """Write ``ckpt`` as a DeepSpeed ZeRO-``stage`` checkpoint for ``world`` ranks into ``tag_dir``.

    Returns notes for the caller (batch-size changes, dropped states). ``on_file(name, nbytes)`` is
    called after each file (progress). ``part=(i, n)``: write only ranks ``i::n``'s files, and the
    files all ranks share only when ``i`` is 0 (process ``i`` of ``n`` in a distributed reshard)."""
    if stage not in (1, 2, 3):
        raise Unsupported(f"cannot write DeepSpeed ZeRO stage {stage}; stages 1, 2 and 3 are supported")
    if ckpt.meta.format == "deepspeed" and ckpt.meta.extra.get("bf16_optimizer"):
        raise Unsupported(
            f"{ckpt.meta.path}: BF16_Optimizer checkpoints (bf16 + ZeRO-1 + fp32 grad accumulation) "
            "cannot be written back as DeepSpeed files yet",
            hint="reshard to the native format instead (--to native)",
        )
    tag_dir.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    ents = ckpt.entries
    tied = dict(ckpt.meta.tied)
    groups = [[n for n in g if n in ents and ents[n].role is Role.PARAM] for g in tmpl.group_params]
    grouped = {n for g in groups for n in g}
    missing = [e.name for e in ckpt.model_entries() if e.role is Role.PARAM and e.name not in grouped]
    if missing:
        raise Unsupported(
            f"{ckpt.meta.path}: params {missing[:3]} belong to no optimizer param group",
            hint="the source records no optimizer; DeepSpeed files need one",
        )
    state_names = list(ckpt.meta.optimizer.state_names) if ckpt.meta.optimizer else []
    lp = LP_DTYPES.get(tmpl.precision, torch.float32)
    old_world = ckpt.meta.world_size
    cfg = tmpl.top.get("ds_config")
    if isinstance(cfg, dict):
        cfg, note = adjust_batch(cfg, old_world, world)
        cfg.setdefault("zero_optimization", {})["stage"] = stage
        if note:
            notes.append(note)
    top = dict(tmpl.top)
    top["ds_config"] = cfg
    buffers = [e.name for e in ckpt.model_entries() if e.role is Role.BUFFER]
    frozen = [e.name for e in ckpt.model_entries() if e.role is Role.FROZEN]
    order = [n for n in tmpl.module_order if n in ents or n in tied]
    order += [n for n in list(ents) + list(tied) if n not in order and (n in tied or ents[n].role.is_model)]
    prefix = "bf16_" if tmpl.precision == "bf16" else ""

    def group_state(
        names: list[str], runs_of: Callable[[str], list[Segment]], total: int, f: _File
    ) -> dict[str, Any]:
        st: dict[str, Any] = {}
        for s in state_names:
            es = [ents.get(f"{n}:{s}") for n in names]
            if not names or any(e is None for e in es):
                if any(e is not None for e in es):
                    notes.append(f"optimizer state {s!r} exists for only some params of a group; dropped")
                continue
            if all(e.shape == ents[n].shape for e, n in zip(es, names, strict=True)):  # type: ignore[union-attr]
                segs = [seg for n in names for seg in runs_of(f"{n}:{s}")]
                st[s] = f.tensor(
                    source(torch.float32, segs + [Segment(None, 0, total - sum(x.numel for x in segs))])
                )
            elif all(e.numel == 1 for e in es):  # type: ignore[union-attr]
                st[s] = f.scalar(_scalar_state(es[0]))  # type: ignore[arg-type]
            else:
                notes.append(f"optimizer state {s!r} is neither per-element nor a scalar; dropped")
        return st

    def model_file(f: _File, rank: int, param_shapes: list[OrderedDict[str, torch.Size]]) -> dict[str, Any]:
        module: OrderedDict[str, Any] = OrderedDict()
        slots: dict[str, TensorSlot] = {}
        for n in order:
            e = ents[tied.get(n, n)]
            if e.role is Role.BUFFER:
                module[n] = f.tensor(whole(e), e.shape)
            elif stage == 3:
                dt = lp if e.role is Role.PARAM else e.dtype
                module[n] = f.tensor(source(dt, []), (0,))
            else:
                if e.name not in slots:
                    dt = lp if e.role is Role.PARAM else e.dtype
                    slots[e.name] = f.tensor(whole(e, dt), e.shape)
                module[n] = slots[e.name]
        frozen_shapes = OrderedDict((n, torch.Size(ents[n].shape)) for n in frozen)
        frags: OrderedDict[str, Any] = OrderedDict()
        for n in frozen:
            frags[n] = f.tensor(chunk_of(ents[n], world, rank)) if stage == 3 else module[n]
        out: dict[str, Any] = {
            "module": module,
            "buffer_names": buffers,
            "optimizer": None,
            "param_shapes": param_shapes,
            "frozen_param_shapes": frozen_shapes if stage >= 2 else None,
            "shared_params": dict(tied) if rank == 0 else {},
            "frozen_param_fragments": frags if stage >= 2 else None,
        }
        for k, v in top.items():
            out[k] = f.convert(v)
        out["dp_world_size"] = world
        return out

    def emit(f: _File, name: str, obj: Any) -> None:
        n = f.save(tag_dir / name, obj)
        if on_file is not None:
            on_file(name, n)

    if stage in (1, 2):
        shapes = [OrderedDict((n, torch.Size(ents[n].shape)) for n in g) for g in groups]
        lays = [zero12_layout([ents[n].numel for n in g], world) for g in groups]
        for r in range(part[0], world, part[1]):
            f = _File()
            fp32, states, pads, maps = [], {}, [], []
            for gi, g in enumerate(groups):
                lay = lays[gi][r]

                def runs_of(key: str, g: list[str] = g, lay: Zero12Rank = lay) -> list[Segment]:
                    name = key.split(":")[0]
                    k = g.index(name)
                    return [Segment(ents[key], a, a + ln) for (pk, a, _, ln) in lay.runs if pk == k]

                segs = [Segment(ents[g[k]], a, a + ln) for (k, a, _, ln) in lay.runs]
                fp32.append(f.tensor(source(torch.float32, segs), requires_grad=True))
                states[gi] = group_state(g, runs_of, lay.partition_size, f)
                pads.append(lay.padding)
                maps.append(
                    OrderedDict((g[k], fragment_address(numel=ln, start=off)) for (k, _, off, ln) in lay.runs)
                )
            pgs = [{**copy.deepcopy(h), "params": [gi]} for gi, h in enumerate(tmpl.group_hparams)]
            osd = {
                "loss_scaler": tmpl.loss_scaler,
                "dynamic_loss_scale": tmpl.dynamic_loss_scale,
                "overflow": tmpl.overflow,
                "clip_grad": tmpl.clip_grad,
                "base_optimizer_state": {"state": states, "param_groups": pgs},
                "single_partition_of_fp32_groups": fp32,
                "zero_stage": ZeroStageEnum(stage),
                "group_paddings": pads,
                "param_alignment_paddings": [[0] * len(g) for g in groups],
                "partition_count": [world] * len(groups),
                "ds_version": tmpl.ds_version,
                "param_slice_mappings": maps,
            }
            emit(
                f,
                f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
                {"optimizer_state_dict": osd, "ds_config": f.convert(cfg), "ds_version": tmpl.ds_version},
            )
        if part[0] == 0:
            f = _File()
            emit(f, "mp_rank_00_model_states.pt", model_file(f, 0, shapes))
        return notes

    # ZeRO-3
    subs: list[tuple[int, list[str]]] = []
    for gi, g in enumerate(groups):
        for idx in zero3_sub_groups([ents[n].numel for n in g], world, tmpl.sub_group_size):
            subs.append((gi, [g[k] for k in idx]))
    shapes = [OrderedDict((n, torch.Size(ents[n].shape)) for n in names) for _, names in subs]
    for r in range(part[0], world, part[1]):
        f = _File()
        flats, states = [], {}
        for si, (_gi, names) in enumerate(subs):

            def runs_of3(key: str, r: int = r) -> list[Segment]:
                return list(chunk_of(ents[key], world, r, torch.float32).segments)

            segs = [seg for n in names for seg in chunk_of(ents[n], world, r, torch.float32).segments]
            total = sum(partition.chunk_size(ents[n].numel, world) for n in names)
            flats.append(f.tensor(source(torch.float32, segs), requires_grad=True))
            if flats[-1].storage.numel != total:
                raise AssertionError("sub-group length mismatch")
            states[si] = group_state(names, runs_of3, total, f)
        pgs = [
            {**copy.deepcopy(h), "params": [si for si, (g2, _) in enumerate(subs) if g2 == gi]}
            for gi, h in enumerate(tmpl.group_hparams)
        ]
        osd = {
            "zero_stage": ZeroStageEnum.weights,
            "loss_scaler": tmpl.loss_scaler,
            "dynamic_loss_scale": tmpl.dynamic_loss_scale,
            "overflow": tmpl.overflow,
            "partition_count": world,
            "optimizer_state_dict": {"state": states, "param_groups": pgs},
            "fp32_flat_groups": flats,
        }
        emit(
            f,
            f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
            {"optimizer_state_dict": osd, "ds_config": f.convert(cfg), "ds_version": tmpl.ds_version},
        )
        f = _File()
        emit(f, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", model_file(f, r, shapes))
    return notes


__all__ = [
    "DsTemplate",
    "adjust_batch",
    "template_from_deepspeed",
    "write_deepspeed",
    "zero12_layout",
    "zero3_sub_groups",
]
