"""``engine.config``: a DeepSpeed JSON config (dict, file or JSON text) → a validated ``EngineConfig``.

Owns the config contract of the engine: which DeepSpeed keys exist, their defaults (DeepSpeed 0.19.8),
deprecated spellings (mapped with a warning), batch-size resolution, and clear ``ConfigError``s for HF
``"auto"`` placeholders, DeepSpeed features the engine does not implement, and unknown keys inside a block
(with the nearest valid key). Unknown top-level keys are ignored with a warning naming the nearest valid key,
as DeepSpeed ignores them. ``parse_config`` is here; the dataclasses in ``schema``, the per-block rules in
``blocks``, the generic parsing/coercion in ``parse``.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

from engine.config import blocks as B
from engine.config import sched as S
from engine.config.parse import (
    ConfigError,
    build,
    deprecated,
    field_keys,
    ignore_unknown_top,
    reject_auto,
    take_foreign,
    to_int,
)
from engine.config.schema import (
    BF16Config,
    CheckpointConfig,
    EngineConfig,
    FP16Config,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    WriterConfig,
    ZeroConfig,
)

__all__ = [
    "BF16Config",
    "CheckpointConfig",
    "ConfigError",
    "EngineConfig",
    "FP16Config",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "WriterConfig",
    "ZeroConfig",
    "activation_checkpointing_config",
    "parse_config",
]

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_PREBUILT = ("world_size", "user_config", *_BATCH_KEYS, *B.BLOCKS)


def parse_config(config: dict[str, Any] | str | Path, *, world_size: int) -> EngineConfig:
    """Parse a DeepSpeed config (dict, JSON file path, or JSON text) for ``world_size`` data-parallel ranks.

    Raises ``ConfigError`` (a ``ValueError``) naming the offending key path. Deprecated spellings are mapped
    with a ``DeprecationWarning`` and a logged warning.
    """
    raw = _load(config)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    reject_auto(raw, "")
    d = copy.deepcopy(raw)
    if d.get("steps_per_print") == math.inf:  # accelerate's "never print" (DeepSpeed keeps the float)
        d["steps_per_print"] = None
    take_foreign(d, "", B.TOP_FOREIGN)
    if isinstance(d.get("communication_data_type"), str):  # DeepSpeed lower-cases it
        d["communication_data_type"] = d["communication_data_type"].lower()
    checkpoint = B.parse_checkpoint(d.pop("checkpoint", None))
    fp16 = B.parse_fp16(d.pop("fp16", None))
    bf16 = B.parse_bf16(d)
    if fp16.enabled and bf16.enabled:
        raise ConfigError(
            "bf16.enabled: bfloat16 and fp16 modes cannot be simultaneously enabled", key="bf16.enabled"
        )
    if "allgather_size" in d:  # pre-0.3 spelling, read only with the boolean zero_optimization form
        deprecated("allgather_size is deprecated; use zero_optimization.allgather_bucket_size")
        size = d.pop("allgather_size")
        if isinstance(d.get("zero_optimization"), bool) and d["zero_optimization"]:
            d["zero_optimization"] = {"stage": 1, "allgather_bucket_size": size}
    B.parse_activation_checkpointing(d.pop("activation_checkpointing", None))  # read by checkpointing
    zero = B.parse_zero(d.pop("zero_optimization", None))
    optimizer = B.parse_optimizer(d.pop("optimizer", None))
    scheduler = S.parse_scheduler(d.pop("scheduler", None))
    tb, mb, gas = (None if d.get(k) is None else to_int(d[k], k) for k in _BATCH_KEYS)
    for k in _BATCH_KEYS:
        d.pop(k, None)
    ignore_unknown_top(
        d, [*(k for k, n in field_keys(EngineConfig).items() if n not in _PREBUILT), *B.TOP_FOREIGN]
    )
    tb, mb, gas = _resolve_batch(tb, mb, gas, world_size)
    prebuilt = dict(
        world_size=world_size,
        train_batch_size=tb,
        train_micro_batch_size_per_gpu=mb,
        gradient_accumulation_steps=gas,
        fp16=fp16,
        bf16=bf16,
        zero_optimization=zero,
        optimizer=optimizer,
        scheduler=scheduler,
        checkpoint=checkpoint,
        user_config=copy.deepcopy(raw),
    )
    cfg = build(
        EngineConfig,
        d,
        "",
        prebuilt=prebuilt,
        exclude=("world_size", "user_config"),
        also_valid=(*B.BLOCKS, *_BATCH_KEYS, *B.TOP_FOREIGN),
    )
    if cfg.gradient_clipping < 0:
        raise ConfigError(
            f"gradient_clipping: must be >= 0 (0 disables), got {cfg.gradient_clipping}",
            key="gradient_clipping",
        )
    if cfg.gradient_predivide_factor <= 0:
        raise ConfigError("gradient_predivide_factor: must be > 0", key="gradient_predivide_factor")
    return cfg


def activation_checkpointing_config(config: dict[str, Any] | str | Path) -> dict[str, Any]:
    """The ``activation_checkpointing`` block of a DeepSpeed config (dict, JSON file path or JSON text),
    validated, with DeepSpeed's defaults: what ``deepspeed.checkpointing.configure(deepspeed_config=...)``
    reads (``engine.checkpointing``)."""
    return B.parse_activation_checkpointing(_load(config).get("activation_checkpointing"))


def _load(config: dict[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    if isinstance(config, str) and config.lstrip().startswith("{"):
        text, where = config, "<json text>"
    else:
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist", hint="pass a dict or a JSON file path")
        text, where = path.read_text(encoding="utf-8"), str(path)
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    if not isinstance(loaded, dict):
        raise ConfigError(f"{where}: top level must be a JSON object, got {type(loaded).__name__}")
    return loaded


def _resolve_batch(tb: int | None, mb: int | None, gas: int | None, world: int) -> tuple[int, int, int]:
    """DeepSpeed's ``_set_batch_related_parameters`` + ``_batch_assertion``, same integer divisions."""
    for name, v in zip(_BATCH_KEYS, (tb, mb, gas), strict=True):
        if v is not None and v <= 0:
            raise ConfigError(f"{name}: {v} has to be greater than 0", key=name)
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        gas = tb // mb // world
    elif tb is not None and gas is not None:
        mb = tb // world // gas
    elif mb is not None and gas is not None:
        tb = mb * gas * world
    elif tb is not None:
        gas, mb = 1, tb // world
    elif mb is not None:
        tb, gas = mb * world, 1
    else:
        raise ConfigError(
            "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided",
            key="train_batch_size",
        )
    assert tb is not None and mb is not None and gas is not None
    for name, v in (("train_micro_batch_size_per_gpu", mb), ("gradient_accumulation_steps", gas)):
        if v <= 0:
            raise ConfigError(
                f"{name}: resolved to {v} (train_batch_size={tb}, world_size={world}); it has to "
                "be greater than 0",
                key=name,
            )
    if tb != mb * gas * world:
        raise ConfigError(
            "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
            f"gradient_acc_step * world_size {tb} != {mb} * {gas} * {world}",
            key="train_batch_size",
            hint="make train_batch_size a multiple of the world size, or give only two of the three keys",
        )
    return tb, mb, gas
