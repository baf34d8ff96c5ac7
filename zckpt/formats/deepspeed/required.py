"""What a DeepSpeed model-states or optimizer file of a given DeepSpeed version must hold, beyond what its
layout needs to be read: the keys DeepSpeed always writes (a file without one was altered, and DeepSpeed
itself could not load it), and the types of ``shared_params`` and ``ds_config`` that every DeepSpeed run
saves. ``zckpt.formats.deepspeed.read`` checks them; each refusal names the file and the key."""

from __future__ import annotations

import re
from typing import Any, NoReturn

from zckpt.errors import CorruptCheckpoint
from zckpt.formats._schema import Node

REQUIRED_SINCE = (0, 10)
"""DeepSpeed versions from here on always write ``buffer_names``, ``param_shapes``, ``frozen_param_shapes``,
``frozen_param_fragments`` (both since 0.9.1), ``shared_params``, ``dp_world_size`` and ``mp_world_size``
(``engine._save_checkpoint``, None where unused): a file without one was altered. Reading on would drop
tensors silently, or take a tensor-parallel rank for a whole model, or (``reshard``) write out the altered
record as the run's own; DeepSpeed itself could not load it."""
MODEL_KEYS = ("module", "buffer_names", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
              "shared_params", "dp_world_size", "mp_world_size")  # fmt: skip
ZERO12_KEYS = ("group_paddings", "param_slice_mappings")
"""What a ZeRO-1/2 (and ``BF16_Optimizer``) ``optimizer_state_dict`` always holds from DeepSpeed 0.7.4 on
(checked, like ``MODEL_KEYS``, from ``REQUIRED_SINCE``): zckpt derives the padding itself and cross-checks
its math against the slice mappings, so a file without them would read right but pass unchecked, and
DeepSpeed itself could not load it."""
ALIGNMENT_SINCE = (0, 19, 8)
"""DeepSpeed's ZeRO-1/2 optimizer (not ``BF16_Optimizer``) writes ``param_alignment_paddings`` from here on
(docs: deepspeed-format §2); DeepSpeed reads its absence as "no alignment padding", so a file of these
versions without it was altered, and is refused rather than read with another layout."""


def version_of(v: Any) -> tuple[int, ...]:
    """``(major, minor, patch)`` of a DeepSpeed version string (``"0.19.8"``, ``"0.10.3+abc"``); ``(0,)`` when
    it is none."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(v))
    return tuple(int(x) for x in m.groups(default="0")) if m else (0,)


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def check_config(m0: Node) -> None:
    """``ds_config`` holds what DeepSpeed accepted at start-up: an object whose ``zero_optimization`` is an
    object (or a legacy boolean) and whose batch sizes are positive numbers. ``reshard --to deepspeed``
    rewrites these keys for the new world; another value was written by no DeepSpeed run."""
    cfg = m0.value.get("ds_config")
    if cfg is None:
        return
    if not isinstance(cfg, dict):
        _altered(m0, "ds_config", cfg)
    z = cfg.get("zero_optimization")
    if z is not None and not isinstance(z, (dict, bool)):
        _altered(m0, "ds_config.zero_optimization", z)
    for k in _BATCH_KEYS:
        v = cfg.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            _altered(m0, f"ds_config.{k}", v)


def _altered(m0: Node, key: str, value: Any) -> NoReturn:
    raise CorruptCheckpoint(
        f"{m0.file}: {key} is {value!r:.60}, not a value DeepSpeed starts with",
        hint="the file was altered; restore it",
        path=m0.file,
    )


def check_shared(m0: Node, partitioned: bool) -> None:
    """``shared_params`` is a mapping of tied names: DeepSpeed writes one in every file of a ZeRO-1/2/3 save
    (``{}`` where nothing is tied; filled on rank 0 alone) and None without a ZeRO optimizer (ZeRO-0)."""
    sp, version = m0.value.get("shared_params"), m0.value.get("ds_version")
    if isinstance(sp, dict) or (sp is None and not (partitioned and version_of(version) >= REQUIRED_SINCE)):
        return
    raise CorruptCheckpoint(
        f"{m0.file}: shared_params is {type(sp).__name__}, not a mapping of tied parameter names "
        f"(DeepSpeed {version} writes one in every ZeRO-1/2/3 save)",
        hint="the file was altered; restore it",
        path=m0.file,
    )


def require(
    node: Node, keys: tuple[str, ...], version: Any, where: str = "", since: tuple[int, ...] = REQUIRED_SINCE
) -> None:
    """A file of DeepSpeed ``since`` or later must hold every key of ``keys`` (DeepSpeed always writes them):
    one missing is refused, naming it (``where``: the dict's path in the file)."""
    if version_of(version) >= since:
        for k in keys:
            if not node.has(k):
                raise CorruptCheckpoint(
                    f"{node.file}: {where}{k} is missing (DeepSpeed {version} always writes it)",
                    hint="the file was altered; restore it",
                    path=node.file,
                )
