"""Saving an ``Engine`` in DeepSpeed's own layout (``"checkpoint": {"format": "deepspeed"}``), synchronously
or in the background: the tag folder DeepSpeed 0.19.8 writes (ZeRO-1/2: ``mp_rank_00_model_states.pt`` and
``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``; ZeRO-3: ``zero_pp_rank_R_mp_rank_00_model_states.pt``
and ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``), then ``latest`` and DeepSpeed's ``zero_to_fp32.py``
and ``zero_to_torch.py`` beside it, so that real DeepSpeed's ``load_checkpoint``, the HF Trainer and
``zero_to_fp32.py`` read it with no conversion.

The files are written by zckpt's DeepSpeed writer (``zckpt.formats.deepspeed.write``, the one behind ``zckpt
reshard --to deepspeed``) from a ``Checkpoint`` *view* of this rank's state: entries whose pieces are
in-memory tensors holding the ranges of each tensor this rank's files need.

- ZeRO-3: DeepSpeed cuts each param into ``ceil(n / world)`` chunks, as the engine does: a rank's files hold
  its own master, optimizer-state and frozen chunks; no communication.
- ZeRO-1/2: DeepSpeed cuts each param group's flat fp32 tensor into ``world`` equal slices, which straddle
  the engine's per-param chunks: each param's master and per-element optimizer states are all-gathered on the
  training group, one param at a time, and each rank keeps the range its slice needs. Rank 0 also writes
  ``mp_rank_00_model_states.pt`` from the module's full 16-bit params (ZeRO-1/2 keeps them whole).

A range a rank does not need is a NaN run (a stride-0 tensor, no memory) that the writer never reads: a wrong
mapping would write NaN, never plausible numbers. The save protocol (staging folder, every rank's success
agreed before rank 0 publishes, ``latest`` last) is ``engine.checkpoint.save``'s; a background save
(``checkpoint.writer.decoupled``) builds the view over host copies before returning and writes it on the
saver's thread. RNG states are not in DeepSpeed's files (the Trainer saves its own). Refused in one line:
ZeRO stage 0 and an ``s3://`` save dir.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.checkpoint.content import RankSave, client_entries, training_state
from engine.checkpoint.save import RankResult, prepare, report, write_and_publish
from engine.config.parse import ConfigError
from engine.zero.partition import persistent_buffers
from zckpt import dtypes
from zckpt.checkpoint import Checkpoint
from zckpt.codecs.safetensors import FileRecord
from zckpt.formats._latest import write_latest
from zckpt.formats.deepspeed.layout import zero12_layout
from zckpt.formats.deepspeed.write import DeepSpeedWriter, write_rank
from zckpt.model import Piece, Role, TensorEntry
from zckpt.state import CheckpointMeta
from zckpt.storage import session
from zckpt.storage.location import location
from zckpt.storage.objstore.paths import RemotePath
from zckpt.storage.staging import fsync_path, publish_folder

if TYPE_CHECKING:
    from engine.engine import Engine

SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
"""DeepSpeed 0.19.8's recovery scripts (Apache-2.0, kept as ``engine/checkpoint/<name>.txt``), copied beside
``latest`` as DeepSpeed's ``_copy_recovery_script`` does."""


@dataclass(frozen=True)
class View:
    """What this rank writes: ``ckpt`` for its optimizer (and ZeRO-3 model-states) file; ``model``: rank 0's
    full module tensors for ZeRO-1/2's ``mp_rank_00_model_states.pt`` (None elsewhere)."""

    ckpt: Checkpoint
    model: Checkpoint | None


def save(
    eng: Engine,
    save_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen: bool = False,
) -> Path:
    """``save_checkpoint`` in DeepSpeed's layout (collective; see the module doc)."""
    t0 = time.perf_counter()
    if eng.stage not in (1, 2, 3):
        raise ConfigError(
            f"checkpoint.format 'deepspeed': the engine writes DeepSpeed's ZeRO-1/2/3 layout, not stage "
            f"{eng.stage}",
            key="checkpoint.format",
            hint="use zero_optimization.stage 1, 2 or 3, or the native format",
        )
    root = location(save_dir)
    if isinstance(root, RemotePath):
        raise ConfigError(
            f"{save_dir}: checkpoint.format 'deepspeed' saves to a local folder only (DeepSpeed's fixed file "
            "names cannot be replaced whole in a bucket)",
            key="checkpoint.format",
            hint="save to a local folder, or use the native format for s3://",
        )
    saver = eng.checkpointer
    if saver is not None:
        saver.wait()
    tag = tag if tag is not None else f"global_step{eng.global_steps}"
    st = session.Storage()
    handed = False
    try:
        with st.bound():
            stage, _ = prepare(eng, root, tag)
            view = build_view(eng, root, tag, client_state or {}, exclude_frozen, copy=saver is not None)
            job = RankSave(root, tag, eng.comm.rank, eng.comm.world, [], {}, None, save_latest, stage=stage)

            def write() -> FileRecord:
                return write_files(view, eng.stage, job)

            if saver is not None:
                saver.submit_task(job, write, publish, t0, st)
                handed = True
                return root / tag
            write_and_publish(job, eng.comm, write, publish)
    finally:
        if not handed:
            st.close()
    took = time.perf_counter() - t0
    eng.checkpoint_stats = {"tag": tag, "mode": "sync", "blocked_s": took, "total_s": took, "write": {},
                            "format": "deepspeed"}  # fmt: skip
    report(eng, eng.checkpoint_stats)
    return root / tag


def write_files(view: View, stage: int, job: RankSave) -> FileRecord:
    """This rank's files into its staging folder; the first one's record."""
    plan = DeepSpeedWriter().plan(view.ckpt, world=job.world, stage=stage, tag=job.tag)
    return write_rank(view.ckpt, plan, job.stage_dir, job.rank, view.model)[0]


def publish(job: RankSave, results: list[RankResult], phase: list[str]) -> None:
    """Rank 0, every rank's files written: fsync, publish the tag folder, copy DeepSpeed's scripts beside
    it, then move ``latest``."""
    del results
    root = job.root
    assert isinstance(root, Path)  # ``save`` refused a bucket
    for f in job.stage_dir.iterdir():
        fsync_path(f)
    fsync_path(job.stage_dir)
    publish_folder(job.stage_dir, root / job.tag, overwrite=True)
    phase[0] = "published"
    for name in SCRIPTS:
        tmp = root / f".{name}.tmp-{os.getpid()}"
        with (
            resources.files("engine.checkpoint").joinpath(f"{name}.txt").open("rb") as src,
            open(tmp, "wb") as out,
        ):
            shutil.copyfileobj(src, out)
        tmp.chmod(0o755)
        tmp.replace(root / name)
    if job.save_latest:
        write_latest(root, job.tag)


def build_view(
    eng: Engine, root: Path, tag: str, client_state: dict[str, Any], exclude_frozen: bool, *, copy: bool
) -> View:
    """This rank's ``View`` of ``eng`` as it is now; ``copy``: over host copies (a background save), else
    over the live tensors where they are on the host. Collective at ZeRO-1/2 (the gathers)."""
    host = _Host(copy)
    left_out = {s.name for s in eng.states if exclude_frozen and not s.trainable}
    need = _zero12_ranges(eng) if eng.stage in (1, 2) else None
    ents: list[TensorEntry] = []
    for s in eng.states:
        if s.trainable:
            assert s.master is not None
            ents += _trainable(eng, s, need, host)
        elif s.name not in left_out:
            part = [(s.start, host(s.local_values()[: s.valid]))] if need is None else []
            ents.append(_entry(s.name, s.shape, s.dtype, Role.FROZEN, part))
    buffers = [
        _entry(n, tuple(b.shape), b.dtype, Role.BUFFER, [(0, host(b))])
        for n, b in persistent_buffers(eng.module)
    ]
    client = client_entries(dict(client_state), "")
    state = training_state(eng, client)
    order = [n for n in eng.module.state_dict(keep_vars=True) if n not in left_out]
    state = replace(state, framework={"deepspeed": {"module_order": order}})
    tied = {a: o for a, o in eng.tied.items() if o not in left_out}
    meta = CheckpointMeta("engine", str(root / tag), eng.comm.world, tag, str(root), tied, state=state)
    model = None
    if need is not None and eng.comm.rank == 0:
        full = [
            _entry(
                s.name,
                s.shape,
                s.param.dtype,
                Role.PARAM if s.trainable else Role.FROZEN,
                [(0, host(s.param.data))],
            )
            for s in eng.states
            if s.name not in left_out
        ]
        model = Checkpoint(meta, full + buffers)
    return View(Checkpoint(meta, ents + buffers), model)


class _Host:
    """A tensor flattened on the host: a copy when asked for (or when it is on a device), else a view."""

    def __init__(self, copy: bool) -> None:
        self.copy = copy

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.detach().reshape(-1)
        if flat.device.type != "cpu":
            return flat.to("cpu")
        return flat.clone() if self.copy else flat


def _zero12_ranges(eng: Engine) -> dict[str, tuple[int, int]]:
    """ZeRO-1/2: ``{param: (start, length)}``, the range of each param this rank's slice of its group's flat
    fp32 tensor holds (DeepSpeed's partitioning, ``zckpt.formats.deepspeed.layout``)."""
    by_master = {id(s.master): s for s in eng.states if s.master is not None}
    out: dict[str, tuple[int, int]] = {}
    for g in eng.optimizer.optimizer.param_groups:
        states = [by_master[id(p)] for p in g["params"]]
        lay = zero12_layout([s.numel for s in states], eng.comm.world)[eng.comm.rank]
        for k, a, _off, ln in lay.runs:
            out[states[k].name] = (a, ln)
    return out


def _trainable(
    eng: Engine, s: Any, need: dict[str, tuple[int, int]] | None, host: _Host
) -> list[TensorEntry]:
    """A trainable param's master entry and its optimizer-state entries: this rank's chunks (ZeRO-3), or the
    range its DeepSpeed slice needs, cut from the all-gathered tensors (ZeRO-1/2)."""
    state = eng.optimizer.optimizer.state.get(s.master, {})
    per_elem = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == s.master.shape]
    tensors = [s.master, *(state[k] for k in per_elem)]
    if need is None:
        parts = [[(s.start, host(t[: s.valid]))] for t in tensors]
    else:
        parts = []
        for t in tensors:
            full = eng.comm.all_gather_params([t.detach().to(eng.device)], [s.numel])[0]
            got = need.get(s.name)
            parts.append(
                [] if got is None else [(got[0], full[got[0] : got[0] + got[1]].to("cpu", copy=True))]
            )
    out = [_entry(s.name, s.shape, torch.float32, Role.PARAM, parts[0])]
    out += [
        _entry(s.name, s.shape, state[k].dtype, Role.OPTIM, p, state=k)
        for k, p in zip(per_elem, parts[1:], strict=True)
    ]
    for k, v in state.items():
        if k not in per_elem:
            t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            py = None if isinstance(v, torch.Tensor) else type(v).__name__
            out.append(
                _entry(s.name, tuple(t.shape), t.dtype, Role.OPTIM, [(0, host(t))], state=k, pytype=py)
            )
    return out


def _entry(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    role: Role,
    parts: list[tuple[int, torch.Tensor]],
    *,
    state: str | None = None,
    pytype: str | None = None,
) -> TensorEntry:
    """An entry of ``shape`` whose ``parts`` (start element, flat values) are in memory and whose other
    elements are NaN runs (zero for integer dtypes) of no memory, never read by the writer."""
    pieces: list[Piece] = []
    at = 0
    for start, v in sorted(parts, key=lambda p: p[0]):
        if start > at:
            pieces.append(_filler(dtype, at, start - at))
        pieces.append(Piece("", 0, dtypes.of(v.dtype), start, v.numel(), value=v))
        at = start + v.numel()
    total = math.prod(shape)
    if at < total:
        pieces.append(_filler(dtype, at, total - at))
    return TensorEntry(name, tuple(shape), dtypes.of(dtype), role, tuple(pieces), state=state, pytype=pytype)


def _filler(dtype: torch.dtype, start: int, n: int) -> Piece:
    fill = float("nan") if dtype.is_floating_point else 0
    return Piece("", 0, dtypes.of(dtype), start, n, value=torch.full((1,), fill, dtype=dtype).expand(n))


__all__ = ["SCRIPTS", "View", "build_view", "publish", "save", "write_files"]
