"""DeepSpeed's learning-rate schedules: ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``LRRangeTest``
and ``OneCycle`` (which also cycles ``betas``), each buildable from the config's ``scheduler`` block. This
module is ``deepspeed.runtime.lr_schedules`` under ``python -m engine.run`` (``engine/alias``), so a script
may build a schedule itself and pass it as ``lr_scheduler=``.

Formulas and step semantics are those of ``deepspeed/runtime/lr_schedules.py`` (0.19.8), so a script moving
from ``deepspeed`` to ``engine`` sees the same learning rate at every step:

- ``last_batch_iteration`` starts at -1; construction with -1 writes the step "-1" rates into the optimizer
  (``warmup_min_lr`` for the two WarmupLR schedules, 0 for WarmupCosineLR).
- ``step()`` increments ``last_batch_iteration`` and writes the new rates. The engine calls it once per
  optimizer step that was not skipped for an fp16 overflow, after the optimizer update.
- Warm-up factor at iteration ``i < warmup_num_steps``: ``log(i + 1) / log(warmup_num_steps)`` ("log", the
  default) or ``i / warmup_num_steps`` ("linear"); ``warmup_num_steps`` is raised to at least 2.

``state_dict()`` is ``{"last_batch_iteration": int}`` exactly as DeepSpeed saves it. Like DeepSpeed,
``load_state_dict`` restores the counter without rewriting the optimizer's rates (the next ``step()`` does).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
"""DeepSpeed's ``lr_schedules.VALID_LR_SCHEDULES`` (accelerate tests a scheduler's class name against it)."""
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"


class _HasParamGroups(Protocol):
    param_groups: list[dict[str, Any]]


def _torch_optimizer(optimizer: Any) -> _HasParamGroups:
    """The object whose ``param_groups`` the schedule drives (unwraps ``engine_optimizer.optimizer``)."""
    if hasattr(optimizer, "param_groups"):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and hasattr(inner, "param_groups"):
        return inner
    raise TypeError(f"{type(optimizer).__name__} has no param_groups; pass a torch.optim.Optimizer")


def _per_group(optimizer: _HasParamGroups, value: float | Sequence[float], name: str) -> list[float]:
    """Broadcast a scalar to every param group, or check a per-group list (DeepSpeed's ``_format_param``)."""
    n = len(optimizer.param_groups)
    if isinstance(value, list | tuple):
        if len(value) != n:
            raise ValueError(f"expected {n} value for {name}, got {len(value)}")
        return [float(v) for v in value]
    assert isinstance(value, int | float)
    return [float(value)] * n


def _set_lrs(param_groups: list[dict[str, Any]], lrs: list[float]) -> list[float]:
    for group, lr in zip(param_groups, lrs, strict=True):
        current = group["lr"]
        if hasattr(current, "fill_"):  # tensor lr (capturable optimizers): update in place
            current.fill_(lr)
        else:
            group["lr"] = lr
    return [float(g["lr"]) for g in param_groups]


def _check_steps(warmup_num_steps: int) -> int:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
    return max(2, warmup_num_steps)


def _check_type(warmup_type: str) -> str:
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        log.warning(
            "Using unknown warmup_type: %s. The increasing function is set to default (log)", warmup_type
        )
        return WARMUP_LOG_RATE
    return warmup_type


def _warmup_fraction(it: int, warmup_num_steps: int, warmup_type: str, inverse_log_warm_up: float) -> float:
    if warmup_type == WARMUP_LOG_RATE:
        return inverse_log_warm_up * math.log(it + 1)
    return it / warmup_num_steps


class _Schedule:
    """Shared step/state machinery; subclasses implement ``get_lr`` for ``last_batch_iteration >= 0``."""

    optimizer: _HasParamGroups
    last_batch_iteration: int
    _last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """Rates written by the last ``step()`` (or by construction)."""
        if self._last_lr is None:
            raise RuntimeError("need to call step() first")
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: current + 1) and write the rates."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lrs(self.optimizer.param_groups, self.get_lr())

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.last_batch_iteration = int(sd["last_batch_iteration"])


class WarmupLR(_Schedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    ``warmup_max_lr=None`` (DeepSpeed's default for this class) takes each group's current ``lr``.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        num_steps = _check_steps(warmup_num_steps)
        self.optimizer = _torch_optimizer(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "min_lr")
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, "max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs, strict=True)]
        self.warmup_num_steps = num_steps
        self.warmup_type = _check_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _set_lrs(self.optimizer.param_groups, self.get_lr())

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(
                self.last_batch_iteration, self.warmup_num_steps, self.warmup_type, self.inverse_log_warm_up
            )
        return 1.0


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``, then linear decay to 0 at ``total_num_steps``.

    Note DeepSpeed's defaults differ from ``WarmupLR``: ``warmup_max_lr`` defaults to 0.001 here.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )
        if self.total_num_steps < self.warmup_num_steps:
            log.warning(
                "total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps
            )

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(
                self.last_batch_iteration, self.warmup_num_steps, self.warmup_type, self.inverse_log_warm_up
            )
        return max(
            0.0,
            float(self.total_num_steps - self.last_batch_iteration)
            / float(max(1.0, self.total_num_steps - self.warmup_num_steps)),
        )


class WarmupCosineLR(_Schedule):
    """Ratio schedule on each group's initial ``lr``: warm up from ``warmup_min_ratio`` to 1, then cosine
    decay to ``cos_min_ratio`` at ``total_num_steps`` (clamped there afterwards)."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        num_steps = _check_steps(warmup_num_steps)
        self.optimizer = _torch_optimizer(optimizer)
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = last_batch_iteration
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _check_type(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = num_steps
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            log.warning(
                "total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps
            )
        self.org_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = _set_lrs(self.optimizer.param_groups, self.get_lr())

    def get_lr_ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            ratio = _warmup_fraction(it, self.warmup_num_steps, self.warmup_type, self.inverse_log_warm_up)
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = it - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class LRRangeTest(_Schedule):
    """DeepSpeed's learning-rate range test: ``min_lr * (1 + step_rate * interval)`` with
    ``interval = (i + 1) / step_size`` (``floor`` of it when ``lr_range_test_staircase``)."""

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = _torch_optimizer(optimizer)
        self.min_lr = _format_param(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        step_size = lr_range_test_step_size
        if isinstance(step_size, bool) or not isinstance(step_size, int) or step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {step_size}")
        self.step_size = step_size
        self.step_rate = lr_range_test_step_rate
        self.last_batch_iteration = last_batch_iteration
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._last_lr = _set_lrs(self.optimizer.param_groups, list(self.min_lr))

    def get_lr(self) -> list[float]:
        interval = float(self.last_batch_iteration + 1) / self.step_size
        increase = 1 + self.step_rate * (math.floor(interval) if self.staircase else interval)
        return [lr * increase for lr in self.min_lr]


def _format_param(optimizer: _HasParamGroups, value: Any, name: str) -> list[Any]:
    """DeepSpeed's ``_format_param`` verbatim: values kept as given (no float conversion)."""
    if isinstance(value, list | tuple):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"expected {len(optimizer.param_groups)} value for {name}, got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


class OneCycle(_Schedule):
    """DeepSpeed's 1Cycle policy: lr rises linearly from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps and falls back over ``cycle_second_step_size`` (default: the first),
    optionally in ``*_stair_count`` stairs; afterwards ``cycle_min_lr / (1 + decay_lr_rate * k /
    decay_step_size)`` at decay step ``k`` (held at ``cycle_min_lr`` when the rate or step size is 0).

    With ``cycle_momentum`` (and an optimizer whose defaults have ``betas``) ``betas`` cycle inversely, from
    ``(cycle_max_mom, 0.99)`` down to ``(cycle_min_mom, 0.99)`` at the peak lr, and in the decay phase are
    ``cycle_max_mom * (1 + decay_mom_rate * k / decay_step_size)`` (DeepSpeed's formula: it *grows*).
    Construction at iteration -1 writes ``cycle_min_lr`` and ``(cycle_min_mom, 0.99)``, as DeepSpeed does.
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = _torch_optimizer(optimizer)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {first}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {second}")
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_step_size, self.second_step_size = first, second
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        no_decay = math.isclose(decay_step_size, 0)
        self.min_lrs = _format_param(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _format_param(self.optimizer, cycle_max_lr, "cycle_max_lr")
        if last_batch_iteration == -1:
            _set_lrs(self.optimizer.param_groups, self.min_lrs)
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            self._init_momentum(cycle_min_mom, cycle_max_mom, decay_mom_rate, last_batch_iteration)
        self.last_batch_iteration = last_batch_iteration

    def _init_momentum(
        self, min_mom: Any, max_mom: Any, decay_mom_rate: float, last_batch_iteration: int
    ) -> None:
        if "betas" not in getattr(self.optimizer, "defaults", {}):
            log.warning(
                "cycle_momentum is disabled because optimizer %s does not support momentum, no betas "
                "attribute in defaults",
                type(self.optimizer).__name__,
            )
            self.cycle_momentum = False
            return
        self.decay_mom_rate = decay_mom_rate
        self.min_moms = [(m, 0.99) for m in _format_param(self.optimizer, min_mom, "cycle_min_mom")]
        self.max_moms = [(m, 0.99) for m in _format_param(self.optimizer, max_mom, "cycle_max_mom")]
        if last_batch_iteration == -1:
            for momentum, group in zip(self.min_moms, self.optimizer.param_groups, strict=False):
                group["betas"] = momentum
        if math.isclose(decay_mom_rate, 0):
            self.skip_mom_decay = True

    def _get_scale_factor(self) -> float:
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor = x / self.step_ratio
            stair_count = self.first_stair_count
        else:
            scale_factor = (x - 1) / (self.step_ratio - 1)
            stair_count = self.second_stair_count
        if stair_count > 0:  # quantised from the integer offset into the cycle, as DeepSpeed does
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                position = cycle_iteration * stair_count / self.first_step_size
            else:
                position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
            scale_factor = math.floor(position) / stair_count
        return scale_factor

    def get_lr(self) -> list[float]:
        """Rates for ``last_batch_iteration``: the cycle, then the decay phase."""
        if self.last_batch_iteration < self.total_size:
            scale = self._get_scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=False)]
        if self.skip_lr_decay:
            return self.min_lrs
        k = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_lr_rate * (k / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """``betas`` for ``last_batch_iteration``; None without ``cycle_momentum``."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._get_scale_factor()
            return [
                (hi[0] - (hi[0] - lo[0]) * scale, lo[1])
                for lo, hi in zip(self.min_moms, self.max_moms, strict=False)
            ]
        if self.skip_mom_decay:
            return self.max_moms
        k = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_mom_rate * (k / self.decay_step_size)
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance and write the rates and, with ``cycle_momentum``, the ``betas``."""
        super().step(last_batch_iteration)
        momentums = self.get_mom()
        if momentums is not None:
            for group, momentum in zip(self.optimizer.param_groups, momentums, strict=False):
                group["betas"] = momentum


Scheduler = WarmupLR | WarmupDecayLR | WarmupCosineLR | LRRangeTest | OneCycle
"""Any schedule ``build_scheduler`` returns."""

SCHEDULERS: dict[str, type[_Schedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "LRRangeTest": LRRangeTest,
    "OneCycle": OneCycle,
}


def build_scheduler(cfg: Any, optimizer: Any) -> _Schedule | None:
    """Instantiate the config's ``scheduler`` block (``engine.config.SchedulerConfig``) on ``optimizer``.

    Accepts an ``EngineConfig`` (uses ``.scheduler``), a ``SchedulerConfig``, or None; returns None when no
    scheduler is configured. Only the keys the user wrote are passed, so each class's own defaults apply
    exactly as in DeepSpeed's ``scheduler(optimizer, **params)``.
    """
    sched = getattr(cfg, "scheduler", cfg) if not hasattr(cfg, "params") else cfg
    if sched is None:
        return None
    cls: Any = SCHEDULERS[sched.type]
    schedule: _Schedule = cls(optimizer, **dict(sched.params))
    return schedule
