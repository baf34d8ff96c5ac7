"""fp16 loss scaling: a static ``LossScaler`` and DeepSpeed's ``DynamicLossScaler``, plus overflow detection.

``DynamicLossScaler.update_scale`` follows ``deepspeed/runtime/fp16/loss_scaler.py`` (0.19.8) line for line:

- overflow: if ``delayed_shift == 1`` or ``cur_hysteresis == 1`` the scale halves (floored at ``min_scale``;
  already at the floor raises ``LossScaleAtMinimum`` when ``raise_error_at_min_scale``), otherwise one unit of
  hysteresis is spent; either way ``last_overflow_iter = cur_iter``;
- no overflow: with ``consecutive_hysteresis`` the hysteresis is refilled; the scale doubles when
  ``stable = cur_iter - last_overflow_iter - 1`` is positive and a multiple of ``scale_window`` (refilling the
  hysteresis there when not consecutive);
- ``cur_iter`` advances on every call.

The engine calls ``update_scale`` once per optimizer step (overflowed or not), after all-reducing the
overflow flag that ``overflow_flag`` computes locally. ``state_dict()`` carries DeepSpeed's attribute names so
a DeepSpeed checkpoint's pickled scaler maps onto it 1:1, and is JSON-able.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)


class LossScaleAtMinimum(RuntimeError):
    """An fp16 overflow happened with the dynamic loss scale already at ``min_loss_scale``."""


def overflow_flag(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """0-dim float32 tensor on the tensors' device: 1.0 if any holds inf/NaN, else 0.0. No host sync.

    One fused ``_foreach_norm(ord=inf)`` per device (inf norm is NaN/inf exactly when an element is), so the
    result can go straight into ``all_reduce(op=MAX)``. Empty lists give 0.0 on CPU.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t is not None and t.numel() > 0:
            by_device.setdefault(t.device, []).append(t)
    if not by_device:
        return torch.zeros((), dtype=torch.float32)
    flags = []
    for ts in by_device.values():
        norms = torch._foreach_norm(ts, float("inf"))
        flags.append(torch.stack([n.float() for n in norms]).isfinite().all().logical_not())
    first = flags[0].device
    return torch.stack([f.to(first) for f in flags]).any().float()


def has_overflow(tensors: Iterable[torch.Tensor | None]) -> bool:
    """Whether any of ``tensors`` holds inf or NaN (local check; syncs with the device)."""
    return bool(overflow_flag(tensors).item())


class LossScaler:
    """Static loss scale (fp16 with ``loss_scale > 0``; 1.0 for fp32/bf16). Never reports overflow."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            log.warning("OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated.")

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale, "dynamic": False}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.cur_scale = float(sd["cur_scale"])


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scaler.

    Args mirror DeepSpeed's ``DynamicLossScaler(init_scale, scale_window, min_scale, delayed_shift,
    consecutive_hysteresis, raise_error_at_min_scale=True)``; from a config's fp16 block:
    ``init_scale = 2**initial_scale_power``, ``scale_window = loss_scale_window``, ``min_scale =
    min_loss_scale``, ``delayed_shift = hysteresis``.
    """

    dynamic = True
    _STATE_KEYS = (
        "cur_scale",
        "cur_iter",
        "last_overflow_iter",
        "scale_factor",
        "scale_window",
        "min_scale",
        "delayed_shift",
        "cur_hysteresis",
        "consecutive_hysteresis",
        "raise_error_at_min_scale",
    )

    def __init__(
        self,
        init_scale: float = 2.0**32,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.cur_hysteresis = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimum(
                        f"fp16 overflow at step {self.cur_iter} with the loss scale already at its minimum "
                        f"{self.min_scale}; lower fp16.min_loss_scale, use bf16, or look for inf/NaN"
                    )
                next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                log.info(
                    "OVERFLOW! Skipping step. Attempted loss scale: %s, reducing to %s",
                    self.cur_scale,
                    next_scale,
                )
                self.cur_scale = next_scale
            else:
                log.info(
                    "OVERFLOW! Skipping step. Attempted loss scale: %s, but hysteresis is %d. Reducing to %d",
                    self.cur_scale,
                    self.cur_hysteresis,
                    self.cur_hysteresis - 1,
                )
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {k: getattr(self, k) for k in self._STATE_KEYS}
        sd["dynamic"] = True
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore from ``state_dict()`` output or a DeepSpeed scaler's ``__dict__`` (extra keys ignored)."""
        missing = [
            k for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis") if k not in sd
        ]
        if missing:
            raise KeyError(f"loss scaler state lacks {missing}")
        self.cur_scale = float(sd["cur_scale"])
        self.cur_iter = int(sd["cur_iter"])
        self.last_overflow_iter = int(sd["last_overflow_iter"])
        self.cur_hysteresis = int(sd["cur_hysteresis"])
        for key, cast in (
            ("scale_factor", float),
            ("scale_window", int),
            ("min_scale", float),
            ("delayed_shift", int),
            ("consecutive_hysteresis", bool),
            ("raise_error_at_min_scale", bool),
        ):
            if key in sd:
                setattr(self, key, cast(sd[key]))


def build_loss_scaler(cfg: Any) -> LossScaler:
    """The scaler for an ``EngineConfig`` (or its ``fp16`` block), as DeepSpeed's ``CreateLossScaler`` picks.

    fp16 with ``loss_scale == 0``: ``DynamicLossScaler`` from the fp16 block; fp16 with a static scale:
    ``LossScaler(loss_scale)``; fp32/bf16 (fp16 disabled): ``LossScaler(1.0)``.
    """
    fp16 = getattr(cfg, "fp16", cfg)
    if not fp16.enabled:
        return LossScaler(1.0)
    if fp16.loss_scale == 0:
        return DynamicLossScaler(
            init_scale=2.0**fp16.initial_scale_power,
            scale_window=fp16.loss_scale_window,
            min_scale=fp16.min_loss_scale,
            delayed_shift=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
        )
    return LossScaler(fp16.loss_scale)
