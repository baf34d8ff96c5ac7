"""DeepSpeed's Adam optimizers on the engine: ``FusedAdam`` (``deepspeed.ops.adam.FusedAdam``) and
``DeepSpeedCPUAdam`` (``deepspeed.ops.adam.DeepSpeedCPUAdam``), with DeepSpeed 0.19.8's constructor
signatures, as torch's Adam with the mapped hyper-parameters (no compiled DeepSpeed op).

DeepSpeed's kernels (``multi_tensor_adam.cu``, ``cpu_adam.h``) compute, in fp32, with ``t`` the step:
``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g*g``, ``p -= lr * (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps)``;
weight decay is decoupled (``p -= lr*wd*p``, AdamW) when ``adam_w_mode``/``adamw_mode`` is true (the default)
and an L2 term added to the gradient (``g += wd*p``, Adam) otherwise. That is ``torch.optim.Adam`` with
``decoupled_weight_decay=adam_w_mode``, which these classes are (the same state layout: ``step``,
``exp_avg``, ``exp_avg_sq``). Accepted by ``initialize(optimizer=...)`` like any torch optimizer: the engine
rebuilds it over this rank's fp32 master partitions.

Refused rather than approximated (``NotImplementedError`` naming the option): ``bias_correction=False``
(torch's Adam always corrects), a step on params that are not fp32 (DeepSpeed keeps 16-bit states and
computes in fp32, torch would compute in 16 bits; the engine's masters are always fp32), and ``FusedLamb``
(LAMB's per-parameter trust ratio). ``amsgrad=True`` raises DeepSpeed's own ``RuntimeError``.
``fp32_optimizer_states`` is accepted either way: on fp32 params both settings keep fp32 states.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

_TAKES_DECOUPLED = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters


class _DeepSpeedAdam(torch.optim.Adam):
    """Shared checks of DeepSpeed's two Adam classes over ``torch.optim.Adam``."""

    elementwise_step = True
    """Each param is updated from its own gradient and state (``engine.optim.optimizer`` may step a
    16-bit grad buffer one sub-group at a time)."""
    _ds_name = "Adam"

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float,
        bias_correction: bool,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        amsgrad: bool,
        decoupled: bool,
        foreach: bool | None,
        fused: bool | None,
    ) -> None:
        self._bias_correction = bias_correction
        extra: dict[str, Any] = {}
        if _TAKES_DECOUPLED:
            extra["decoupled_weight_decay"] = decoupled
        elif decoupled and weight_decay != 0:
            raise NotImplementedError(
                f"{self._ds_name}: decoupled weight decay (AdamW mode) needs torch with "
                "Adam(decoupled_weight_decay=...); pass weight_decay=0 or upgrade torch"
            )
        if amsgrad:
            raise RuntimeError(f"{self._ds_name} does not support the AMSGrad variant.")
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            foreach=foreach,
            fused=fused,
            **extra,
        )
        self.defaults["bias_correction"] = bias_correction

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("amsgrad", False):
            raise RuntimeError(f"{self._ds_name} does not support the AMSGrad variant.")
        param_group.setdefault("bias_correction", self._bias_correction)
        if not param_group["bias_correction"]:
            raise NotImplementedError(
                f"{self._ds_name}(bias_correction=False) is not supported by the engine "
                "(torch's Adam always applies bias correction)"
            )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.dtype != torch.float32:
                    raise NotImplementedError(
                        f"{self._ds_name} on {p.dtype} params is not supported by the engine (DeepSpeed "
                        "computes in fp32 over 16-bit states); step fp32 params (the engine's masters are)"
                    )
        return super().step(closure)


class FusedAdam(_DeepSpeedAdam):
    """``deepspeed.ops.adam.FusedAdam``: AdamW (``adam_w_mode=True``, the default) or Adam with L2 decay.

    ``set_grad_none`` is ``zero_grad``'s default. ``foreach``/``fused`` (keyword only, not DeepSpeed's) pick
    torch's implementation; left None, the engine asks for torch's fused kernel where there is one.
    """

    _ds_name = "FusedAdam"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled=adam_w_mode,
            foreach=foreach,
            fused=fused,
        )
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.defaults.update(adam_w_mode=adam_w_mode, set_grad_none=set_grad_none)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPUAdam(_DeepSpeedAdam):
    """``deepspeed.ops.adam.DeepSpeedCPUAdam``: AdamW (``adamw_mode=True``, the default) or Adam with L2
    decay. Unlike DeepSpeed, params need not be on the CPU (it is torch's Adam on any device)."""

    _ds_name = "DeepSpeedCPUAdam"
    optimizer_id = 0

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled=adamw_mode,
            foreach=foreach,
            fused=fused,
        )
        self.opt_id = DeepSpeedCPUAdam.optimizer_id
        DeepSpeedCPUAdam.optimizer_id += 1
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
        self.defaults.update(adamw_mode=adamw_mode, fp32_optimizer_states=fp32_optimizer_states)


class FusedLamb:
    """``deepspeed.ops.lamb.FusedLamb``: refused (LAMB scales each parameter's update by a trust ratio of
    whole-parameter norms, which the engine's partitioned step does not compute)."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        raise NotImplementedError(
            "FusedLamb (deepspeed.ops.lamb) is not supported by the engine; use FusedAdam or torch.optim"
        )
