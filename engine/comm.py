"""``engine.comm``: DeepSpeed's ``deepspeed.comm`` (``import deepspeed.comm as dist``) over torch.distributed.

Owns the collective API a training script calls directly: ranks and sizes, ``barrier`` and the usual
collectives, with torch's signatures and DeepSpeed's extra keyword arguments (``prof``, ``log_name``,
``debug``) accepted and ignored. ``ReduceOp`` is torch's. Without a process group -- the engine's world of
one process started without a launcher (``engine.dist.init_distributed``) -- ranks read 0, sizes 1 and
every collective leaves its tensors as they are (what it computes in a world of one). Any other name
(``new_group``, ``send``, ``recv``...) is torch.distributed's own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as _td

from engine.dist import init_distributed
from engine.dist import local_rank as _launcher_local_rank

ReduceOp = _td.ReduceOp

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_available",
    "is_initialized",
    "reduce",
    "reduce_scatter_tensor",
]

_DS_KWARGS = ("prof", "log_name", "debug")
"""Keyword arguments DeepSpeed's wrappers add to torch's (profiling and logging); the engine drops them."""


def _torch_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in _DS_KWARGS}


def _single() -> bool:
    """No process group: the engine runs as one process (every collective is the identity)."""
    return not (_td.is_available() and _td.is_initialized())


def is_available() -> bool:
    return _td.is_available()


def is_initialized() -> bool:
    return not _single()


def get_rank(group: Any = None) -> int:
    return 0 if _single() else _td.get_rank(group)


def get_world_size(group: Any = None) -> int:
    return 1 if _single() else _td.get_world_size(group)


def get_local_rank() -> int:
    """The launcher's ``LOCAL_RANK`` (0 without one), as DeepSpeed's ``get_local_rank``."""
    return _launcher_local_rank()


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return group_rank if _single() else _td.get_global_rank(group, group_rank)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, **kwargs: Any) -> Any:
    if _single():
        return None
    return _td.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **kwargs: Any
) -> Any:
    if _single():
        return None
    return _td.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    **kwargs: Any,
) -> Any:
    if _single():
        return None
    return _td.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(
    tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, **kwargs: Any
) -> Any:
    if _single():
        return None
    return _td.broadcast(tensor, src, group=group, async_op=async_op)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None) -> None:
    if not _single():
        _td.broadcast_object_list(object_list, src, group=group, device=device)


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    **kwargs: Any,
) -> Any:
    if _single():
        tensor_list[0].copy_(tensor)
        return None
    return _td.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    **kwargs: Any,
) -> Any:
    if _single():
        output_tensor.copy_(tensor.reshape(output_tensor.shape))
        return None
    return _td.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    if _single():
        object_list[0] = obj
        return
    _td.all_gather_object(object_list, obj, group=group)


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    **kwargs: Any,
) -> Any:
    if _single():
        output_tensor.copy_(tensor.reshape(output_tensor.shape))
        return None
    return _td.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def destroy_process_group(group: Any = None) -> None:
    if not _single():
        _td.destroy_process_group(group)


def __getattr__(name: str) -> Any:
    """Every other ``deepspeed.comm`` name is torch.distributed's (``new_group``, ``send``, ``gather``...)."""
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(_td, name)
