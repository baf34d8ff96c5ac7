"""Checkpoints of an ``Engine``: ``save`` writes the native format (docs/native-format.md, read by
``zckpt.formats.native``); ``load`` restores from a native *or a real DeepSpeed ZeRO-1/2/3* checkpoint saved
at any world size, stage and precision.

Save: every rank writes ``rank_{r:05d}.safetensors`` (its fp32 master chunks, optimizer-state chunks, frozen
chunks, its RNG; rank 0 also buffers and client-state tensors) into the staging folder ``.<tag>.staging``; the
(sha256, size) of each file and each rank's Python/NumPy RNG state are all-gathered to rank 0, which writes
``manifest.json``, publishes the folder as ``<tag>`` (atomic swap when the tag exists: ``engine.publish``),
then moves ``latest``; a final barrier keeps every rank inside ``save`` until ``latest`` moved.

Load: the format is detected through zckpt's formats registry and opened as a lazy ``Checkpoint`` (the model
every zckpt command uses). Each rank copies only the elements ``[start, start + valid)`` of *its* chunk of
each fp32 master, frozen param and per-element optimizer state out of whichever source pieces hold them
(``zckpt.io.flat.read_range`` reads just those bytes), so load-time resharding is the same code path as
a same-size resume. Optimizer states are matched by name to the states the engine's optimizer keeps
(Adam's ``step`` may come from a DeepSpeed param group). Everything that is not a tensor (optimizer groups,
scheduler, loss scaler, step counters, client_state, RNG) comes through the same mapping ``zckpt reshard
--to native`` writes (``zckpt.formats.native_write.template_from_*``). DeepSpeed checkpoints carry no RNG
state: loading one leaves the process's RNG alone, as DeepSpeed does. Model names and shapes are checked
strictly (DeepSpeed's ``load_module_strict``): one ``CheckpointMismatch`` names every misfit. The optimizer
half lives in ``engine.checkpoint_optim``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.checkpoint_optim import CheckpointMismatch, load_optimizer, read_into
from engine.publish import move_latest, publish, staging_dir
from engine.st_stream import write_tensors
from zckpt import formats
from zckpt.checkpoint import Checkpoint
from zckpt.errors import UnknownFormat, Unsupported
from zckpt.formats import native
from zckpt.formats.native_write import NativeTemplate, template_from_deepspeed, template_from_native
from zckpt.model import TensorEntry

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.zero.param import ParamState

log = logging.getLogger(__name__)


def _rank_file(r: int) -> str:
    return f"rank_{r:05d}.safetensors"


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    return v


def _client_split(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able copy of client_state; tensors move to ``tensors`` as ``client/<path>`` (rank 0's file)."""
    if isinstance(obj, torch.Tensor):
        key = f"client/{path}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {str(k): _client_split(v, f"{path}.{k}" if path else str(k), tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_client_split(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"client_state value at {path!r} is a {type(obj).__name__}; use JSON values or tensors")


# ------------------------------------------------------------------------------------------------
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
    td = Path(save_dir) / tag
    stage = staging_dir(Path(save_dir), tag)
    if comm.rank == 0:
        shutil.rmtree(stage, ignore_errors=True)  # left by a save that was killed
        stage.mkdir(parents=True)
    comm.barrier()
    r, pw = comm.rank, eng.partition_world
    tensors: dict[str, torch.Tensor] = {}
    inner = eng.optimizer.optimizer
    optim_specs: list[dict[str, Any]] = []
    for s in eng.states:
        if s.trainable:
            assert s.master is not None
            for k, v in inner.state.get(s.master, {}).items():
                t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
                part = t.shape == s.master.shape and t.dim() == 1
                if r < pw:
                    tensors[f"optim/{k}/{s.name}"] = t.detach().cpu().contiguous()
                optim_specs.append(
                    {
                        "param": s.name,
                        "state": k,
                        "shape": list(s.shape) if part else list(t.shape),
                        "dtype": str(t.dtype).removeprefix("torch."),
                        "partitioned": part,
                        "python": None if isinstance(v, torch.Tensor) else type(v).__name__,
                    }
                )
        if r < pw:
            prefix = "param" if s.trainable else "frozen"
            val = s.master if s.trainable else s.local_values()
            assert val is not None
            tensors[f"{prefix}/{s.name}"] = val.detach().cpu().contiguous()
    tensors["rng/torch_cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng/torch_cuda"] = torch.cuda.get_rng_state()
    client_json = None
    if r == 0:
        for name, b in eng.module.named_buffers():
            tensors[f"buffer/{name}"] = b.detach().cpu().contiguous()
        client_json = _client_split(client_state or {}, "", tensors)
    sha, size = write_tensors(stage / _rank_file(r), tensors)
    np_state: Any = np.random.get_state()
    rng = {
        "python": _jsonable(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *[_jsonable(x) for x in np_state[2:]]],
    }
    infos = comm.all_gather_object({"file": _rank_file(r), "sha256": sha, "bytes": size, "rng": rng})
    if r == 0:
        manifest = _manifest(eng, tag, optim_specs, infos, client_json)
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        publish(stage, td)
        if save_latest:
            move_latest(Path(save_dir), tag)
    comm.barrier()
    return td


def _manifest(eng: Engine, tag: str, optim_specs: list[dict[str, Any]], infos: list[dict[str, Any]],
              client_json: Any) -> dict[str, Any]:  # fmt: skip
    inner = eng.optimizer.optimizer
    names_by_master = {id(s.master): s.name for s in eng.states if s.master is not None}
    groups = []
    for g in inner.param_groups:
        hyper = {k: _jsonable(v) for k, v in g.items() if k != "params"}
        groups.append({**hyper, "params": [names_by_master[id(p)] for p in g["params"]]})
    tensors = []
    for s in eng.states:
        tensors.append(
            {
                "name": s.name,
                "shape": list(s.shape),
                "dtype": "float32" if s.trainable else str(s.dtype).removeprefix("torch."),
                "role": "param" if s.trainable else "frozen",
                "partitioned": True,
            }
        )
    for name, b in eng.module.named_buffers():
        tensors.append(
            {
                "name": name,
                "shape": list(b.shape),
                "dtype": str(b.dtype).removeprefix("torch."),
                "role": "buffer",
                "partitioned": False,
            }
        )
    sched = eng.lr_scheduler.state_dict() if eng.lr_scheduler is not None else None
    return {
        "format": native.FORMAT,
        "version": native.VERSION,
        "tag": tag,
        "world_size": eng.comm.world,
        "partition_world": eng.partition_world,
        "stage": eng.stage,
        "precision": eng.config.precision,
        "compute_dtype": str(eng.dtype).removeprefix("torch."),
        "tensors": tensors,
        "optim_states": optim_specs,
        "tied": dict(eng.tied),
        "optimizer": {
            "kind": type(inner).__name__,
            "param_groups": groups,
            "state_names": sorted({o["state"] for o in optim_specs}),
        },
        "scheduler": _jsonable(sched),
        "loss_scaler": _jsonable(eng.loss_scaler.state_dict()),
        "counters": {
            "global_steps": eng.global_steps,
            "global_samples": eng.global_samples,
            "skipped_steps": eng.skipped_steps,
            "micro_steps": eng.micro_steps,
        },
        "rng": [i["rng"] for i in infos],
        "client_state": client_json,
        "config": _jsonable(eng.config.to_dict()),
        "files": {i["file"]: {"sha256": i["sha256"], "bytes": i["bytes"]} for i in infos},
    }


# ------------------------------------------------------------------------------------------------
def _open(root: Path, tag: str | None) -> Checkpoint | None:
    """The checkpoint at ``root`` (``latest``) or ``root/tag``, via zckpt's formats registry; None (with a
    warning, as DeepSpeed does) when there is nothing to load."""
    target = root if tag is None else root / tag
    if not target.is_dir() or (tag is None and not (root / "latest").is_file() and not _is_tag_dir(root)):
        log.warning("no checkpoint to load at %s (no `latest` file, no tag folder)", target)
        return None
    try:
        mod = formats.detect(target)
    except UnknownFormat as e:
        log.warning("no checkpoint to load: %s", e)
        return None
    if mod.NAME not in ("native", "deepspeed"):
        raise Unsupported(
            f"{target}: a {mod.NAME} checkpoint holds no optimizer partitions for the engine to resume",
            hint="the engine loads its native format or DeepSpeed ZeRO-1/2/3 checkpoints",
            path=str(target),
        )
    ckpt: Checkpoint = mod.read(target)
    if ckpt.meta.format == "deepspeed" and ckpt.meta.stage == 0:
        ckpt.close()
        raise Unsupported(
            f"{target}: DeepSpeed ZeRO-0 checkpoint (its fp32 masters live only in the optimizer wrapper)",
            hint="`zckpt consolidate` it to safetensors and load the weights into the model",
            path=str(target),
        )
    return ckpt


def _is_tag_dir(p: Path) -> bool:
    return (p / native.MANIFEST).is_file() or any(p.glob("*model_states.pt"))


def _template(ckpt: Checkpoint) -> NativeTemplate:
    """Everything but tensors (optimizer groups, scheduler, loss scaler, counters, client_state, RNG), in the
    native manifest's shapes: the same mapping ``zckpt reshard --to native`` writes."""
    if ckpt.meta.format == "native":
        return template_from_native(ckpt, None)
    return template_from_deepspeed(ckpt, None)


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
        tmpl = _template(ckpt)
        _check_model(eng, ckpt, strict)
        _load_model(eng, ckpt)
        if load_optimizer_states:
            load_optimizer(eng, ckpt, tmpl)
            _load_scaler(eng, tmpl.loss_scaler)
        if load_lr_scheduler_states and eng.lr_scheduler is not None and tmpl.scheduler is not None:
            eng.lr_scheduler.load_state_dict(tmpl.scheduler)
        c = tmpl.counters
        eng.global_steps = int(c.get("global_steps", 0))
        samples = c.get("global_samples")
        if ckpt.meta.format == "deepspeed" and ckpt.meta.extra.get("global_samples") is None:
            samples = None  # DeepSpeed's own default
        eng.global_samples = (
            int(samples) if samples is not None else eng.global_steps * eng.train_batch_size()
        )
        eng.skipped_steps = int(c.get("skipped_steps", 0))
        eng.micro_steps = int(c.get("micro_steps", eng.global_steps * eng.gradient_accumulation_steps()))
        if ckpt.meta.format == "native" and tmpl.rng is not None:
            _load_rng(*tmpl.rng(eng.comm.rank))  # DeepSpeed saves no RNG state; leave the process's alone
        client = _client_join(tmpl.client_state or {}, tmpl.client_tensors)
        td = Path(ckpt.meta.path)
        return str(td / str(ckpt.meta.tag) if ckpt.meta.format == "deepspeed" else td), client
    finally:
        ckpt.close()


def _client_join(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        return {k: _client_join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_client_join(v, tensors) for v in obj]
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


def _load_rng(state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npst = state["numpy"]
    np.random.set_state((npst[0], np.array(npst[1], dtype=np.uint32), *npst[2:]))
    if "rng/torch_cpu" in tensors:
        torch.set_rng_state(tensors["rng/torch_cpu"])
    if torch.cuda.is_available() and "rng/torch_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng/torch_cuda"])
