"""The config's ``scheduler`` block: which DeepSpeed schedule types it takes (all five of
``engine.optim.scheduler``), each one's parameter keys and their JSON coercion, required keys and step-size
checks. The parsed ``SchedulerConfig`` keeps only the keys the user wrote, so the class's defaults apply."""

from __future__ import annotations

from typing import Any

from engine.config.blocks import as_block
from engine.config.parse import (
    ConfigError,
    coerce,
    to_float,
    unknown_key,
    unknown_value,
)
from engine.config.schema import SchedulerConfig

LRS = "lrs"  # float or per-group list of floats
INT_OR_NONE = "int?"
SCHEDULER_PARAMS: dict[str, dict[str, Any]] = {
    "WarmupLR": {
        "warmup_min_lr": LRS,
        "warmup_max_lr": LRS,
        "warmup_num_steps": int,
        "warmup_type": str,
        "last_batch_iteration": int,
    },
    "WarmupDecayLR": {
        "total_num_steps": int,
        "warmup_min_lr": LRS,
        "warmup_max_lr": LRS,
        "warmup_num_steps": int,
        "warmup_type": str,
        "last_batch_iteration": int,
    },
    "WarmupCosineLR": {
        "total_num_steps": int,
        "warmup_min_ratio": float,
        "warmup_num_steps": int,
        "cos_min_ratio": float,
        "warmup_type": str,
        "last_batch_iteration": int,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": LRS,
        "lr_range_test_step_size": int,
        "lr_range_test_step_rate": float,
        "lr_range_test_staircase": bool,
        "last_batch_iteration": int,
    },
    "OneCycle": {
        "cycle_min_lr": LRS,
        "cycle_max_lr": LRS,
        "decay_lr_rate": float,
        "cycle_first_step_size": int,
        "cycle_second_step_size": INT_OR_NONE,
        "cycle_first_stair_count": int,
        "cycle_second_stair_count": INT_OR_NONE,
        "decay_step_size": int,
        "cycle_momentum": bool,
        "cycle_min_mom": LRS,
        "cycle_max_mom": LRS,
        "decay_mom_rate": float,
        "last_batch_iteration": int,
    },
}
SCHEDULER_REQUIRED = {
    "WarmupDecayLR": ("total_num_steps",),
    "WarmupCosineLR": ("total_num_steps",),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
}
POSITIVE_STEPS = ("warmup_num_steps", "lr_range_test_step_size", "cycle_first_step_size")


def parse_scheduler(value: Any) -> SchedulerConfig | None:
    if value is None:
        return None
    d = as_block(value, "scheduler")
    for key in d:
        if key not in ("type", "params"):
            raise unknown_key("scheduler", key, ("type", "params"))
    if "type" not in d:
        raise ConfigError(
            f"scheduler.type: required (one of {', '.join(SCHEDULER_PARAMS)})", key="scheduler.type"
        )
    name = coerce(d["type"], str, "scheduler.type")
    if name not in SCHEDULER_PARAMS:
        raise unknown_value("scheduler.type", name, SCHEDULER_PARAMS)
    spec = SCHEDULER_PARAMS[name]
    params: dict[str, Any] = {}
    for key, v in as_block(d.get("params"), "scheduler.params").items():
        if key not in spec:
            raise unknown_key("scheduler.params", key, spec)
        params[key] = _scheduler_param(name, key, spec[key], v)
    for key in POSITIVE_STEPS:
        if key in params and params[key] <= 0:
            raise ConfigError(
                f"scheduler.params.{key}: must be a positive integer, got {params[key]}",
                key=f"scheduler.params.{key}",
            )
    if params.get("warmup_type", "log") not in ("log", "linear"):
        raise ConfigError(
            f"scheduler.params.warmup_type: expected 'log' or 'linear', got {params['warmup_type']!r}",
            key="scheduler.params.warmup_type",
        )
    for key in SCHEDULER_REQUIRED.get(name, ()):
        if key not in params:
            raise ConfigError(f"scheduler.params.{key}: required for {name}", key=f"scheduler.params.{key}")
    return SchedulerConfig(type=name, params=params)


def _scheduler_param(name: str, key: str, kind: Any, v: Any) -> Any:
    """One ``scheduler.params`` value coerced to its ``SCHEDULER_PARAMS`` kind."""
    where = f"scheduler.params.{key}"
    if kind == LRS:
        if v is None and key == "warmup_max_lr" and name == "WarmupLR":
            return None
        if isinstance(v, list | tuple):
            return [to_float(x, f"{where}[{i}]") for i, x in enumerate(v)]
        return to_float(v, where)
    if kind == INT_OR_NONE:
        return None if v is None else coerce(v, int, where)
    return coerce(v, kind if kind in (int, float, bool) else str, where)
