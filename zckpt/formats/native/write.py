"""The one writer of the native format: used by ``Engine.save_checkpoint`` (live tensors) and by
``zckpt reshard --to native`` (any ``Checkpoint``, at any world size).

What both share lives here: the rank-file content rules (``chunk_item``/``whole_item``/``rng_items``/
``client_tree``), ``write_rank`` (one rank file, streamed through ``zckpt.codecs.safetensors``; its layout is
``rank_plan``, so a caller may instead lay the file out in memory -- the engine's snapshot for an
asynchronous save -- and hand it to ``write_rank_views``: the same bytes), and ``build_manifest`` /
``write_manifest`` (the manifest, built once from typed specs, the ``TrainingState`` and the rank files'
records). Publishing the finished tag folder and moving ``latest``
are ``zckpt.storage.staging`` / ``zckpt.formats._latest``.

``NativeWriter`` is the ``CheckpointWriter`` for reshard. RNG: new rank ``r`` takes old rank ``r``'s state
when it exists, else old rank ``r % old_world``'s (the engine's own load-time rule); sources without RNG
state (DeepSpeed) get states derived deterministically from ``(global_steps, r)``: torch ``manual_seed``,
``random.Random`` and ``numpy.random.RandomState``.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zckpt import dtypes
from zckpt.checkpoint import Checkpoint
from zckpt.codecs import safetensors
from zckpt.codecs.safetensors import FilePlan, FileRecord
from zckpt.errors import Unsupported
from zckpt.formats._latest import write_latest
from zckpt.formats.base import CheckpointWriter, OnFile, WritePlan
from zckpt.formats.native import layout as L
from zckpt.formats.native import record
from zckpt.model import PRECISIONS, Piece, Role, TensorEntry, dtype_name
from zckpt.partition import chunk_range, chunk_size
from zckpt.state import RankRng, TrainingState, tensor_leaves, to_json
from zckpt.storage.digest import BLOCK_BYTES
from zckpt.storage.direct_io import WriteOptions
from zckpt.stream.items import WriteItem, entry_from_tensor

_METADATA = {"format": "pt"}


# ---- rank-file content ---------------------------------------------------------------------------
def chunk_item(key: str, entry: TensorEntry, pw: int, rank: int, dtype: torch.dtype) -> WriteItem:
    """Rank ``rank``'s padded chunk of ``entry`` partitioned over ``pw`` ranks (read lazily)."""
    start, valid = chunk_range(entry.numel, pw, rank)
    pad = chunk_size(entry.numel, pw) - valid
    return WriteItem(key, entry, dtype, span=(start, start + valid), pad=pad)


def whole_item(key: str, entry: TensorEntry, dtype: torch.dtype | None = None) -> WriteItem:
    """All of ``entry`` under ``key``, in its shape."""
    return WriteItem(key, entry, entry.dtype.torch if dtype is None else dtype)


def tensor_item(key: str, t: torch.Tensor) -> WriteItem:
    """An in-memory tensor (the engine's own partitions, on any device: a GPU tensor is copied to the host
    chunk by chunk as it is written) under ``key``."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    dt = dtypes.of(flat.dtype)
    piece = Piece("", 0, dt, 0, flat.numel(), value=flat)
    return WriteItem(key, TensorEntry(key, tuple(t.shape), dt, Role.BUFFER, (piece,)), t.dtype)


def rng_items(rng: RankRng) -> list[WriteItem]:
    return [whole_item(L.rng_key(k), e) for k, e in rng.torch.items()]


def rng_json(rng: RankRng) -> dict[str, Any]:
    return {"python": to_json(rng.python), "numpy": to_json(rng.numpy)}


def client_tree(client_state: Mapping[str, Any]) -> tuple[Any, list[WriteItem]]:
    """``client_state`` as JSON with each tensor leaf replaced by ``{"__tensor__": "client/<path>"}``, and
    those tensors as items for rank 0's file."""
    items = [whole_item(L.client_key(path), e) for path, e in tensor_leaves(client_state)]
    keys = iter(it.name for it in items)

    def encode(o: Any) -> Any:
        if isinstance(o, TensorEntry):
            return {L.CLIENT_REF: next(keys)}
        if isinstance(o, Mapping):
            return {str(k): encode(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [encode(v) for v in o]
        return to_json(o)

    return encode(client_state), items


def write_rank(
    path: Path,
    items: Sequence[WriteItem],
    on_bytes: Any = None,
    *,
    opts: WriteOptions | None = None,
    on_stats: Any = None,
    model: Mapping[str, str] | None = None,
) -> FileRecord:
    """One rank file: ``items`` streamed into ``path`` (which must not exist); its digest: a sha256 per
    ``BLOCK_BYTES`` block (the manifest's ``sha256_blocks``), hashed on several cores. ``model``: rank 0's
    model record (``zckpt.formats.native.record.encode``)."""
    meta = {**_METADATA, **(model or {})}
    return safetensors.write_file(path, items, metadata=meta, on_bytes=on_bytes, sidecar=False,
                                  opts=opts, on_stats=on_stats, crc=True, block=BLOCK_BYTES,
                                  algorithm="sha256")  # fmt: skip


def rank_plan(specs: Sequence[safetensors.Spec], model: Mapping[str, str] | None = None) -> FilePlan:
    """The layout ``write_rank`` gives a rank file of tensors ``(key, dtype, shape)`` in this order (and
    rank 0's ``model`` record): its header bytes, where each tensor's bytes start, its size."""
    return safetensors.plan_file(specs, {**_METADATA, **(model or {})})


def write_rank_views(
    path: Path,
    views: Sequence[memoryview],
    plan: FilePlan,
    *,
    opts: WriteOptions | None = None,
    on_stats: Any = None,
) -> FileRecord:
    """One rank file already laid out in memory by ``rank_plan`` (header at 0, each tensor at its
    offset): ``views`` in order, unchanged until this returns. Byte for byte (and record for record)
    what ``write_rank`` writes for the same tensors."""
    return safetensors.write_views(
        path, views, opts, on_stats, plan=plan, block=BLOCK_BYTES, algorithm="sha256"
    )


# ---- the manifest --------------------------------------------------------------------------------
def optimizer_json(state: TrainingState) -> dict[str, Any] | None:
    opt = state.optimizer
    if opt is None:
        return None
    tensor = opt.tensor_option()
    if tensor is not None:
        raise Unsupported(f"{tensor}: the native manifest keeps options as JSON values")
    groups = [{**to_json(dict(g.options)), "params": list(g.params)} for g in opt.groups]
    return {"kind": opt.kind, "param_groups": groups, "state_names": list(opt.state_names)}


def precision_of(state: TrainingState) -> str:
    """The manifest's ``precision`` for ``state`` (and the model record's)."""
    return state.precision or "fp32"


def build_manifest(
    *,
    tag: str,
    world: int,
    stage: int,
    tensors: Sequence[L.TensorSpec],
    optim_states: Sequence[L.OptimSpec],
    tied: Mapping[str, str],
    state: TrainingState,
    client_state: Any,
    rng: Sequence[Mapping[str, Any]],
    records: Sequence[FileRecord],
    generation: str | None = None,
) -> L.Manifest:
    """The manifest of a tag folder whose rank files ``records`` (every rank's) are written (named with
    ``generation`` when given: ``layout.rank_file``)."""
    names = {r.name for r in records}
    missing = [L.rank_file(r, generation) for r in range(world) if L.rank_file(r, generation) not in names]
    if missing:
        raise ValueError(f"a manifest needs every rank file; missing {missing[:3]}")
    precision = precision_of(state)
    c = state.counters
    return L.Manifest(
        tag=tag,
        world_size=world,
        partition_world=1 if stage == 0 else world,
        stage=stage,
        precision=precision,
        compute_dtype=dtype_name(PRECISIONS.get(precision, torch.float32)),
        tensors=tuple(tensors),
        optim_states=tuple(optim_states),
        files={r.name: (r.digest, r.bytes) for r in records},
        crc32={r.name: dict(r.crc32) for r in records if r.crc32},
        tied=dict(tied),
        optimizer=optimizer_json(state),
        scheduler=to_json(state.scheduler),
        loss_scaler=to_json(state.loss_scaler),
        counters={
            "global_steps": c.global_steps,
            "global_samples": c.global_samples,
            "skipped_steps": c.skipped_steps,
            "micro_steps": c.micro_steps,
        },
        rng=tuple(rng),
        client_state=client_state,
        config=to_json(state.config),
        generation=generation,
    )


def write_manifest(tag_dir: Path, man: L.Manifest) -> None:
    tmp = tag_dir / f".{L.MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(man.to_json(), indent=1) + "\n")
    os.replace(tmp, tag_dir / L.MANIFEST)


# ---- resharding any checkpoint into the native format --------------------------------------------
def derived_rng(seed: int) -> RankRng:
    """Generator states for a rank of a source that saved none: seeded by ``seed``, reproducibly."""
    py = random.Random(seed).getstate()
    np_state: Any = np.random.RandomState(seed % 2**32).get_state()
    g = torch.Generator().manual_seed(seed)
    cpu = g.get_state()
    return RankRng(
        [py[0], list(py[1]), py[2]],
        [np_state[0], np_state[1].tolist(), *np_state[2:]],
        {"torch_cpu": entry_from_tensor("rng/torch_cpu", cpu, Role.BUFFER)},
    )


def rng_of_rank(state: TrainingState, rank: int) -> RankRng:
    """New rank ``rank``'s RNG (see the module doc)."""
    if state.rng:
        return state.rng[rank % len(state.rng)]
    return derived_rng((state.counters.global_steps or 0) * 1000 + rank)


@dataclass(frozen=True)
class NativePlan(WritePlan):
    tensors: tuple[L.TensorSpec, ...] = ()
    optim_states: tuple[L.OptimSpec, ...] = ()


def specs(ckpt: Checkpoint) -> tuple[list[L.TensorSpec], list[L.OptimSpec], list[str]]:
    """The manifest's tensor and optimizer-state specs for ``ckpt``'s entries, and notes on what cannot be
    written. An optimizer state is partitioned like its param when it has the param's (non-0-d) shape."""
    models = ckpt.model_entries()
    params = {e.name: e for e in models if e.role is Role.PARAM}
    tensors = [
        L.TensorSpec(
            e.name,
            e.shape,
            "float32" if e.role is Role.PARAM else dtype_name(e.dtype),
            e.role,
            e.role is not Role.BUFFER,
        )
        for e in models
    ]
    optim, notes = [], []
    for o in (e for e in ckpt.entries.values() if e.role is Role.OPTIM):
        p = params.get(o.name)
        if p is None:
            notes.append(f"optimizer state {o.key} has no trainable param; dropped")
            continue
        part = o.shape == p.shape and len(o.shape) > 0
        optim.append(L.OptimSpec(o.name, str(o.state), o.shape, dtype_name(o.dtype), part, o.pytype))
    return tensors, optim, notes


class NativeWriter(CheckpointWriter):
    """``zckpt reshard --to native``: ``<out>/<tag>/rank_*.safetensors`` + manifest, ``<out>/latest``."""

    generations = True  # the manifest names the rank files' generation

    def plan(self, ckpt: Checkpoint, *, world: int, stage: int | None, tag: str) -> WritePlan:
        out_stage = ckpt.meta.state.stage if stage is None else stage
        out_stage = 3 if out_stage is None else out_stage
        if out_stage not in (0, 1, 2, 3):
            raise Unsupported(f"the engine has no ZeRO stage {out_stage}", hint="pass --stage 0, 1, 2 or 3")
        tensors, optim, notes = specs(ckpt)
        return NativePlan(
            world=world,
            stage=out_stage,
            tag=tag,
            units=world,
            notes=tuple(notes),
            digest=(len(tensors), len(optim)),
            tensors=tuple(tensors),
            optim_states=tuple(optim),
        )

    def write_unit(
        self, ckpt: Checkpoint, plan: WritePlan, out: Path, unit: int, on_file: OnFile
    ) -> list[FileRecord]:
        assert isinstance(plan, NativePlan)
        r = unit
        pw = 1 if plan.stage == 0 else plan.world
        items: list[WriteItem] = []
        if r < pw:
            for t in plan.tensors:
                if t.partitioned:
                    dt = torch.float32 if t.role is Role.PARAM else ckpt.entries[t.name].dtype.torch
                    items.append(chunk_item(L.tensor_key(t.role, t.name), ckpt.entries[t.name], pw, r, dt))
            for o in plan.optim_states:
                e = ckpt.entries[f"{o.param}:{o.state}"]
                key = L.optim_key(o.state, o.param)
                items.append(
                    chunk_item(key, e, pw, r, e.dtype.torch) if o.partitioned else whole_item(key, e)
                )
        items += rng_items(rng_of_rank(ckpt.meta.state, r))
        if r == 0:
            items += [
                whole_item(L.tensor_key(Role.BUFFER, t.name), ckpt.entries[t.name])
                for t in plan.tensors
                if t.role is Role.BUFFER
            ]
            items += client_tree(ckpt.meta.state.client_state)[1]
        tag_dir = out / plan.tag
        tag_dir.mkdir(parents=True, exist_ok=True)
        model = record.encode(plan.tensors, ckpt.meta.tied, precision_of(ckpt.meta.state)) if r == 0 else None
        rec = write_rank(tag_dir / L.rank_file(r, plan.generation), items, model=model)
        on_file(f"{plan.tag}/{rec.name}", rec.bytes)
        return [rec]

    def finish(
        self, ckpt: Checkpoint, plan: WritePlan, out: Path, records: Sequence[FileRecord], on_file: OnFile
    ) -> None:
        assert isinstance(plan, NativePlan)
        state = ckpt.meta.state
        man = build_manifest(
            tag=plan.tag,
            world=plan.world,
            stage=plan.stage or 0,  # a native plan always has a stage
            tensors=plan.tensors,
            optim_states=plan.optim_states,
            tied=ckpt.meta.tied,
            state=state,
            client_state=client_tree(state.client_state)[0],
            rng=[rng_json(rng_of_rank(state, r)) for r in range(plan.world)],
            records=records,
            generation=plan.generation,
        )
        write_manifest(out / plan.tag, man)
        write_latest(out, plan.tag, staged=True)
