"""``import deepspeed`` on the engine: a script written for DeepSpeed runs unchanged under ``python -m
engine.run SCRIPT`` (``engine.run``), which puts the folder above this package (``engine/alias``, with this
package's ``deepspeed-0.19.8+engine.dist-info``) first on that process's import path. Importing ``deepspeed``
there gives the ``engine`` module itself, and DeepSpeed's submodule names that scripts import
(``deepspeed.comm``, ``deepspeed.accelerator``, ``deepspeed.utils``, ``deepspeed.zero``,
``deepspeed.checkpointing``) are the engine's modules of the same role. DeepSpeed's deeper paths are
namespaces holding the engine's objects: ``deepspeed.ops.adam`` (and ``.fused_adam``, ``.cpu_adam``:
``FusedAdam``, ``DeepSpeedCPUAdam``), ``deepspeed.ops.lamb`` (``FusedLamb``, refused on use),
``deepspeed.runtime.lr_schedules`` (``engine.optim.scheduler``) and
``deepspeed.runtime.activation_checkpointing.checkpointing``, and
``deepspeed.runtime.zero.partition_parameters`` (``GatheredParameters``, ``Init``, and the two names
transformers' ``prevent_arange_dtype_change`` swaps around ``zero.Init`` in a ZeRO-3 ``from_pretrained``:
inert, the engine's ``Init`` wraps no constructor). ``engine.run`` refuses to start where real DeepSpeed is
importable (``.venv-ds``), so this folder is never on the path beside it.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

import engine
from engine import accelerator, checkpointing, comm, utils, zero
from engine.optim import adam, scheduler


def _namespace(name: str, **attrs: Any) -> types.ModuleType:
    """A module ``deepspeed.<name>`` holding ``attrs``, registered in ``sys.modules``."""
    mod = types.ModuleType(f"deepspeed.{name}", f"DeepSpeed's deepspeed.{name} on the engine.")
    mod.__path__ = []  # a package: a missing submodule is "No module named ...", not "not a package"
    for key, value in attrs.items():
        setattr(mod, key, value)
    sys.modules[mod.__name__] = mod
    return mod


for _name, _module in (
    ("comm", comm),
    ("accelerator", accelerator),
    ("utils", utils),
    ("zero", zero),
    ("checkpointing", checkpointing),
    ("runtime.lr_schedules", scheduler),
    ("runtime.activation_checkpointing.checkpointing", checkpointing),
):
    sys.modules[f"deepspeed.{_name}"] = _module
_adam = {"FusedAdam": adam.FusedAdam, "DeepSpeedCPUAdam": adam.DeepSpeedCPUAdam}
_ops = _namespace(
    "ops",
    adam=_namespace(
        "ops.adam",
        **_adam,
        fused_adam=_namespace("ops.adam.fused_adam", FusedAdam=adam.FusedAdam),
        cpu_adam=_namespace("ops.adam.cpu_adam", DeepSpeedCPUAdam=adam.DeepSpeedCPUAdam),
    ),
    lamb=_namespace(
        "ops.lamb",
        FusedLamb=adam.FusedLamb,
        fused_lamb=_namespace("ops.lamb.fused_lamb", FusedLamb=adam.FusedLamb),
    ),
)


def _constructor_wrapper(fn: Any, *_args: Any, **_kwargs: Any) -> Any:
    """DeepSpeed's ``zero_wrapper_for_fp_tensor_constructor``: the engine's ``zero.Init`` wraps no tensor
    constructor, so this returns ``fn`` itself (transformers swaps it around ``zero.Init``)."""
    return fn


def clone_tensors_for_torch_save(item: Any, device: Any = None) -> Any:
    """DeepSpeed's ``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``: ``item`` with every tensor
    (nested in lists, tuples, dicts) cloned onto ``device`` (default CPU), detached. accelerate's
    ``get_state_dict`` uses it for ZeRO-0/1/2 (``trainer.save_model()``)."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    if isinstance(item, torch.Tensor):
        return item.detach().clone() if item.device == dev else item.detach().to(dev)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, dev) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, dev) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, dev) for k, v in item.items()})
    return item


# ``deepspeed.checkpoint`` is DeepSpeed's checkpoint-utilities package, not ``engine.checkpoint`` (engine's
# save/load): registered here so that the import system never loads ``engine/checkpoint`` a second time
# under that name.
_namespace(
    "checkpoint",
    utils=_namespace("checkpoint.utils", clone_tensors_for_torch_save=clone_tensors_for_torch_save),
)
_pp = _namespace(
    "runtime.zero.partition_parameters",
    zero_wrapper_for_fp_tensor_constructor=_constructor_wrapper,
    _orig_torch_arange=torch.arange,
    GatheredParameters=zero.GatheredParameters,
    Init=zero.Init,
)
_runtime = _namespace(
    "runtime",
    lr_schedules=scheduler,
    activation_checkpointing=_namespace("runtime.activation_checkpointing", checkpointing=checkpointing),
    zero=_namespace("runtime.zero", partition_parameters=_pp, GatheredParameters=zero.GatheredParameters),
)
engine.ops = _ops  # type: ignore[attr-defined]
engine.runtime = _runtime  # type: ignore[attr-defined]
sys.modules[__name__] = engine
