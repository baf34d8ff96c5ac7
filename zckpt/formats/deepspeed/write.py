"""Writer of DeepSpeed ZeRO-1/2/3 checkpoints at any data-parallel world size (never imports deepspeed).

Writes the layouts DeepSpeed's own ``load_checkpoint`` reads without universal conversion, rebuilt for a
new world size from any ``Checkpoint`` and its ``TrainingState`` (``layout`` has the math):

- ZeRO-1/2: per param group, the flat fp32 group padded to a multiple of ``2 * world`` and cut into
  ``world`` equal slices; each rank file holds its slice with the padding stripped
  (``single_partition_of_fp32_groups``, ``group_paddings``), the inner optimizer's state with the
  *padded* slice length, ``param_slice_mappings``, ``partition_count`` and the ``ZeroStageEnum``/
  loss-scaler objects; one ``mp_rank_00_model_states.pt`` with the 16-bit module (written by ``finish``).
- ZeRO-3: every param cut on its own into ``ceil(n/world)`` chunks; sub-groups re-formed with
  DeepSpeed's rule; per rank a model-states file (size-0 params, full buffers, re-chunked
  ``frozen_param_fragments``) and an optim file (``fp32_flat_groups`` + the inner optimizer's state).

Tensor bytes stream from the source entries into ``archive.Archive``s, one storage at a time.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zckpt import dtypes, partition
from zckpt.checkpoint import Checkpoint
from zckpt.codecs.pickle_safe import DynamicLossScaler, LossScaler, ZeroStageEnum, fragment_address
from zckpt.codecs.safetensors import FileRecord
from zckpt.errors import Unsupported
from zckpt.formats._latest import write_latest
from zckpt.formats.base import CheckpointWriter, OnFile, WritePlan
from zckpt.formats.deepspeed.archive import Archive
from zckpt.formats.deepspeed.layout import Zero12Rank, adjust_batch, zero3_sub_groups, zero12_layout
from zckpt.model import PRECISIONS, Role, TensorEntry, parse_dtype
from zckpt.state import TrainingState
from zckpt.stream.flat import Segment, chunk_of, source, whole
from zckpt.stream.spans import read_range

DS_VERSION = "0.19.8"


def _loss_scaler(sd: dict[str, Any], precision: str) -> LossScaler | DynamicLossScaler:
    """DeepSpeed's loss-scaler object from its attributes (``TrainingState.loss_scaler``)."""
    if sd.get("dynamic"):
        ls: Any = DynamicLossScaler()
        ls.__dict__.update(sd)
        dt = sd.get("dtype")
        ls.dtype = parse_dtype(dt) if isinstance(dt, str) else PRECISIONS.get(precision, torch.float16)
        return ls
    plain = LossScaler()
    plain.__dict__.update(cur_scale=float(sd.get("cur_scale", 1.0)), dynamic=False)
    return plain


@dataclass(frozen=True)
class Template:
    """What the writer needs besides tensors, in DeepSpeed's own shapes, from the ``TrainingState``."""

    precision: str
    module_order: list[str]
    group_params: list[list[str]]
    group_hparams: list[dict[str, Any]]
    top: dict[str, Any]
    """Model-states keys besides the layout (scheduler, counters, config, client state...)."""
    loss_scaler: Any
    dynamic_loss_scale: bool
    overflow: bool
    clip_grad: float
    ds_version: str
    sub_group_size: int | None


def template(ckpt: Checkpoint) -> Template:
    st: TrainingState = ckpt.meta.state
    ds = st.private("deepspeed")
    if st.optimizer is None:
        raise Unsupported(
            f"{ckpt.meta.path}: no optimizer recorded; DeepSpeed ZeRO files need one",
            hint="reshard to the native format instead (--to native)",
        )
    if ds.get("bf16_optimizer"):
        raise Unsupported(
            f"{ckpt.meta.path}: BF16_Optimizer checkpoints (bf16 + ZeRO-1 + fp32 grad "
            "accumulation) cannot be written back as DeepSpeed files yet",
            hint="reshard to the native format instead (--to native)",
        )
    precision = st.precision or "fp32"
    cfg = copy.deepcopy(dict(st.config or {}))
    c = st.counters
    top: dict[str, Any] = {
        "lr_scheduler": st.scheduler,
        "data_sampler": None,
        "random_ltd": None,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
    }
    top.update(ds.get("top") or {})
    top.update(
        skipped_steps=c.skipped_steps or 0,
        global_steps=c.global_steps or 0,
        mp_world_size=1,
        ds_config=cfg,
        ds_version=str(ds.get("ds_version") or DS_VERSION),
    )
    if c.global_samples is not None:
        top["global_samples"] = c.global_samples
    for k, v in st.client_state.items():
        top.setdefault(k, v)
    sd = dict(st.loss_scaler or {})
    exact = ds.get("group_exact") or []  # hyper-parameters in their saved Python types (DeepSpeed sources)
    zc = cfg.get("zero_optimization") or {}
    sgs = zc.get("sub_group_size") if isinstance(zc, dict) else None
    return Template(
        precision=precision,
        module_order=list(
            ds.get("module_order") or [e.name for e in ckpt.model_entries()] + list(ckpt.meta.tied)
        ),
        group_params=[list(g.params) for g in st.optimizer.groups],
        group_hparams=[
            {k: (tuple(v) if k == "betas" and isinstance(v, list) else v) for k, v in g.options.items()}
            | (exact[i] if len(exact) == len(st.optimizer.groups) else {})
            for i, g in enumerate(st.optimizer.groups)
        ],
        top=top,
        loss_scaler=_loss_scaler(sd, precision),
        dynamic_loss_scale=bool(ds.get("dynamic_loss_scale", sd.get("dynamic", False))),
        overflow=bool(ds.get("overflow", False)),
        clip_grad=float(ds.get("clip_grad") or cfg.get("gradient_clipping", 0.0) or 0.0),
        ds_version=str(ds.get("ds_version") or DS_VERSION),
        sub_group_size=int(sgs) if isinstance(sgs, (int, float)) and sgs else None,
    )


@dataclass(frozen=True)
class DsPlan(WritePlan):
    """``groups``: trainable names per param group; ``subs``: ZeRO-3 (group, names) sub-groups."""

    tmpl: Template | None = None
    groups: tuple[tuple[str, ...], ...] = ()
    subs: tuple[tuple[int, tuple[str, ...]], ...] = ()
    states: tuple[str, ...] = ()
    cfg: Any = None


def _plan_states(ckpt: Checkpoint, groups: list[list[str]]) -> tuple[list[str], list[str]]:
    """The optimizer states written for every group, and notes on those dropped."""
    ents = ckpt.entries
    names = list(ckpt.meta.state.optimizer.state_names) if ckpt.meta.state.optimizer else []
    kept, notes = [], []
    for s in names:
        es = [ents.get(f"{n}:{s}") for g in groups for n in g]
        if not es or all(e is None for e in es):
            continue
        if any(e is None for e in es):
            notes.append(f"optimizer state {s!r} exists for only some params; dropped")
        elif all(e.shape == ents[e.name].shape for e in es if e) or all(e.numel == 1 for e in es if e):
            kept.append(s)
        else:
            notes.append(f"optimizer state {s!r} is neither per-element nor a scalar; dropped")
    return kept, notes


class DeepSpeedWriter(CheckpointWriter):
    """``zckpt reshard --to deepspeed``: ``<out>/<tag>/*_states.pt`` and ``<out>/latest``."""

    def plan(self, ckpt: Checkpoint, *, world: int, stage: int | None, tag: str) -> WritePlan:
        src = ckpt.meta.state.stage
        out_stage = (src if src in (1, 2, 3) else 3) if stage is None else stage
        if out_stage not in (1, 2, 3):
            raise Unsupported(f"cannot write DeepSpeed ZeRO stage {out_stage}", hint="pass --stage 1, 2 or 3")
        tmpl = template(ckpt)
        ents = ckpt.entries
        groups = [[n for n in g if n in ents and ents[n].role is Role.PARAM] for g in tmpl.group_params]
        grouped = {n for g in groups for n in g}
        missing = [e.name for e in ckpt.model_entries() if e.role is Role.PARAM and e.name not in grouped]
        if missing:
            raise Unsupported(
                f"{ckpt.meta.path}: params {missing[:3]} belong to no optimizer param group",
                hint="the source records no optimizer; DeepSpeed files need one",
            )
        states, notes = _plan_states(ckpt, groups)
        cfg = tmpl.top.get("ds_config")
        if isinstance(cfg, dict):
            cfg, note = adjust_batch(cfg, ckpt.meta.world_size, world)
            z = cfg.get("zero_optimization")  # an object, or a legacy boolean (``true``: ZeRO on)
            cfg["zero_optimization"] = {**(z if isinstance(z, dict) else {}), "stage": out_stage}
            notes += [note] if note else []
        subs = [
            (gi, tuple(g[k] for k in idx))
            for gi, g in enumerate(groups)
            for idx in zero3_sub_groups([ents[n].numel for n in g], world, tmpl.sub_group_size)
        ]
        return DsPlan(
            world=world,
            stage=out_stage,
            tag=tag,
            units=world,
            notes=tuple(notes),
            digest=(len(groups), len(subs), tuple(states)),
            tmpl=tmpl,
            groups=tuple(tuple(g) for g in groups),
            subs=tuple(subs) if out_stage == 3 else (),
            states=tuple(states),
            cfg=cfg,
        )

    def write_unit(
        self, ckpt: Checkpoint, plan: WritePlan, out: Path, unit: int, on_file: OnFile
    ) -> list[FileRecord]:
        assert isinstance(plan, DsPlan)
        tag_dir = out / plan.tag
        tag_dir.mkdir(parents=True, exist_ok=True)
        w = _RankWriter(ckpt, plan, unit)
        files = [w.optim_file(tag_dir)]
        if plan.stage == 3:
            files.append(w.model_file(tag_dir))
        for rec in files:
            on_file(f"{plan.tag}/{rec.name}", rec.bytes)
        return files

    def finish(
        self, ckpt: Checkpoint, plan: WritePlan, out: Path, records: Sequence[FileRecord], on_file: OnFile
    ) -> None:
        assert isinstance(plan, DsPlan)
        if plan.stage in (1, 2):
            rec = _RankWriter(ckpt, plan, 0).model_file(out / plan.tag)
            on_file(f"{plan.tag}/{rec.name}", rec.bytes)
        write_latest(out, plan.tag, staged=True)


def _scalar_state(e: TensorEntry) -> torch.Tensor:
    return read_range(e, 0, 1).reshape(())


class _RankWriter:
    """The files of one rank of the output."""

    def __init__(self, ckpt: Checkpoint, plan: DsPlan, rank: int) -> None:
        assert plan.tmpl is not None
        self.ckpt, self.plan, self.tmpl, self.rank = ckpt, plan, plan.tmpl, rank
        self.ents = ckpt.entries
        self.prefix = "bf16_" if self.tmpl.precision == "bf16" else ""

    def _state(
        self, names: Sequence[str], runs_of: Callable[[str], list[Segment]], total: int, f: Archive
    ) -> dict[str, Any]:
        """The inner optimizer's state of one flat group: per-element states laid out like the fp32 slice
        (padded to ``total``), scalar states (``step``) as the first param's value, in its Python type."""
        st: dict[str, Any] = {}
        for s in self.plan.states:
            es = [self.ents[f"{n}:{s}"] for n in names]
            if not es:
                continue
            if all(e.shape == self.ents[n].shape for e, n in zip(es, names, strict=True)):
                segs = [seg for n in names for seg in runs_of(f"{n}:{s}")]
                st[s] = f.tensor(
                    source(torch.float32, segs + [Segment(None, 0, total - sum(x.numel for x in segs))])
                )
            else:
                e0 = es[0]
                val = _scalar_state(e0)
                st[s] = (
                    int(val.item())
                    if e0.pytype == "int"
                    else float(val.item())
                    if e0.pytype == "float"
                    else f.scalar(val)
                )
        return st

    def _osd_file(self, tag_dir: Path, f: Archive, osd: dict[str, Any]) -> FileRecord:
        t = self.tmpl
        name = f"{self.prefix}zero_pp_rank_{self.rank}_mp_rank_00_optim_states.pt"
        return f.save(
            tag_dir / name,
            {"optimizer_state_dict": osd, "ds_config": f.convert(self.plan.cfg), "ds_version": t.ds_version},
        )

    def optim_file(self, tag_dir: Path) -> FileRecord:
        return self._zero3(tag_dir) if self.plan.stage == 3 else self._zero12(tag_dir)

    def _zero12(self, tag_dir: Path) -> FileRecord:
        p, t, ents, r = self.plan, self.tmpl, self.ents, self.rank
        f = Archive()
        fp32, states, pads, maps = [], {}, [], []
        for gi, g in enumerate(p.groups):
            lay: Zero12Rank = zero12_layout([ents[n].numel for n in g], p.world)[r]

            def runs_of(key: str, g: tuple[str, ...] = g, lay: Zero12Rank = lay) -> list[Segment]:
                k = g.index(key.split(":")[0])
                return [Segment(ents[key], a, a + ln) for (pk, a, _, ln) in lay.runs if pk == k]

            fp32.append(
                f.tensor(
                    source(torch.float32, [Segment(ents[g[k]], a, a + ln) for (k, a, _, ln) in lay.runs]),
                    requires_grad=True,
                )
            )
            states[gi] = self._state(g, runs_of, lay.partition_size, f)
            pads.append(lay.padding)
            maps.append(
                OrderedDict((g[k], fragment_address(numel=ln, start=off)) for (k, _, off, ln) in lay.runs)
            )
        pgs = f.convert([{**h, "params": [gi]} for gi, h in enumerate(t.group_hparams)])
        osd = {
            "loss_scaler": t.loss_scaler,
            "dynamic_loss_scale": t.dynamic_loss_scale,
            "overflow": t.overflow,
            "clip_grad": t.clip_grad,
            "base_optimizer_state": {"state": states, "param_groups": pgs},
            "single_partition_of_fp32_groups": fp32,
            "zero_stage": ZeroStageEnum(p.stage or 0),  # a DeepSpeed plan always has a stage
            "group_paddings": pads,
            "param_alignment_paddings": [[0] * len(g) for g in p.groups],
            "partition_count": [p.world] * len(p.groups),
            "ds_version": t.ds_version,
            "param_slice_mappings": maps,
        }
        return self._osd_file(tag_dir, f, osd)

    def _zero3(self, tag_dir: Path) -> FileRecord:
        p, t, ents, r = self.plan, self.tmpl, self.ents, self.rank
        f = Archive()
        flats, states = [], {}
        for si, (_gi, names) in enumerate(p.subs):

            def runs_of(key: str) -> list[Segment]:
                return list(chunk_of(ents[key], p.world, r, torch.float32).segments)

            segs = [seg for n in names for seg in chunk_of(ents[n], p.world, r, torch.float32).segments]
            total = sum(partition.chunk_size(ents[n].numel, p.world) for n in names)
            flats.append(f.tensor(source(torch.float32, segs), requires_grad=True))
            states[si] = self._state(names, runs_of, total, f)
        pgs = f.convert(
            [
                {**h, "params": [si for si, (g2, _) in enumerate(p.subs) if g2 == gi]}
                for gi, h in enumerate(t.group_hparams)
            ]
        )
        osd = {
            "zero_stage": ZeroStageEnum.weights,
            "loss_scaler": t.loss_scaler,
            "dynamic_loss_scale": t.dynamic_loss_scale,
            "overflow": t.overflow,
            "partition_count": p.world,
            "optimizer_state_dict": {"state": states, "param_groups": pgs},
            "fp32_flat_groups": flats,
        }
        return self._osd_file(tag_dir, f, osd)

    def model_file(self, tag_dir: Path) -> FileRecord:
        p, t, ents, r = self.plan, self.tmpl, self.ents, self.rank
        tied = dict(self.ckpt.meta.tied)
        lp = PRECISIONS.get(t.precision, dtypes.float32).torch
        order = [n for n in t.module_order if n in ents or n in tied]
        order += [
            n for n in list(ents) + list(tied) if n not in order and (n in tied or ents[n].role.is_model)
        ]
        frozen = [e.name for e in self.ckpt.model_entries() if e.role is Role.FROZEN]
        f = Archive()
        module: OrderedDict[str, Any] = OrderedDict()
        slots: dict[str, Any] = {}
        for n in order:
            e = ents[tied.get(n, n)]
            dt = lp if e.role is Role.PARAM else e.dtype.torch
            if e.role is Role.BUFFER:
                module[n] = f.tensor(whole(e), e.shape)
            elif p.stage == 3:
                module[n] = f.tensor(source(dt, []), (0,))
            else:
                if e.name not in slots:
                    slots[e.name] = f.tensor(whole(e, dt), e.shape)
                module[n] = slots[e.name]
        groups = [list(names) for _, names in p.subs] if p.stage == 3 else [list(g) for g in p.groups]
        frags = OrderedDict(
            (n, f.tensor(chunk_of(ents[n], p.world, r)) if p.stage == 3 else module[n]) for n in frozen
        )
        obj: dict[str, Any] = {
            "module": module,
            "buffer_names": [e.name for e in self.ckpt.model_entries() if e.role is Role.BUFFER],
            "optimizer": None,
            "param_shapes": [OrderedDict((n, torch.Size(ents[n].shape)) for n in g) for g in groups],
            "frozen_param_shapes": OrderedDict((n, torch.Size(ents[n].shape)) for n in frozen)
            if (p.stage or 0) >= 2
            else None,
            "shared_params": tied if r == 0 else {},
            "frozen_param_fragments": frags if (p.stage or 0) >= 2 else None,
        }
        for k, v in t.top.items():
            obj[k] = f.convert(p.cfg if k == "ds_config" else v)
        obj["dp_world_size"] = p.world
        name = (
            f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" if p.stage == 3 else "mp_rank_00_model_states.pt"
        )
        return f.save(tag_dir / name, obj)


def write_rank(
    ckpt: Checkpoint, plan: WritePlan, tag_dir: Path, rank: int, model: Checkpoint | None = None
) -> list[FileRecord]:
    """Rank ``rank``'s files of ``plan`` straight into ``tag_dir`` (a training engine saving its own state,
    ``ckpt`` holding at least the ranges of its tensors that rank's files need): the optimizer file, the
    ZeRO-3 model-states file, and, given ``model`` (ZeRO-1/2, rank 0: full model tensors under the same
    names), ``mp_rank_00_model_states.pt``. ``latest`` is the caller's."""
    assert isinstance(plan, DsPlan)
    files = [_RankWriter(ckpt, plan, rank).optim_file(tag_dir)]
    if plan.stage == 3:
        files.append(_RankWriter(ckpt, plan, rank).model_file(tag_dir))
    elif model is not None:
        files.append(_RankWriter(model, plan, 0).model_file(tag_dir))
    return files
