"""Loading an ``Engine`` from a native *or a real DeepSpeed ZeRO-1/2/3* checkpoint saved at any world size,
stage and precision.

The format is detected through zckpt's formats registry and opened as a lazy ``Checkpoint`` (the model
every zckpt command uses). Each rank needs only the elements ``[start, start + valid)`` of *its* chunk of
each fp32 master, frozen param and per-element optimizer state, out of whichever source pieces hold them, so
load-time resharding is the same code path as a same-size resume. Those reads are recorded first and done
together (``engine.checkpoint.reads.ReadPlan``: file by file, in byte order, large ``O_DIRECT`` reads in
flight), which reads a same-size resume's rank file once, front to back, at disk speed. Optimizer states are
matched by name to the states the engine's optimizer keeps (Adam's ``step`` may come from a DeepSpeed param
group; ``engine.checkpoint_optim``). Everything that is not a tensor (optimizer groups, scheduler, loss
scaler, step counters, client_state, RNG) comes from the checkpoint's ``TrainingState``, whatever its
format. DeepSpeed checkpoints carry no RNG state: loading one leaves the process's RNG alone, as DeepSpeed
does. Model names and shapes are checked strictly (DeepSpeed's ``load_module_strict``): one
``CheckpointMismatch`` names every misfit.
"""

from __future__ import annotations

import logging
import os
import random
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.checkpoint import ds_return
from engine.checkpoint.reads import ReadPlan
from engine.checkpoint_optim import CheckpointMismatch, load_optimizer
from engine.zero.partition import persistent_buffers
from zckpt import formats
from zckpt.checkpoint import Checkpoint
from zckpt.errors import UnknownFormat, Unsupported
from zckpt.formats.native import layout as L
from zckpt.model import Role, TensorEntry
from zckpt.state import Counters, RankRng
from zckpt.storage import session
from zckpt.storage.location import Location, location
from zckpt.stream.spans import read_entry

if TYPE_CHECKING:
    from engine.engine import Engine

log = logging.getLogger(__name__)


def _open(root: Location, tag: str | None) -> Checkpoint | None:
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


def _is_tag_dir(p: Location) -> bool:
    return (p / L.MANIFEST).is_file() or any(p.glob("*model_states.pt"))


def load(
    eng: Engine,
    load_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    strict: bool = True,
    module_only: bool = False,
    client_flags: tuple[bool, bool] | None = None,
) -> tuple[str | None, dict[str, Any] | None]:
    """Restore ``eng`` from a native or DeepSpeed ZeRO-1/2/3 checkpoint saved at any world size, stage and
    precision; ``(load_path, client_state)`` as DeepSpeed returns them (``engine.checkpoint.ds_return``), or
    ``(None, None)`` when there is none.

    ``strict``: every model param and persistent buffer must be in the checkpoint with the same shape and
    vice versa (DeepSpeed's ``load_module_strict``); otherwise only the common tensors are loaded.
    ``module_only`` (DeepSpeed's ``load_module_only``; the caller also turns off the optimizer and scheduler
    flags): the weights alone; step counters and RNG stay as they were, as in DeepSpeed. ``client_flags``:
    the caller's own ``(load_optimizer_states, load_lr_scheduler_states)``, which decide, as in DeepSpeed,
    whether ``client_state`` carries ``optimizer`` / ``lr_scheduler`` (default: the two flags above).
    The load runs with a ``zckpt.storage.session.Storage`` of its own (its reads, listings and client),
    closed when it returns."""
    with session.operation(session.Storage()) as st:
        try:
            flags = (load_optimizer_states, load_lr_scheduler_states, strict, module_only, client_flags)
            return _load(eng, load_dir, tag, *flags)
        finally:
            st.close()


def _load(
    eng: Engine,
    load_dir: str | os.PathLike[str],
    tag: str | None,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    strict: bool,
    module_only: bool,
    client_flags: tuple[bool, bool] | None,
) -> tuple[str | None, dict[str, Any] | None]:
    t0 = time.perf_counter()
    ckpt = _open(location(load_dir), tag)
    if ckpt is None:
        return None, None
    try:
        st = ckpt.meta.state
        _check_model(eng, ckpt, strict)
        reads = ReadPlan()
        _queue_model(eng, ckpt, reads)
        if load_optimizer_states:
            load_optimizer(eng, ckpt, reads.add)
        reads.run()
        _finish_model(eng, ckpt)
        if load_optimizer_states:
            _load_scaler(eng, st.loss_scaler)
        if load_lr_scheduler_states and eng.lr_scheduler is not None and st.scheduler is not None:
            eng.lr_scheduler.load_state_dict(st.scheduler)
        if not module_only:
            _load_counters(eng, st.counters)
        if st.rng and not module_only:  # DeepSpeed saves no RNG state: then the process's is left alone
            _load_rng(st.rng[eng.comm.rank % len(st.rng)])
        client = ds_return.client_state(
            eng,
            ckpt,
            _client_join(st.client_state, ckpt),
            flags=client_flags or (load_optimizer_states, load_lr_scheduler_states),
            module_only=module_only,
        )
        took = time.perf_counter() - t0
        eng.load_stats = {"path": str(ckpt.meta.path), "total_s": took, "read": reads.stats}
        return ds_return.load_path(eng, ckpt), client
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
    buffers = dict(persistent_buffers(eng.module))
    for name, b in buffers.items():
        if name not in ckpt:
            missing.append(name)
        elif (e := ckpt.entry(name)).shape != tuple(b.shape):
            mismatch.append(f"{name} (checkpoint {list(e.shape)}, model {list(b.shape)})")
    # a non-persistent buffer is never loaded; the engine's checkpoints before 0.19.8 fidelity held them
    known = {s.name for s in eng.states} | set(eng.tied) | {n for n, _ in eng.module.named_buffers()}
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


def _queue_model(eng: Engine, ckpt: Checkpoint, reads: ReadPlan) -> None:
    """fp32 masters / frozen shards: this rank's chunk only (just the overlapping bytes of the source
    pieces), recorded in ``reads``; the padding is zeroed now."""
    with torch.no_grad():
        for s in eng.states:
            if s.name not in ckpt or not (s.trainable or s.sharded):
                continue
            out = s.master if s.trainable else s.shard
            assert out is not None
            out.zero_()
            if s.valid:
                reads.add(ckpt.entry(s.name), s.start, s.start + s.valid, out[: s.valid])


def _finish_model(eng: Engine, ckpt: Checkpoint) -> None:
    """After the reads: shards from masters, non-sharded frozen params and buffers whole, then publish."""
    with torch.no_grad():
        for s in eng.states:
            if s.name not in ckpt:
                continue
            if s.trainable:
                if s.shard is not None and s.master is not None and s.shard is not s.master:
                    s.shard.copy_(s.master)
            elif not s.sharded:
                s.param.data.copy_(ckpt.read(ckpt.entry(s.name), s.param.dtype).view(s.shape))
        for name, b in persistent_buffers(eng.module):
            if name in ckpt:
                b.copy_(ckpt.read(name).view(b.shape))
        eng._publish()
        if eng.stage == 3:
            eng.refresh_gathered([s for s in eng.states if not s.trainable and s.gathered])


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
