"""Native checkpoints: ``save`` and ``load`` of an ``Engine`` (format: docs/native-format.md
and read by ``zckpt.formats.native``).

Save: every rank writes ``rank_{r:05d}.safetensors`` (its fp32 master chunks, optimizer-state chunks, frozen
chunks, its RNG; rank 0 also buffers and client-state tensors) under a temporary name and renames it; the
(sha256, size) of each file and each rank's Python/NumPy RNG state are all-gathered to rank 0, which writes
``manifest.json``, then ``latest``; a final barrier keeps every rank inside ``save`` until ``latest`` moved.

Load: through the zckpt reader (the same ``Checkpoint`` model every zckpt command uses). Each rank copies
only the elements of *its* chunk ``[start, start + valid)`` out of whichever source pieces hold them (mmap
views, ``zckpt.storage.piece_view``), so a checkpoint saved at any world size (or stage) loads at any other:
load-time resharding is the same code path as a same-size resume.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.st_stream import write_tensors
from zckpt import storage
from zckpt.formats import native
from zckpt.model import Checkpoint, TensorEntry

if TYPE_CHECKING:
    from engine.engine import Engine

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


def _client_join(obj: Any, rank0: Path) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return native.read_rank_tensor(rank0, obj["__tensor__"])
        return {k: _client_join(v, rank0) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_client_join(v, rank0) for v in obj]
    return obj


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
    td.mkdir(parents=True, exist_ok=True)
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
    sha, size = write_tensors(td / _rank_file(r), tensors)
    np_state: Any = np.random.get_state()
    rng = {
        "python": _jsonable(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *[_jsonable(x) for x in np_state[2:]]],
    }
    infos = comm.all_gather_object({"file": _rank_file(r), "sha256": sha, "bytes": size, "rng": rng})
    if r == 0:
        manifest = _manifest(eng, tag, optim_specs, infos, client_json)
        tmp = td / f".manifest.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, td / "manifest.json")
        if save_latest:
            latest_tmp = Path(save_dir) / f".latest.tmp-{os.getpid()}"
            latest_tmp.write_text(tag)
            os.replace(latest_tmp, Path(save_dir) / "latest")
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
def _read_into(entry: TensorEntry, lo: int, out: torch.Tensor) -> None:
    """Copy elements ``[lo, lo + out.numel())`` of ``entry`` into ``out`` from the pieces that hold them."""
    hi = lo + out.numel()
    for p in entry.pieces:
        a, b = max(lo, p.start), min(hi, p.start + p.numel)
        if a < b:
            out[a - lo : b - lo].copy_(storage.piece_view(p)[a - p.start : b - p.start])


def _chunk_from(entry: TensorEntry, s: Any, like: torch.Tensor) -> None:
    """Fill ``like`` (a padded chunk) with this rank's elements of ``entry``; padding zero."""
    with torch.no_grad():
        like.zero_()
        _read_into(entry, s.start, like[: s.valid])


def load(
    eng: Engine,
    load_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
) -> tuple[str | None, dict[str, Any] | None]:
    """Restore ``eng`` from a native checkpoint saved at any world size; (None, None) when there is none."""
    root = Path(load_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            log.warning("no checkpoint to load: %s does not exist", latest)
            return None, None
        tag = latest.read_text().strip()
    td = root / tag
    if not (td / "manifest.json").is_file():
        log.warning("no checkpoint to load: %s has no manifest.json", td)
        return None, None
    ckpt = native.read(td)
    man = native.manifest(td)
    with torch.no_grad():
        for s in eng.states:
            if s.trainable:
                assert s.master is not None
                _chunk_from(ckpt.entry(s.name), s, s.master)
                if s.shard is not None and s.shard is not s.master:
                    s.shard.copy_(s.master)
            elif s.sharded:
                assert s.shard is not None
                _chunk_from(ckpt.entry(s.name), s, s.shard)
            else:
                s.param.data.copy_(ckpt.read(s.name, s.param.dtype).view(s.shape))
        buffers = dict(eng.module.named_buffers())
        for name, b in buffers.items():
            if name in ckpt:
                b.copy_(ckpt.read(name).view(b.shape))
        eng._publish()
        if eng.stage == 3:
            eng.refresh_gathered([s for s in eng.states if not s.trainable and s.gathered])
    if load_optimizer_states:
        _load_optimizer(eng, ckpt, man)
        sd = man.get("loss_scaler")
        if sd:
            eng.loss_scaler.load_state_dict(sd)
    if load_lr_scheduler_states and eng.lr_scheduler is not None and man.get("scheduler") is not None:
        eng.lr_scheduler.load_state_dict(man["scheduler"])
    c = man["counters"]
    eng.global_steps, eng.global_samples = c["global_steps"], c["global_samples"]
    eng.skipped_steps, eng.micro_steps = c["skipped_steps"], c["micro_steps"]
    _load_rng(eng, td, man)
    client = _client_join(man.get("client_state") or {}, native.rank_file(td, 0))
    ckpt.close()
    return str(td), client


def _load_optimizer(eng: Engine, ckpt: Checkpoint, man: dict[str, Any]) -> None:
    inner = eng.optimizer.optimizer
    specs = {(o["param"], o["state"]): o for o in man["optim_states"]}
    by_name = {s.name: s for s in eng.states if s.trainable}
    for (pname, state), spec in specs.items():
        s = by_name.get(pname)
        if s is None:
            continue
        assert s.master is not None
        entry = ckpt.entry(f"{pname}:{state}")
        if spec["partitioned"]:
            t = torch.zeros(s.chunk, dtype=entry.dtype, device=s.master.device)
            _chunk_from(entry, s, t)
        else:
            t = ckpt.read(entry).to(s.master.device)
        value: Any = t
        if spec.get("python") == "int":
            value = int(t.item())
        elif spec.get("python") == "float":
            value = float(t.item())
        inner.state.setdefault(s.master, {})[state] = value
    saved = man["optimizer"]["param_groups"]
    if len(saved) != len(inner.param_groups):
        raise ValueError(
            f"checkpoint has {len(saved)} optimizer param groups, the optimizer {len(inner.param_groups)}"
        )
    for g, sg in zip(inner.param_groups, saved, strict=True):
        for k, v in sg.items():
            if k != "params":
                g[k] = tuple(v) if isinstance(g.get(k), tuple) else v


def _load_rng(eng: Engine, td: Path, man: dict[str, Any]) -> None:
    """Rank r takes source rank r's RNG state; ranks beyond the source world take rank ``r % src_world``."""
    src = eng.comm.rank % len(man["rng"])
    state = man["rng"][src]
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npst = state["numpy"]
    np.random.set_state((npst[0], np.array(npst[1], dtype=np.uint32), *npst[2:]))
    f = native.rank_file(td, src)
    t = native.read_rank_tensor(f, "rng/torch_cpu")
    if t is not None:
        torch.set_rng_state(t)
    if torch.cuda.is_available():
        tc = native.read_rank_tensor(f, "rng/torch_cuda")
        if tc is not None:
            torch.cuda.set_rng_state(tc)
