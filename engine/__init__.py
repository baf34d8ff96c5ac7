"""engine: ZeRO-partitioned data-parallel training on torch.distributed with DeepSpeed's API.

A script written for DeepSpeed runs after ``import engine as deepspeed``::

    deepspeed.init_distributed()
    model_engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, config="ds_config.json")
    loss = model_engine(batch); model_engine.backward(loss); model_engine.step()
    model_engine.save_checkpoint("ckpt")

Layout:

- ``engine`` (the ``Engine``: start-up, backward, step, publish) and ``dist`` (process-group start-up);
- DeepSpeed's script-facing namespaces under their DeepSpeed names: ``comm`` (``deepspeed.comm``),
  ``accelerator`` (``deepspeed.accelerator``), ``utils`` (``deepspeed.utils``), ``zero``, ``checkpointing``
  (activation checkpointing); and, here,
  ``add_config_arguments`` (``--deepspeed``/``--deepspeed_config``) and ``initialize``;
- ``config/``: the DeepSpeed JSON config → frozen dataclasses (``schema``, ``blocks``, ``parse``);
- ``zero/``: the ZeRO machinery (``param``: per-param partition state; ``partition``: start-up layout;
  ``collectives``/``shm``: all torch.distributed traffic; ``hooks``: stage-3 gather/release;
  ``grads``: bucketed gradient reduction); ``engine.zero`` itself is DeepSpeed's ``deepspeed.zero``;
- ``optim/``: the partitioned optimizer, fp16 loss scaling, DeepSpeed's LR schedules and Adam classes;
- ``checkpoint/``: native save (synchronous, or asynchronous with ``checkpoint.writer.decoupled``),
  native/DeepSpeed load at disk speed (+ ``checkpoint_optim``: the optimizer half of a load);
  ``export``: ``save_16bit_model``.

``engine`` may import ``zckpt``; ``zckpt`` never imports ``engine``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine import accelerator, checkpointing, comm, utils, version, zero
from engine.accelerator import get_accelerator
from engine.config import ConfigError, EngineConfig, parse_config
from engine.dist import init_distributed
from engine.dist import local_rank as _local_rank
from engine.engine import Engine
from engine.utils import log_dist, logger
from engine.zero.collectives import Comm

DeepSpeedEngine = Engine
__version__ = version.__version__
__all__ = [
    "ConfigError",
    "DeepSpeedEngine",
    "Engine",
    "EngineConfig",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "get_accelerator",
    "init_distributed",
    "initialize",
    "log_dist",
    "logger",
    "utils",
    "zero",
]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line group to ``parser``: ``--deepspeed`` (a flag for the script's own use),
    ``--deepspeed_config PATH`` (read by ``initialize(args=...)``) and their deprecated ``--deepscale*``
    spellings. Returns ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    flag_help = "Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)"
    group.add_argument("--deepspeed", default=False, action="store_true", help=flag_help)
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file."
    )
    group.add_argument("--deepscale", default=False, action="store_true", help=f"Deprecated {flag_help}")
    group.add_argument(
        "--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file."
    )
    return parser


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The config ``initialize`` reads: ``config``, else ``config_params``, else ``args.deepspeed_config`` (or
    the deprecated ``args.deepscale_config``); both a call config and an ``args`` one is an error, as in
    DeepSpeed."""
    cfg_src = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None)
    if getattr(args, "deepscale_config", None) is not None:
        logger.warning("--deepscale_config is deprecated, please use --deepspeed_config")
        if from_args is not None:
            raise ConfigError("given both a deepscale_config and a deepspeed_config in args")
        from_args = args.deepscale_config
    if from_args is not None:
        if cfg_src is not None:
            raise ConfigError(
                "given a DeepSpeed config both in args (--deepspeed_config) and in the initialize() call"
            )
        cfg_src = from_args
    if cfg_src is None:
        raise ConfigError(
            "no config: pass config= (a dict or a JSON file path) or --deepspeed_config",
            hint="DeepSpeed requires --deepspeed_config to specify configuration file",
        )
    return cfg_src


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
    cfg_src = _config_source(args, config, config_params)
    if dist_init_required is not False:
        init_distributed()
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = _local_rank()  # DeepSpeed aligns args.local_rank with the launcher's LOCAL_RANK
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
