"""Loading optimizer state into an ``Engine`` from any ``Checkpoint`` (native or DeepSpeed, any world size).

States are matched by name to the states the engine's optimizer keeps (its current state, or one
zero-gradient step of the same class and group settings on a 2-element probe): per-element states are cut to
this rank's chunk (only those bytes are read: ``read_into`` over ``zckpt.stream.spans.read_range``), scalar
states (Adam's ``step``) are read whole and given the probe's type (a FusedAdam-style ``step`` kept in a
DeepSpeed param group counts too).
Param groups must hold the same params; their hyper-parameters are restored, implementation switches
(``foreach``, ``fused``, ``capturable``, ``differentiable``) stay the engine's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from zckpt.checkpoint import Checkpoint
from zckpt.errors import KeyMappingError
from zckpt.model import STATE_SEP, Role, TensorEntry
from zckpt.stream import spans

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.zero.param import ParamState

log = logging.getLogger(__name__)


class CheckpointMismatch(KeyMappingError):
    """The checkpoint's tensors or optimizer do not fit the engine's model / optimizer."""


_OPT_HINT = "build the optimizer with the checkpoint's param groups, or load with load_optimizer_states=False"
# Implementation choices of the running optimizer, not training state: the engine's own values stay.
_IMPL_KEYS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


Reader = Callable[[TensorEntry, int, int, torch.Tensor], None]
"""``read(entry, lo, hi, out)``: elements ``[lo, hi)`` of ``entry`` into ``out`` (now or by a later
``ReadPlan.run()``)."""


def load_optimizer(eng: Engine, ckpt: Checkpoint, read: Reader | None = None) -> None:
    """Per-param states matched by name to the states the engine's optimizer keeps; per-element states cut
    to this rank's chunk (through ``read``, default ``read_into``), scalar states (``step``) whole; then
    the groups' hyper-parameters."""
    read = read or read_into
    inner = eng.optimizer.optimizer
    opt = ckpt.meta.state.optimizer
    saved = list(opt.groups) if opt is not None else []
    ours = eng.optimizer.group_states
    where = ckpt.meta.path
    if len(saved) != len(ours):
        raise CheckpointMismatch(
            f"{where}: checkpoint has {len(saved)} optimizer param groups, the optimizer {len(ours)}",
            hint=_OPT_HINT,
        )
    tied = ckpt.meta.tied
    for i, (sg, sts) in enumerate(zip(saved, ours, strict=True)):
        theirs = {tied.get(n, n) for n in sg.params}
        mine = {tied.get(s.name, s.name) for s in sts}
        if theirs != mine:
            diff = sorted(mine ^ theirs)[:6]
            raise CheckpointMismatch(
                f"{where}: optimizer param group {i} differs from the checkpoint's in {', '.join(diff)}",
                hint=_OPT_HINT,
            )
    owner_states: dict[str, list[str]] = {}
    for e in ckpt.entries.values():
        if e.role is Role.OPTIM:
            owner_states.setdefault(e.name, []).append(str(e.state))
    for g, sg, sts in zip(inner.param_groups, saved, ours, strict=True):
        for s in sts:
            assert s.master is not None
            owner = tied.get(s.name, s.name)
            want = state_layout(inner, g, s.master)
            if want is None:  # optimizer not re-instantiable: take the checkpoint's states as they are
                want = {k: None for k in owner_states.get(owner, [])}
            new: dict[str, Any] = {}
            for k, like in want.items():
                new[k] = _state_value(ckpt, owner, k, like, s, sg.options, read)
            extra = sorted(set(owner_states.get(owner, [])) - set(want))
            if extra:
                log.warning("%s: optimizer states %s of %s are not kept by %s; ignored",
                            where, extra, s.name, type(inner).__name__)  # fmt: skip
            inner.state[s.master] = new
        for k, v in sg.options.items():
            if k not in _IMPL_KEYS and k in g:
                g[k] = tuple(v) if isinstance(g[k], tuple) and isinstance(v, list) else v


def state_layout(
    inner: torch.optim.Optimizer, group: dict[str, Any], master: torch.Tensor
) -> dict[str, Any] | None:
    """The states ``inner`` keeps for ``master``, name -> example: a tensor shaped like the chunk for a
    per-element state, else the scalar itself. Taken from its current state when it has stepped, else from
    one zero-gradient step of the same class and group settings on a 2-element probe; None when the
    optimizer cannot be re-instantiated that way."""
    cur = inner.state.get(master)
    if cur:
        items, per_shape = list(cur.items()), master.shape
    else:
        probe = torch.zeros(2, dtype=master.dtype, device=master.device, requires_grad=True)
        try:
            settings = {k: v for k, v in group.items() if k != "params"}
            opt = type(inner)([{**settings, "params": [probe]}])  # type: ignore[call-arg]
            probe.grad = torch.zeros_like(probe)
            opt.step()
        except Exception as e:  # noqa: BLE001 - any optimizer class; fall back to the checkpoint's states
            log.debug("cannot probe %s for its state names: %s", type(inner).__name__, e)
            return None
        items, per_shape = list(opt.state[probe].items()), probe.shape
    out: dict[str, Any] = {}
    for k, v in items:
        if isinstance(v, torch.Tensor) and v.shape == per_shape:
            out[k] = torch.empty_like(master, dtype=v.dtype)
        elif v is not None:
            out[k] = v
    return out


def _state_value(
    ckpt: Checkpoint, owner: str, k: str, like: Any, s: ParamState, group: Mapping[str, Any], read: Reader
) -> Any:
    """State ``k`` of ``s`` from the checkpoint, shaped and typed like ``like`` (None: as stored)."""
    assert s.master is not None
    e = ckpt.entries.get(f"{owner}{STATE_SEP}{k}")
    where = ckpt.meta.path
    if like is None:
        per_element = e is not None and len(e.shape) > 0 and e.shape == s.shape
    else:
        per_element = isinstance(like, torch.Tensor) and tuple(like.shape) == (s.chunk,)
    if e is None and not (k == "step" and "step" in group and not per_element):
        raise CheckpointMismatch(
            f"{where}: no optimizer state {k!r} for {s.name}",
            hint="the checkpoint's optimizer keeps other states; load with load_optimizer_states=False",
        )
    if per_element:
        assert e is not None
        if e.shape != s.shape:
            raise CheckpointMismatch(
                f"{where}: optimizer state {k!r} of {s.name} is {list(e.shape)}, its param {list(s.shape)}"
            )
        out = torch.zeros(
            s.chunk, dtype=like.dtype if like is not None else e.dtype.torch, device=s.master.device
        )
        if s.valid:
            read(e, s.start, s.start + s.valid, out[: s.valid])
        return out
    if e is None:  # FusedAdam / DeepSpeedCPUAdam keep Adam's step in the param group
        val = torch.tensor(float(group["step"]))
    elif e.numel != 1:
        raise CheckpointMismatch(
            f"{where}: optimizer state {k!r} of {s.name} has shape {list(e.shape)}, expected a scalar"
        )
    else:
        val = ckpt.read(e)
    if isinstance(like, torch.Tensor):
        return val.reshape(like.shape).to(like.device, like.dtype)
    kind = type(like).__name__ if like is not None else (e.pytype if e is not None else None)
    if kind == "int":
        return int(val.item())
    if kind == "float":
        return float(val.item())
    return val.reshape(())


def read_into(entry: TensorEntry, lo: int, hi: int, out: torch.Tensor) -> None:
    """Elements ``[lo, hi)`` of ``entry`` into ``out`` (any device/dtype); file bytes land in host memory."""
    if out.device.type == "cpu" and out.is_contiguous():
        spans.read_range(entry, lo, hi, out=out)
    else:
        out.copy_(spans.read_range(entry, lo, hi, dtype=out.dtype))
