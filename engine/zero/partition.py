"""Start-up partitioning: from the user's model to this rank's ``ParamState``s and the flat buffers behind
them.

``partition_model`` materialises meta parameters (module by module), casts params to the compute dtype on the
device (buffers only move there and keep their dtype, as DeepSpeed 0.19.8 keeps an fp32 buffer fp32 under
bf16/fp16), broadcasts rank 0's values (DeepSpeed does the same at start) and builds one
``ParamState`` per unique parameter (tied aliases recorded). ``lay_out`` then puts every rank-local tensor
into a few flat buffers, the per-param tensors being views of them (see ``Flat``), so that the optimizer-side
work (norm, clip, overflow check, zeroing, the 16-bit publish) is a few ops over big tensors.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.zero.collectives import Comm
from engine.zero.param import ParamState


@dataclass
class Flat:
    """This rank's flat buffers; each trainable param's tensors are views at its ``flat_offset``.

    ``master`` / ``grad``: every trainable param's chunk, fp32 masters on the master device, gradients in
    ``grad``'s dtype (fp32, or the compute dtype where a 16-bit buffer loses nothing: see ``Engine``).
    ``shard`` (stage 3, when sharded): the compute-dtype shards on the shard device; it *is* ``master`` with
    fp32 compute on one device. ``param`` (partition world 1, not sharded): the trainable params themselves
    (``chunk == numel``, same offsets as the masters), so publishing a step is one cast-copy.
    """

    master: torch.Tensor
    grad: torch.Tensor
    shard: torch.Tensor | None = None
    param: torch.Tensor | None = None


def partition_model(
    model: nn.Module,
    comm: Comm,
    *,
    device: torch.device,
    dtype: torch.dtype,
    partition_world: int,
    sharded: bool,
    persistence: int,
    bucket: int,
) -> tuple[list[ParamState], dict[str, str]]:
    """One ``ParamState`` per unique parameter (owner name first) and the tied aliases ``{alias: owner}``."""
    materialize(model, device)
    for m in model.modules():
        for key, buf in m._buffers.items():
            if buf is not None:
                m._buffers[key] = buf.to(device)
    owners: dict[int, ParamState] = {}
    tied: dict[str, str] = {}
    states: list[ParamState] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in owners:
            owner = owners[id(p)]
            owner.aliases = (*owner.aliases, name)
            tied[name] = owner.name
            continue
        p.data = p.data.to(device, dtype if p.is_floating_point() else p.dtype)
        st = ParamState(
            name=name,
            param=p,
            shape=tuple(p.shape),
            numel=p.numel(),
            partition_world=partition_world,
            rank=comm.rank if partition_world > 1 else 0,
            trainable=p.requires_grad,
            sharded=sharded,
            persistent=sharded and p.numel() <= persistence,
        )
        owners[id(p)] = st
        states.append(st)
    broadcast(comm, [s.param.data for s in states] + list(model.buffers()), bucket)
    return states, tied


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers ``model.state_dict()`` holds (not those registered with ``persistent=False``), each once,
    in DeepSpeed's order (``DeepSpeedEngine._get_buffer_names``: a module's own, then its children's)."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for prefix, m in model.named_modules():
        for key, buf in m._buffers.items():
            if buf is None or key in m._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((f"{prefix}.{key}" if prefix else key, buf))
    return out


def attach(states: list[ParamState], engine: Any) -> None:
    """Let each original find its state and engine (``engine.zero`` helpers start from a parameter)."""
    ref = weakref.ref(engine)
    for s in states:
        s.param._zstate = s  # type: ignore[attr-defined]
        s.param._zengine = ref  # type: ignore[attr-defined]


def lay_out(
    states: list[ParamState],
    *,
    device: torch.device,
    dtype: torch.dtype,
    master_device: torch.device,
    shard_device: torch.device,
    grad_dtype: torch.dtype,
    sharded: bool,
    pin_opt: bool,
    pin_par: bool,
) -> Flat:
    """Lay this rank's tensors out in flat buffers (see ``Flat``); stage 3 releases the full params here."""
    trainable = [s for s in states if s.trainable]
    total = sum(s.chunk for s in trainable)
    flat = Flat(
        master=_zeros(total, torch.float32, master_device, pin_opt),
        grad=_zeros(total, grad_dtype, master_device, pin_opt),
    )
    off = 0
    for s in trainable:
        s.flat_offset = off
        s.master = flat.master[off : off + s.chunk]
        s.grad_shard = flat.grad[off : off + s.chunk]
        s.master[: s.valid].copy_(s.param.data.reshape(-1)[s.start : s.start + s.valid])
        off += s.chunk
    if sharded:
        same = dtype == torch.float32 and master_device == shard_device
        flat.shard = flat.master if same else _zeros(total, dtype, shard_device, pin_par)
        if not same:
            flat.shard.copy_(flat.master)
        for s in trainable:
            s.shard = s.master if same else flat.shard[s.flat_offset : s.flat_offset + s.chunk]
        for s in states:
            if not s.trainable:
                s.shard = s.slice_of(s.param.data).to(shard_device)
                if pin_par:
                    s.shard = s.shard.pin_memory()
            s.release()
    elif trainable and all(s.partition_world == 1 for s in trainable):
        flat.param = torch.empty(total, dtype=dtype, device=device)
        for s in trainable:
            view = flat.param[s.flat_offset : s.flat_offset + s.numel]
            view.copy_(s.param.data.reshape(-1))
            s.param.data = view.view(s.shape)
    return flat


def broadcast(comm: Comm, tensors: list[torch.Tensor], bucket: int) -> None:
    """Rank 0's values everywhere, in buckets of at most ``bucket`` elements per dtype."""
    if not comm.distributed:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    limit = max(1, bucket)
    for group in by_dtype.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for t in group:
            chunk.append(t)
            size += t.numel()
            if size >= limit:
                comm.broadcast_flat_(chunk)
                chunk, size = [], 0
        comm.broadcast_flat_(chunk)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give meta-device params/buffers real storage, module by module, and re-run their initialisers."""
    for m in model.modules():
        direct = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        if any(t.is_meta for t in direct):
            m.to_empty(device=device, recurse=False)
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()


def pinned(off: Any) -> bool:
    """Whether an offload block asks for page-locked host memory."""
    return bool(off is not None and off.pin_memory)


def _zeros(n: int, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    if pin:
        return torch.zeros(n, dtype=dtype, pin_memory=True)
    return torch.zeros(n, dtype=dtype, device=device)
