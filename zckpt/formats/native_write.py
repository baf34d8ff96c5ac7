"""Writer of the engine's native format (``zckpt.formats.native``, written online by ``engine/checkpoint.py``)
at any world size, from any ``Checkpoint``: the offline half of ``zckpt reshard``.

Per rank ``r < partition_world`` the file ``rank_{r:05d}.safetensors`` holds chunk ``r`` (``ceil(n/pw)``
elements, trailing padding zeroed) of every ``param/<name>`` (fp32 master), ``frozen/<name>`` and partitioned
``optim/<state>/<name>``, plus replicated (0-d) optimizer states; every rank file holds ``rng/torch_cpu``;
rank 0's also ``buffer/<name>`` and ``client/<path>`` tensors. ``manifest.json`` carries the same keys the
engine writes. Tensors stream through ``hf.write_file`` from entries sliced with ``zckpt.io.flat.slice_entry``
(only the needed source bytes are read, one bounded chunk at a time).

RNG: new rank ``r`` takes old rank ``r``'s state when it exists, else old rank ``r % old_world``'s (the
engine's own load-time rule). Sources without RNG state (DeepSpeed) get states derived deterministically
from ``(global_steps, r)``: torch ``manual_seed``, ``random.Random`` and ``numpy.random.RandomState``.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zckpt.checkpoint import Checkpoint
from zckpt.formats import hf, native
from zckpt.io.flat import slice_entry
from zckpt.io.outputs import WriteItem, entry_from_tensor
from zckpt.model import Role, TensorEntry, dtype_name
from zckpt.partition import chunk_range, chunk_size

LP = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class NativeTemplate:
    """Manifest fields that are not tensors, and the small tensors that travel with them."""

    stage: int
    precision: str
    optimizer: dict[str, Any] | None
    scheduler: Any = None
    loss_scaler: Any = None
    counters: dict[str, int] = field(default_factory=dict)
    client_state: Any = None
    client_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    config: Any = None
    rng: Callable[[int], tuple[dict[str, Any], dict[str, torch.Tensor]]] | None = None
    python_types: dict[tuple[str, str], str | None] = field(default_factory=dict)


def _derived_rng(seed: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    py = random.Random(seed).getstate()
    np_state: Any = np.random.RandomState(seed % 2**32).get_state()
    g = torch.Generator().manual_seed(seed)
    return (
        {
            "python": [py[0], list(py[1]), py[2]],
            "numpy": [np_state[0], np_state[1].tolist(), *[_plain(x) for x in np_state[2:]]],
        },
        {"rng/torch_cpu": g.get_state()},
    )


def _plain(v: Any) -> Any:
    if isinstance(v, torch.dtype):
        return dtype_name(v)
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if hasattr(v, "to_dict"):
        return _plain(v.to_dict())
    return v


def template_from_native(ckpt: Checkpoint, stage: int | None) -> NativeTemplate:
    td = Path(ckpt.meta.path)
    man = native.manifest(td)
    rank0 = native.rank_file(td, 0)
    client_tensors: dict[str, torch.Tensor] = {}

    def collect(o: Any) -> None:
        if isinstance(o, dict):
            if set(o) == {"__tensor__"}:
                t = native.read_rank_tensor(rank0, o["__tensor__"])
                if t is not None:
                    client_tensors[o["__tensor__"]] = t
            for v in o.values():
                collect(v)
        elif isinstance(o, list):
            for v in o:
                collect(v)

    collect(man.get("client_state"))
    old = list(man.get("rng") or [])

    def rng(r: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        if not old:
            return _derived_rng(int(man["counters"].get("global_steps", 0)) * 1000 + r)
        src = r % len(old)
        f = native.rank_file(td, src)
        t = {
            k: v
            for k in ("rng/torch_cpu", "rng/torch_cuda")
            if (v := native.read_rank_tensor(f, k)) is not None
        }
        return old[src], t

    return NativeTemplate(
        stage=int(man.get("stage", 3)) if stage is None else stage,
        precision=man.get("precision", "fp32"),
        optimizer=man.get("optimizer"),
        scheduler=man.get("scheduler"),
        loss_scaler=man.get("loss_scaler"),
        counters=dict(man.get("counters") or {}),
        client_state=man.get("client_state"),
        client_tensors=client_tensors,
        config=man.get("config"),
        rng=rng,
        python_types={(o["param"], o["state"]): o.get("python") for o in man.get("optim_states", [])},
    )


def template_from_deepspeed(
    ckpt: Checkpoint, stage: int | None, *, trust_pickle: bool = False
) -> NativeTemplate:
    from zckpt.formats.deepspeed_write import template_from_deepspeed as ds_tmpl
    from zckpt.io.pickle_safe import TensorRef

    t = ds_tmpl(ckpt, trust_pickle=trust_pickle)
    client_tensors: dict[str, torch.Tensor] = {}

    def split(o: Any, path: str) -> Any:
        if isinstance(o, TensorRef):
            key = f"client/{path}"
            client_tensors[key] = o.load()
            return {"__tensor__": key}
        if isinstance(o, dict):
            return {str(k): split(v, f"{path}.{k}" if path else str(k)) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [split(v, f"{path}.{i}") for i, v in enumerate(o)]
        if o is None or isinstance(o, (bool, int, float, str)):
            return o
        return _plain(o) if hasattr(o, "to_dict") else repr(o)

    from zckpt.formats.deepspeed import _KNOWN_KEYS

    client = {k: split(v, k) for k, v in t.top.items() if k not in _KNOWN_KEYS}
    cfg = t.top.get("ds_config")
    gas = int((cfg or {}).get("gradient_accumulation_steps") or 1) if isinstance(cfg, dict) else 1
    steps = int(t.top.get("global_steps") or 0)
    opt = ckpt.meta.optimizer
    groups = [
        {**_plain(h), "params": names} for h, names in zip(t.group_hparams, t.group_params, strict=True)
    ]
    return NativeTemplate(
        stage=(ckpt.meta.stage or 3) if stage is None else stage,
        precision=t.precision,
        optimizer={
            "kind": opt.kind if opt else "?",
            "param_groups": groups,
            "state_names": list(opt.state_names) if opt else [],
        },
        scheduler=_plain(t.top.get("lr_scheduler")),
        loss_scaler=_plain(t.loss_scaler),
        counters={
            "global_steps": steps,
            "global_samples": int(t.top.get("global_samples") or 0),
            "skipped_steps": int(t.top.get("skipped_steps") or 0),
            "micro_steps": steps * gas,
        },
        client_state=client,
        client_tensors=client_tensors,
        config=_plain(cfg),
        rng=lambda r: _derived_rng(steps * 1000 + r),
    )


def _specs(
    ckpt: Checkpoint, tmpl: NativeTemplate
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """The manifest's tensor and optimizer-state specs, and notes on what cannot be written."""
    notes: list[str] = []
    models = ckpt.model_entries()
    params = {e.name: e for e in models if e.role is Role.PARAM}
    specs_t, specs_o = [], []
    for e in models:
        part = e.role is not Role.BUFFER
        dt = "float32" if e.role is Role.PARAM else dtype_name(e.dtype)
        specs_t.append(
            {"name": e.name, "shape": list(e.shape), "dtype": dt, "role": e.role.value, "partitioned": part}
        )
    for o in (e for e in ckpt.entries.values() if e.role is Role.OPTIM):
        p = params.get(o.name)
        part = p is not None and o.shape == p.shape and o.numel > 1
        if p is None:
            notes.append(f"optimizer state {o.key} has no trainable param; dropped")
            continue
        specs_o.append(
            {
                "param": o.name,
                "state": o.state,
                "shape": list(o.shape),
                "dtype": dtype_name(o.dtype),
                "partitioned": part,
                "python": tmpl.python_types.get((o.name, o.state or "")),
            }
        )
    return specs_t, specs_o, notes


def write_native(
    ckpt: Checkpoint,
    tag_dir: Path,
    *,
    world: int,
    tag: str,
    tmpl: NativeTemplate,
    on_file: Callable[[str, int], None] | None = None,
    part: tuple[int, int] = (0, 1),
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Write the rank files of ``ckpt`` as a native checkpoint for ``world`` ranks into ``tag_dir``: all of
    them, or with ``part=(i, n)`` ranks ``i::n`` only (process ``i`` of ``n`` in a distributed reshard).
    Returns notes and the written files' manifest entries; ``write_manifest`` completes the folder."""
    tag_dir.mkdir(parents=True, exist_ok=True)
    pw = 1 if tmpl.stage == 0 else world
    models = ckpt.model_entries()
    _, specs_o, notes = _specs(ckpt, tmpl)
    files: dict[str, dict[str, Any]] = {}
    for r in range(part[0], world, part[1]):
        items: list[WriteItem] = []

        def chunk(e: TensorEntry, key: str, dtype: torch.dtype, r: int = r) -> WriteItem:
            start, valid = chunk_range(e.numel, pw, r)
            c = chunk_size(e.numel, pw)
            return WriteItem(key, slice_entry(e, start, start + valid, c - valid, name=key), dtype)

        if r < pw:
            for e in models:
                if e.role is Role.PARAM:
                    items.append(chunk(e, f"param/{e.name}", torch.float32))
                elif e.role is Role.FROZEN:
                    items.append(chunk(e, f"frozen/{e.name}", e.dtype))
            for s in specs_o:
                o = ckpt.entries[f"{s['param']}:{s['state']}"]
                key = f"optim/{s['state']}/{s['param']}"
                if s["partitioned"]:
                    items.append(chunk(o, key, o.dtype))
                else:
                    items.append(WriteItem(key, slice_entry(o, 0, o.numel, name=key), o.dtype))
                    items[-1] = WriteItem(key, _reshaped(items[-1].entry, o.shape), o.dtype)
        assert tmpl.rng is not None
        _, rng_t = tmpl.rng(r)
        items += [WriteItem(k, entry_from_tensor(k, v, Role.BUFFER), v.dtype) for k, v in rng_t.items()]
        if r == 0:
            items += [
                WriteItem(f"buffer/{e.name}", _renamed(e, f"buffer/{e.name}"), e.dtype)
                for e in models
                if e.role is Role.BUFFER
            ]
            items += [
                WriteItem(k, entry_from_tensor(k, v, Role.BUFFER), v.dtype)
                for k, v in tmpl.client_tensors.items()
            ]
        name = f"rank_{r:05d}.safetensors"
        path = tag_dir / name
        sha = hf.write_file(path, items)
        files[name] = {"sha256": sha, "bytes": path.stat().st_size}
        if on_file is not None:
            on_file(name, path.stat().st_size)
    return notes, files


def write_manifest(
    ckpt: Checkpoint, tag_dir: Path, *, world: int, tag: str, tmpl: NativeTemplate, files: dict[str, Any]
) -> None:
    """The manifest of a native checkpoint whose rank files (``files``: every rank's entry, as
    ``write_native`` returns them) are in ``tag_dir``; written last, by one process."""
    missing = [f"rank_{r:05d}.safetensors" for r in range(world) if f"rank_{r:05d}.safetensors" not in files]
    if missing:
        raise AssertionError(f"manifest without rank files {missing[:3]}")
    specs_t, specs_o, _ = _specs(ckpt, tmpl)
    assert tmpl.rng is not None
    man = {
        "format": native.FORMAT,
        "version": native.VERSION,
        "tag": tag,
        "world_size": world,
        "partition_world": 1 if tmpl.stage == 0 else world,
        "stage": tmpl.stage,
        "precision": tmpl.precision,
        "compute_dtype": LP.get(tmpl.precision, "float32"),
        "tensors": specs_t,
        "optim_states": specs_o,
        "tied": dict(ckpt.meta.tied),
        "optimizer": tmpl.optimizer,
        "scheduler": tmpl.scheduler,
        "loss_scaler": tmpl.loss_scaler,
        "counters": tmpl.counters,
        "rng": [tmpl.rng(r)[0] for r in range(world)],
        "client_state": tmpl.client_state,
        "config": tmpl.config,
        "files": {name: files[name] for name in sorted(files)},
    }
    tmp = tag_dir / f".manifest.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(man, indent=1) + "\n")
    os.replace(tmp, tag_dir / native.MANIFEST)


def _reshaped(e: TensorEntry, shape: tuple[int, ...]) -> TensorEntry:
    return TensorEntry(e.name, shape, e.dtype, e.role, e.pieces, e.state)


def _renamed(e: TensorEntry, name: str) -> TensorEntry:
    return TensorEntry(name, e.shape, e.dtype, Role.BUFFER, e.pieces)
