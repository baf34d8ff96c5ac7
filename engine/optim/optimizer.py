"""The partitioned optimizer: a torch optimizer over this rank's fp32 *master* partitions
(``engine.zero.param``).

A client ``torch.optim.Optimizer`` is rebuilt with its class, defaults and per-group hyper-parameters over the
masters of the params it held (frozen params are skipped); without one, the config's ``optimizer`` builds
Adam/AdamW/SGD with DeepSpeed's semantics (``Adam`` is AdamW unless ``adam_w_mode`` is false; weight decay
defaults to 0 like FusedAdam/DeepSpeedCPUAdam). Elementwise optimizers (Adam, AdamW, SGD...) updating a
partition give exactly the slice of the full update, which is why the sharded step equals the unsharded one.

``step`` does, in order (DeepSpeed ZeRO's ``step``): overflow check of the grad shards (flag all-reduced, MAX)
and skip on overflow; the global gradient norm (squared norms all-reduced; padding is zero so it adds nothing;
a tied param has one shard); unscale and clip in one multiply, ``1 / combined_scale`` with
``combined_scale = loss_scale * max(1, (norm / loss_scale + 1e-6) / clip)``; the inner optimizer step. With a
16-bit grad buffer the gradients are widened to fp32 one ``sub_group_size`` at a time, each sub-group stepped
on its own (DeepSpeed's sub-groups; one sub-group for optimizers that are not elementwise).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from engine.optim.loss_scaler import overflow_flag
from engine.zero.collectives import Comm
from engine.zero.param import ParamState


class PartitionedOptimizer:
    """What ``engine.initialize`` returns as the optimizer. ``param_groups`` are the inner optimizer's."""

    def __init__(
        self,
        states: Sequence[ParamState],
        comm: Comm,
        *,
        client: torch.optim.Optimizer | None,
        config: Any | None,
        model_parameters: Iterable[Any] | None = None,
        partitioned: bool = True,
        flat_grad: torch.Tensor | None = None,
        sub_group: int = 1_000_000_000,
    ) -> None:
        self.comm = comm
        self.partitioned = partitioned
        """Grad shards are disjoint slices (stages 1-3); False for stage 0 (each rank holds all)."""
        self.states = [s for s in states if s.trainable]
        self.flat_grad = flat_grad
        """Every grad shard, contiguous (the engine's flat buffer): norm, clip, overflow and zeroing are one
        op each on it. None: work on the per-param grad shards."""
        self.sub_group = sub_group
        """``sub_group_size``: elements of a 16-bit grad buffer widened to fp32 at a time for the step."""
        self.lazy_zero: Any = None
        """The gradient reducer, when it can treat a zeroed buffer lazily (``GradReducer.fresh``)."""
        by_param = {id(s.param): s for s in self.states}
        self.group_states: list[list[ParamState]] = []
        if client is not None:
            groups = []
            for g in client.param_groups:
                sts = [by_param[id(p)] for p in g["params"] if id(p) in by_param]
                self.group_states.append(sts)
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": self._masters(sts)})
            self.optimizer: torch.optim.Optimizer = _rebuild(type(client), groups, client.defaults)
        else:
            if config is None:
                raise ValueError("no optimizer: pass optimizer= to initialize() or add an `optimizer` block")
            sts = self.states
            if model_parameters is not None:
                wanted = {id(p) for p in _params_of(model_parameters)}
                sts = [s for s in sts if id(s.param) in wanted]
            self.group_states.append(sts)
            self.optimizer = build_config_optimizer(config, self._masters(sts))
        self.overflow = False
        self.last_global_norm = 0.0

    @staticmethod
    def _masters(states: Sequence[ParamState]) -> list[torch.Tensor]:
        out = []
        for s in states:
            assert s.master is not None, s
            out.append(s.master)
        return out

    # -- torch.optim-like surface --------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.lazy_zero is not None:
            self.lazy_zero.fresh = True  # the next gradients overwrite instead of adding (no zeroing pass)
            return
        if self.flat_grad is not None:
            self.flat_grad.zero_()
            return
        for s in self.states:
            assert s.grad_shard is not None
            s.grad_shard.zero_()

    # -- the step ------------------------------------------------------------------------------
    def step(self, *, loss_scale: float = 1.0, clip: float = 0.0, check_overflow: bool = True) -> bool:
        """Unscale, clip and apply the accumulated grad shards; return False (and skip) on overflow."""
        known_sq = None
        if self.lazy_zero is not None:
            known_sq = self.lazy_zero.take_sum_sq()
            self.lazy_zero.materialize()
        grads = [s.grad_shard for s in self.states if s.grad_shard is not None]
        flat = [self.flat_grad] if self.flat_grad is not None else grads
        # the squared norm also detects overflow (inf/NaN propagate through the sum; one host sync)
        sq = known_sq if known_sq is not None else _sum_sq(flat)
        if self.partitioned:
            sq = self.comm.all_reduce_(sq, "sum")
        sq_host = float(sq.item())
        if check_overflow and not math.isfinite(sq_host):
            # a non-finite sum of squares is an overflow unless every element is finite (fp32 range)
            self.overflow = bool(self.comm.all_reduce_(overflow_flag(flat), "max").item())
            if self.overflow:
                self.zero_grad()
                return False
        self.overflow = False
        scaled_norm = math.sqrt(sq_host)
        self.last_global_norm = scaled_norm / loss_scale
        combined = loss_scale
        if clip > 0:
            factor = (scaled_norm / loss_scale + 1e-6) / clip
            if factor > 1:
                combined = factor * loss_scale
        # a fused kernel takes the unscale/clip divisor itself (``grad_scale``, as under torch's GradScaler):
        # one pass over the states instead of an extra pass over the gradients first
        in_kernel = combined != 1.0 and bool(self.states) and _fused_scaling(self.optimizer)
        if self.flat_grad is not None and self.flat_grad.dtype != torch.float32:
            self._step_widened(combined, in_kernel)
        else:
            if combined != 1.0 and not in_kernel:
                torch._foreach_mul_(flat, 1.0 / combined)
            self._inner_step(self.states, [s.grad_shard for s in self.states], combined, in_kernel)
        self.zero_grad()
        return True

    def _step_widened(self, combined: float, in_kernel: bool) -> None:
        """The step over a 16-bit grad buffer: each sub-group's gradients widened to fp32 (and unscaled) into
        a temporary, then the inner step on that sub-group's masters (one sub-group for optimizers that are
        not elementwise, whose step must see every param at once)."""
        assert self.flat_grad is not None
        limit = self.sub_group if _elementwise(self.optimizer) else self.flat_grad.numel()
        for group in _runs(self.states, max(1, limit)):
            lo = group[0].flat_offset
            wide = self.flat_grad[lo : group[-1].flat_offset + group[-1].chunk].float()
            if combined != 1.0 and not in_kernel:
                wide.mul_(1.0 / combined)
            views = [wide[s.flat_offset - lo : s.flat_offset - lo + s.chunk] for s in group]
            self._inner_step(group, views, combined, in_kernel)
            del wide, views

    def _inner_step(
        self,
        states: Sequence[ParamState],
        grads: Sequence[torch.Tensor | None],
        combined: float,
        in_kernel: bool,
    ) -> None:
        """The inner optimizer's step over ``states``' masters with ``grads`` (params without one skip it)."""
        opt: Any = self.optimizer
        for s, g in zip(states, grads, strict=True):
            assert s.master is not None
            s.master.grad = g
        if in_kernel:
            dev = states[0].master.device  # type: ignore[union-attr]
            opt.grad_scale = torch.full((), combined, dtype=torch.float32, device=dev)
            opt.found_inf = torch.zeros((), dtype=torch.float32, device=dev)
        try:
            opt.step()
        finally:
            if in_kernel:
                del opt.grad_scale, opt.found_inf
            for s in states:
                assert s.master is not None
                s.master.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(sd)


def _choose(group: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """A client group with the implementation left open (fused/foreach None) takes ``extra``."""
    if group.get("fused") is None and group.get("foreach") is None:
        return {**group, **extra}
    return group


def _fused_scaling(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step`` takes ``grad_scale``/``found_inf`` (torch's fused Adam/AdamW/SGD kernels)."""
    return bool(getattr(opt, "_step_supports_amp_scaling", False)) and all(
        g.get("fused") for g in opt.param_groups
    )


_WIDEN = 1 << 26
"""Elements of a 16-bit gradient widened to fp32 at a time for its norm (a 256 MB temporary)."""
_ELEMENTWISE = {"Adam", "AdamW", "SGD", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop"}


def _elementwise(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt``'s step updates each param from its own gradient and state only (torch's elementwise
    optimizers, and classes that say so with ``elementwise_step = True``, such as ``engine.optim.adam``'s),
    so stepping its params in several calls equals one step over all."""
    cls = type(opt)
    if getattr(cls, "elementwise_step", False) is True:
        return True
    return cls.__module__.startswith("torch.optim") and cls.__name__ in _ELEMENTWISE


def _runs(states: Sequence[ParamState], limit: int) -> list[list[ParamState]]:
    """Consecutive states (adjacent in the flat buffers) in runs of at most ``limit`` elements (at least one
    state each)."""
    out: list[list[ParamState]] = []
    size = limit
    for s in states:
        if size + s.chunk > limit:
            out.append([])
            size = 0
        out[-1].append(s)
        size += s.chunk
    return out


def _norm(t: torch.Tensor) -> torch.Tensor:
    """The L2 norm of ``t`` in float64; 16-bit tensors are widened to fp32 piece by piece."""
    if t.dtype == torch.float32 or t.dtype == torch.float64:
        return torch.linalg.vector_norm(t).double()
    flat = t.reshape(-1)
    parts = [
        torch.linalg.vector_norm(flat[i : i + _WIDEN].float()).double()
        for i in range(0, flat.numel(), _WIDEN)
    ]
    return torch.stack(parts).square().sum().sqrt()


def _sum_sq(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of every element, float64 0-dim, without a full-size temporary."""
    norms = [_norm(t) for t in tensors if t.numel() > 0]
    if not norms:
        return torch.zeros((), dtype=torch.float64)
    dev = norms[0].device
    return torch.stack([n.to(dev) for n in norms]).square().sum()


def _rebuild(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]], defaults: dict[str, Any]) -> Any:
    """``cls(groups, **defaults)`` passing only the defaults its constructor accepts (some defaults, such as
    AdamW's ``decoupled_weight_decay``, are recorded but not constructor arguments); the rest is restored.

    When the client left the implementation open (``fused`` and ``foreach`` both None, torch's default), the
    fused kernel is asked for (one pass over param, grad and states; CUDA and, in recent torch, CPU), falling
    back to ``foreach`` where the class or device has no fused kernel: same update, fewer launches/passes.
    """
    sig = inspect.signature(cls.__init__)
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    kwargs = {k: v for k, v in defaults.items() if takes_all or k in sig.parameters}
    choices: list[dict[str, Any]] = [{}]
    if kwargs.get("fused", False) is None and kwargs.get("foreach", False) is None:
        plain = not kwargs.get("differentiable") and not kwargs.get("capturable")
        choices = [{"fused": True}, {"foreach": True}, {}] if plain else [{}]
    for i, extra in enumerate(choices):
        try:
            # a client's groups repeat its defaults (fused/foreach None): the choice must reach them too
            opt = cls([_choose(g, extra) for g in groups], **{**kwargs, **extra})
            break
        except (RuntimeError, ValueError, TypeError):
            if i == len(choices) - 1:
                raise
    opt.defaults.update({k: v for k, v in defaults.items() if k not in ("fused", "foreach")})
    return opt


def _params_of(model_parameters: Iterable[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for p in model_parameters:
        if isinstance(p, dict):
            out.extend(p["params"])
        else:
            out.append(p)
    return out


def build_config_optimizer(cfg: Any, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """Adam/AdamW/SGD from an ``OptimizerConfig`` with DeepSpeed's semantics (see the module docstring)."""
    kind = cfg.type.lower()
    if kind in ("adam", "adamw"):
        decoupled = kind == "adamw" or cfg.adam_w_mode
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        opt = cls(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
        # DeepSpeed builds FusedAdam / DeepSpeedCPUAdam, whose groups carry ``bias_correction`` (True, the
        # only value the engine runs): kept in the groups so that a checkpoint resharded to DeepSpeed's
        # layout has the key DeepSpeed's Adam step reads (torch's Adam ignores it)
        opt.defaults["bias_correction"] = True
        for g in opt.param_groups:
            g.setdefault("bias_correction", True)
        return opt
    if kind == "sgd":
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            dampening=cfg.dampening,
            weight_decay=cfg.weight_decay,
            nesterov=cfg.nesterov,
        )
    raise ValueError(f"optimizer type {cfg.type!r} is not supported; use Adam, AdamW or SGD")
