"""Checkpoints of an ``Engine``: ``save`` writes the native format (docs/native-format.md, read by
``zckpt.formats.native``); ``load`` restores from a native *or a real DeepSpeed ZeRO-1/2/3* checkpoint saved
at any world size, stage and precision.

Save: every rank writes ``rank_{r:05d}.safetensors`` (its fp32 master chunks, optimizer-state chunks, frozen
chunks, its RNG; rank 0 also buffers and client-state tensors) into the staging folder ``.<tag>.staging``; the
(sha256, size) of each file and each rank's Python/NumPy RNG state are all-gathered to rank 0, which writes
``manifest.json``, publishes the folder as ``<tag>`` (atomic swap when the tag exists), then moves ``latest``;
a final barrier keeps every rank inside ``save`` until ``latest`` moved. The files are written by the native
format's one writer (``zckpt.formats.native.write``), the same code ``zckpt reshard --to native`` uses: the
engine hands it its tensors, specs and ``TrainingState``.

Load: the format is detected through zckpt's formats registry and opened as a lazy ``Checkpoint`` (the model
every zckpt command uses). Each rank copies only the elements ``[start, start + valid)`` of *its* chunk of
each fp32 master, frozen param and per-element optimizer state out of whichever source pieces hold them
(``zckpt.io.spans.read_range`` reads just those bytes), so load-time resharding is the same code path as
a same-size resume. Optimizer states are matched by name to the states the engine's optimizer keeps
(Adam's ``step`` may come from a DeepSpeed param group). Everything that is not a tensor (optimizer groups,
scheduler, loss scaler, step counters, client_state, RNG) comes from the checkpoint's ``TrainingState``,
whatever its format. DeepSpeed checkpoints carry no RNG state: loading one leaves the process's RNG alone,
as DeepSpeed does. Model names and shapes are checked
strictly (DeepSpeed's ``load_module_strict``): one ``CheckpointMismatch`` names every misfit. The optimizer
half lives in ``engine.checkpoint_optim``.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.checkpoint_optim import CheckpointMismatch, load_optimizer, read_into
from zckpt import formats
from zckpt.checkpoint import Checkpoint
from zckpt.errors import UnknownFormat, Unsupported
from zckpt.formats._latest import write_latest
from zckpt.formats.native import layout as L
from zckpt.formats.native import write as W
from zckpt.io.items import WriteItem, entry_from_tensor
from zckpt.io.spans import read_entry
from zckpt.io.staging import fsync_path, publish_folder
from zckpt.model import Role, TensorEntry, dtype_name
from zckpt.state import Counters, OptimizerState, ParamGroup, RankRng, TrainingState, to_json

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.zero.param import ParamState

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------
def staging_dir(save_dir: Path, tag: str) -> Path:
    """Where the ranks of one save write the tag folder before rank 0 publishes it."""
    return save_dir / f".{tag}.staging"


def _rank_rng() -> RankRng:
    np_state: Any = np.random.get_state()
    torch_states = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        torch_states["torch_cuda"] = torch.cuda.get_rng_state()
    return RankRng(
        to_json(random.getstate()),
        [np_state[0], np_state[1].tolist(), *[to_json(x) for x in np_state[2:]]],
        {k: entry_from_tensor(k, t, Role.BUFFER) for k, t in torch_states.items()},
    )


def _rank_items(eng: Engine, client: Mapping[str, Any]) -> tuple[list[WriteItem], list[L.OptimSpec]]:
    """This rank's tensors for its rank file, and the optimizer-state specs (the same on every rank)."""
    r, pw = eng.comm.rank, eng.partition_world
    items: list[WriteItem] = []
    specs: list[L.OptimSpec] = []
    inner = eng.optimizer.optimizer
    for s in eng.states:
        if s.trainable:
            assert s.master is not None
            for k, v in inner.state.get(s.master, {}).items():
                t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
                part = t.shape == s.master.shape and t.dim() == 1
                if r < pw:
                    items.append(W.tensor_item(L.optim_key(k, s.name), t.detach().cpu().contiguous()))
                py = None if isinstance(v, torch.Tensor) else type(v).__name__
                shape = s.shape if part else tuple(t.shape)
                specs.append(L.OptimSpec(s.name, k, shape, dtype_name(t.dtype), part, py))
        if r < pw:
            role = Role.PARAM if s.trainable else Role.FROZEN
            val = s.master if s.trainable else s.local_values()
            assert val is not None
            items.append(W.tensor_item(L.tensor_key(role, s.name), val.detach().cpu().contiguous()))
    if r == 0:
        for name, b in eng.module.named_buffers():
            items.append(W.tensor_item(L.tensor_key(Role.BUFFER, name), b.detach().cpu().contiguous()))
        items += W.client_tree(client)[1]
    return items, specs


def _tensor_specs(eng: Engine) -> list[L.TensorSpec]:
    specs = [
        L.TensorSpec(
            s.name,
            s.shape,
            "float32" if s.trainable else dtype_name(s.dtype),
            Role.PARAM if s.trainable else Role.FROZEN,
            True,
        )
        for s in eng.states
    ]
    specs += [
        L.TensorSpec(n, tuple(b.shape), dtype_name(b.dtype), Role.BUFFER, False)
        for n, b in eng.module.named_buffers()
    ]
    return specs


def training_state(eng: Engine, client: Mapping[str, Any]) -> TrainingState:
    """The engine's state beside its tensors, as every native writer consumes it."""
    inner = eng.optimizer.optimizer
    names_by_master = {id(s.master): s.name for s in eng.states if s.master is not None}
    groups = tuple(
        ParamGroup(
            tuple(names_by_master[id(p)] for p in g["params"]),
            {k: to_json(v) for k, v in g.items() if k != "params"},
        )
        for g in inner.param_groups
    )
    names = sorted({k for s in eng.states if s.master is not None for k in inner.state.get(s.master, {})})
    sched = eng.lr_scheduler.state_dict() if eng.lr_scheduler is not None else None
    return TrainingState(
        stage=eng.stage,
        precision=eng.config.precision,
        optimizer=OptimizerState(type(inner).__name__, groups, tuple(names)),
        scheduler=to_json(sched),
        loss_scaler=to_json(eng.loss_scaler.state_dict()),
        counters=Counters(eng.global_steps, eng.global_samples, eng.skipped_steps, eng.micro_steps),
        client_state=client,
        config=to_json(eng.config.to_dict()),
    )


def _client(obj: Any, path: str) -> Any:
    """client_state with tensors as entries (written into rank 0's file); JSON values otherwise."""
    if isinstance(obj, torch.Tensor):
        return entry_from_tensor(f"client/{path}", obj.detach().cpu().contiguous(), Role.BUFFER)
    if isinstance(obj, dict):
        return {str(k): _client(v, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_client(v, f"{path}.{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"client_state value at {path!r} is a {type(obj).__name__}; use JSON values or tensors")


def save(
    eng: Engine,
    save_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
) -> Path:
    """Write a native checkpoint of ``eng`` into ``save_dir/<tag>`` (collective: every rank calls it)."""
    comm = eng.comm
    tag = tag if tag is not None else f"global_step{eng.global_steps}"
    root = Path(save_dir)
    td = root / tag
    stage = staging_dir(root, tag)
    if comm.rank == 0:
        shutil.rmtree(stage, ignore_errors=True)  # left by a save that was killed
        stage.mkdir(parents=True)
    comm.barrier()
    client = _client(client_state or {}, "")
    items, optim_specs = _rank_items(eng, client if comm.rank == 0 else {})
    rng = _rank_rng()
    items += W.rng_items(rng)
    rec = W.write_rank(stage / L.rank_file(comm.rank), items)
    infos = comm.all_gather_object((rec, W.rng_json(rng)))
    if comm.rank == 0:
        state = training_state(eng, client)
        man = W.build_manifest(
            tag=tag,
            world=comm.world,
            stage=eng.stage,
            tensors=_tensor_specs(eng),
            optim_states=optim_specs,
            tied=eng.tied,
            state=state,
            client_state=W.client_tree(client)[0],
            rng=[j for _, j in infos],
            records=[r for r, _ in infos],
        )
        W.write_manifest(stage, man)
        for f in stage.iterdir():
            fsync_path(f)
        fsync_path(stage)
        publish_folder(stage, td, overwrite=True)
        if save_latest:
            write_latest(root, tag)
    comm.barrier()
    return td


# ------------------------------------------------------------------------------------------------
def _open(root: Path, tag: str | None) -> Checkpoint | None:
    """The checkpoint at ``root`` (``latest``) or ``root/tag``, via zckpt's formats registry; None (with a
    warning, as DeepSpeed does) when there is nothing to load."""
    target = root if tag is None else root / tag
    if not target.is_dir() or (tag is None and not (root / "latest").is_file() and not _is_tag_dir(root)):
        log.warning("no checkpoint to load at %s (no `latest` file, no tag folder)", target)
        return None
    try:
        fmt = formats.detect(target)
    except UnknownFormat as e:
        log.warning("no checkpoint to load: %s", e)
        return None
    if not fmt.training:
        raise Unsupported(
            f"{target}: a {fmt.name} checkpoint holds no optimizer partitions for the engine to resume",
            hint="the engine loads its native format or DeepSpeed ZeRO-1/2/3 checkpoints",
            path=str(target),
        )
    ckpt: Checkpoint = fmt.read(target)
    low = [e.name for e in ckpt.model_entries() if e.role is Role.PARAM and e.dtype != torch.float32]
    if low:
        ckpt.close()
        raise Unsupported(
            f"{target}: holds no fp32 master for {low[0]} (a DeepSpeed ZeRO-0 checkpoint whose masters could "
            "not be matched to names?); resuming from 16-bit weights would not be the same run",
            hint="`zckpt consolidate` it to safetensors and load the weights into the model",
            path=str(target),
        )
    return ckpt


def _is_tag_dir(p: Path) -> bool:
    return (p / L.MANIFEST).is_file() or any(p.glob("*model_states.pt"))


def load(
    eng: Engine,
    load_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    strict: bool = True,
) -> tuple[str | None, dict[str, Any] | None]:
    """Restore ``eng`` from a native or DeepSpeed ZeRO-1/2/3 checkpoint saved at any world size, stage and
    precision; ``(tag folder, client_state)``, or ``(None, None)`` when there is none.

    ``strict``: every model param and persistent buffer must be in the checkpoint with the same shape and
    vice versa (DeepSpeed's ``load_module_strict``); otherwise only the common tensors are loaded."""
    ckpt = _open(Path(load_dir), tag)
    if ckpt is None:
        return None, None
    try:
        st = ckpt.meta.state
        _check_model(eng, ckpt, strict)
        _load_model(eng, ckpt)
        if load_optimizer_states:
            load_optimizer(eng, ckpt)
            _load_scaler(eng, st.loss_scaler)
        if load_lr_scheduler_states and eng.lr_scheduler is not None and st.scheduler is not None:
            eng.lr_scheduler.load_state_dict(st.scheduler)
        _load_counters(eng, st.counters)
        if st.rng:  # DeepSpeed saves no RNG state: then the process's is left alone, as DeepSpeed does
            _load_rng(st.rng[eng.comm.rank % len(st.rng)])
        return ckpt.meta.path, _client_join(st.client_state, ckpt)
    finally:
        ckpt.close()


def _load_counters(eng: Engine, c: Counters) -> None:
    eng.global_steps = c.global_steps or 0
    samples = c.global_samples
    eng.global_samples = samples if samples is not None else eng.global_steps * eng.train_batch_size()
    eng.skipped_steps = c.skipped_steps or 0
    micro = c.micro_steps
    eng.micro_steps = micro if micro is not None else eng.global_steps * eng.gradient_accumulation_steps()


def _client_join(obj: Any, ckpt: Checkpoint) -> Any:
    """client_state with its tensor entries read."""
    if isinstance(obj, TensorEntry):
        return ckpt.read(obj)
    if isinstance(obj, dict):
        return {k: _client_join(v, ckpt) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_client_join(v, ckpt) for v in obj)
    return obj


# ---- model tensors -----------------------------------------------------------------------------
def _check_model(eng: Engine, ckpt: Checkpoint, strict: bool) -> None:
    """Names and shapes of params and persistent buffers against the checkpoint; one error naming them all."""
    where = ckpt.meta.path
    missing, mismatch = [], []
    for s in eng.states:
        if s.name not in ckpt:
            missing.append(s.name)
        elif (e := ckpt.entry(s.name)).shape != s.shape:
            mismatch.append(f"{s.name} (checkpoint {list(e.shape)}, model {list(s.shape)})")
    buffers = dict(eng.module.named_buffers())
    persistent = set(eng.module.state_dict())
    for name, b in buffers.items():
        if name not in ckpt:
            if name in persistent:
                missing.append(name)
        elif (e := ckpt.entry(name)).shape != tuple(b.shape):
            mismatch.append(f"{name} (checkpoint {list(e.shape)}, model {list(b.shape)})")
    known = {s.name for s in eng.states} | set(eng.tied) | set(buffers)
    unexpected = [e.name for e in ckpt.model_entries() if e.name not in known]
    unexpected += [a for a in ckpt.meta.tied if a not in known]
    if mismatch:  # never loadable, strict or not
        raise CheckpointMismatch(
            f"{where}: shape mismatch for {', '.join(mismatch)}", hint="the checkpoint is of another model"
        )
    if strict and (missing or unexpected):
        parts = [f"missing in the checkpoint: {', '.join(missing)}"] if missing else []
        parts += [f"not in the model: {', '.join(unexpected)}"] if unexpected else []
        raise CheckpointMismatch(
            f"{where}: checkpoint does not fit the model ({'; '.join(parts)})",
            hint="engine.checkpoint.load(engine, dir, strict=False) loads only the common tensors",
        )
    for name in missing:
        log.warning("%s: %s is not in the checkpoint; keeping the model's values", where, name)


def _load_model(eng: Engine, ckpt: Checkpoint) -> None:
    """fp32 masters / shards: this rank's chunk only (``read_into`` touches just the overlapping bytes of
    the source pieces); non-sharded params and buffers: whole."""
    with torch.no_grad():
        for s in eng.states:
            if s.name not in ckpt:
                continue
            e = ckpt.entry(s.name)
            if s.trainable:
                assert s.master is not None
                _fill_chunk(e, s, s.master)
                if s.shard is not None and s.shard is not s.master:
                    s.shard.copy_(s.master)
            elif s.sharded:
                assert s.shard is not None
                _fill_chunk(e, s, s.shard)
            else:
                s.param.data.copy_(ckpt.read(e, s.param.dtype).view(s.shape))
        for name, b in eng.module.named_buffers():
            if name in ckpt:
                b.copy_(ckpt.read(name).view(b.shape))
        eng._publish()
        if eng.stage == 3:
            eng.refresh_gathered([s for s in eng.states if not s.trainable and s.gathered])


def _fill_chunk(entry: TensorEntry, s: ParamState, out: torch.Tensor) -> None:
    """``out`` (a padded chunk) := this rank's elements of ``entry``, padding zero."""
    out.zero_()
    if s.valid:
        read_into(entry, s.start, s.start + s.valid, out[: s.valid])


def _load_scaler(eng: Engine, sd: Any) -> None:
    """DeepSpeed's or our scaler state onto the engine's scaler when both are of one kind (dynamic or
    static); a mismatch (another precision) keeps the engine's configured scaler."""
    if not isinstance(sd, dict) or "cur_scale" not in sd:
        return
    ours = eng.loss_scaler
    if bool(sd.get("dynamic")) != ours.dynamic:
        log.warning(
            "checkpoint loss scaler is %s, the engine's %s; keeping the engine's",
            "dynamic" if sd.get("dynamic") else "static",
            "dynamic" if ours.dynamic else "static",
        )
        return
    ours.load_state_dict(sd)


def _load_rng(rng: RankRng) -> None:
    if rng.python is not None:
        py = rng.python
        random.setstate((py[0], tuple(py[1]), py[2]))
    if rng.numpy is not None:
        npst = rng.numpy
        np.random.set_state((npst[0], np.array(npst[1], dtype=np.uint32), *npst[2:]))
    if "torch_cpu" in rng.torch:
        torch.set_rng_state(read_entry(rng.torch["torch_cpu"]).view(torch.uint8))
    if torch.cuda.is_available() and "torch_cuda" in rng.torch:
        torch.cuda.set_rng_state(read_entry(rng.torch["torch_cuda"]).view(torch.uint8))
