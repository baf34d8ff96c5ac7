"""engine: ZeRO-partitioned data-parallel training on torch.distributed with DeepSpeed's API.

A script written for DeepSpeed runs after ``import engine as deepspeed``::

    deepspeed.init_distributed()
    model_engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, config="ds_config.json")
    loss = model_engine(batch); model_engine.backward(loss); model_engine.step()
    model_engine.save_checkpoint("ckpt")

Layout:

- ``engine`` (the ``Engine``: start-up, backward, step, publish) and ``dist`` (process-group start-up);
- ``config/``: the DeepSpeed JSON config → frozen dataclasses (``schema``, ``blocks``, ``parse``);
- ``zero/``: the ZeRO machinery (``param``: per-param partition state; ``partition``: start-up layout;
  ``collectives``/``shm``: all torch.distributed traffic; ``hooks``: stage-3 gather/release;
  ``grads``: bucketed gradient reduction); ``engine.zero`` itself is DeepSpeed's ``deepspeed.zero``;
- ``optim/``: the partitioned optimizer, fp16 loss scaling, DeepSpeed's LR schedules;
- ``checkpoint/``: native save (synchronous, or asynchronous with ``checkpoint.writer.decoupled``),
  native/DeepSpeed load at disk speed (+ ``checkpoint_optim``: the optimizer half of a load);
  ``export``: ``save_16bit_model``.

``engine`` may import ``zckpt``; ``zckpt`` never imports ``engine``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine import zero
from engine.config import ConfigError, EngineConfig, parse_config
from engine.dist import init_distributed
from engine.engine import Engine
from engine.zero.collectives import Comm

DeepSpeedEngine = Engine
__version__ = "0.1.0"
__all__ = [
    "ConfigError",
    "DeepSpeedEngine",
    "Engine",
    "EngineConfig",
    "init_distributed",
    "initialize",
    "zero",
]


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    config: dict[str, Any] | str | Path | None = None,
    config_params: dict[str, Any] | None = None,
    collate_fn: Any = None,
    dist_init_required: bool | None = None,
    **_ignored: Any,
) -> tuple[Engine, Any, Any, Any]:
    """Wrap ``model`` in an ``Engine``; return ``(engine, optimizer, dataloader, lr_scheduler)``.

    ``config`` is a DeepSpeed config dict or JSON path (``config_params`` and ``args.deepspeed_config`` are
    DeepSpeed's older spellings). ``optimizer`` may be a ``torch.optim.Optimizer`` (rebuilt over this rank's
    partitions) or None (the config's ``optimizer`` block); ``lr_scheduler`` an object with ``step()``, a
    callable taking the optimizer, or None (the config's ``scheduler`` block).
    """
    if model is None:
        raise ValueError("initialize() needs model=")
    cfg_src = config if config is not None else config_params
    if cfg_src is None and args is not None:
        cfg_src = getattr(args, "deepspeed_config", None)
    if cfg_src is None:
        raise ConfigError("no config: pass config= (a dict or a JSON file path)")
    if dist_init_required is not False:
        init_distributed()
    cfg = parse_config(cfg_src, world_size=Comm().world)
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        params = list(model_parameters) if model_parameters is not None else list(model.parameters())
        optimizer = optimizer(params)
    eng = Engine(
        model,
        cfg,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
    )
    return eng, eng.optimizer, eng.training_dataloader, eng.lr_scheduler
