"""``deepspeed.checkpointing`` on the engine: *activation* checkpointing (recompute a segment's forward in
backward), not the model checkpoints of ``engine.checkpoint``.

``checkpoint(function, *args, **kwargs)`` is DeepSpeed's reentrant ``CheckpointFunction`` as a script sees
it, built on ``torch.utils.checkpoint.checkpoint(use_reentrant=True)``: the segment runs without recording,
is run again in backward with the forward's RNG state restored (dropout draws the same mask), and gives the
gradients of the unchecked model. As in DeepSpeed, gradients reach the segment's parameters only through
inputs that require grad; keyword tensors are passed as positional ones; one output is returned bare, several
as a tuple.

``configure(mpu_, deepspeed_config=None, ...)`` takes DeepSpeed's options (the keyword arguments override the
config's ``activation_checkpointing`` block) and honours each or refuses it:

- ``checkpoint_in_cpu``/``cpu_checkpointing``: the saved segment inputs are kept in host memory
  (``torch.autograd.graph.save_on_cpu``) until backward;
- ``partition_activations`` and ``contiguous_checkpointing``: they split the saved inputs over the
  model-parallel group, which is one rank on the engine (no model parallelism), where DeepSpeed's result is
  the unpartitioned tensors too: recorded, nothing to do. An ``mpu_`` with a model-parallel world size above
  1 is refused (``NotImplementedError``);
- ``synchronize`` and ``profile`` (device synchronisation and timing logs around each segment, no effect on
  the results): recorded, not done; a warning says so.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint

from engine.accelerator import get_accelerator
from engine.config import activation_checkpointing_config
from engine.config.blocks import ACTIVATION_CHECKPOINTING
from engine.utils import logger

_KWARG_FOR_KEY = {
    "partition_activations": "partition_activations",
    "contiguous_memory_optimization": "contiguous_checkpointing",
    "number_checkpoints": "num_checkpoints",
    "cpu_checkpointing": "checkpoint_in_cpu",
    "synchronize_checkpoint_boundary": "synchronize",
    "profile": "profile",
}

options: dict[str, Any] = {kw: ACTIVATION_CHECKPOINTING[key] for key, kw in _KWARG_FOR_KEY.items()}
"""The options in force, under ``configure``'s keyword names (DeepSpeed's defaults until configured)."""
mpu: Any = None
deepspeed_checkpointing_enabled = False


def _model_parallel_size(mpu_: Any) -> int:
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        if hasattr(mpu_, name):
            return int(getattr(mpu_, name)())
    return 1


def configure(
    mpu_: Any,
    deepspeed_config: dict[str, Any] | str | Path | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """DeepSpeed's ``deepspeed.checkpointing.configure`` (see the module docstring for what is honoured)."""
    global mpu, deepspeed_checkpointing_enabled
    if mpu_ is not None and _model_parallel_size(mpu_) > 1:
        raise NotImplementedError(
            "deepspeed.checkpointing.configure: an mpu with model parallelism (world size > 1) is not "
            "supported by the engine (no model parallelism)"
        )
    new = {kw: ACTIVATION_CHECKPOINTING[key] for key, kw in _KWARG_FOR_KEY.items()}
    if deepspeed_config is not None:
        block = activation_checkpointing_config(deepspeed_config)
        new.update({kw: block[key] for key, kw in _KWARG_FOR_KEY.items()})
    given = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    new.update({k: v for k, v in given.items() if v is not None})
    if new["contiguous_checkpointing"] and not new["partition_activations"]:
        raise ValueError(
            "Contiguous Checkpointing is only available with partitioned activations. "
            "Set partitioned activations to true in deepspeed config"
        )
    if new["contiguous_checkpointing"] and new["num_checkpoints"] is None:
        raise ValueError("Must specify the number of layers with contiguous memory checkpointing")
    unapplied = [k for k in ("synchronize", "profile") if new[k]]
    if unapplied:
        logger.warning("deepspeed.checkpointing: %s recorded but not applied by the engine", unapplied)
    options.clear()
    options.update(new)
    if mpu_ is not None:
        mpu = mpu_
    deepspeed_checkpointing_enabled = True


def is_configured() -> bool:
    """True once ``configure`` has been called (DeepSpeed's ``is_configured``)."""
    return deepspeed_checkpointing_enabled


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here; the engine keeps none."""


def set_num_layers(nlayers: int) -> None:
    options["num_checkpoints"] = nlayers


def _bind_kwargs(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``function`` taking ``args + kwargs.values()`` positionally (DeepSpeed's keyword handling)."""
    n, keys = len(args), tuple(kwargs)

    def with_kwargs(*all_args: Any) -> Any:
        return function(*all_args[:n], **dict(zip(keys, all_args[n:], strict=True)))

    return with_kwargs


def _run(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], reentrant: bool) -> Any:
    if kwargs:
        function, args = _bind_kwargs(function, args, kwargs), args + tuple(kwargs.values())
    host = options["checkpoint_in_cpu"] and torch.is_grad_enabled()
    pin = host and get_accelerator().device_name() != "cpu"
    with torch.autograd.graph.save_on_cpu(pin_memory=pin) if host else nullcontext():
        out = torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=reentrant, preserve_rng_state=True
        )
    outs = [out] if isinstance(out, torch.Tensor) or not isinstance(out, tuple | list) else list(out)
    return outs[0] if len(outs) == 1 else tuple(outs)


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` keeping only its inputs; recompute it in backward (reentrant)."""
    return _run(function, args, kwargs, reentrant=True)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """DeepSpeed's non-reentrant variant: parameters get gradients even when no input requires grad."""
    return _run(function, args, {}, reentrant=False)
