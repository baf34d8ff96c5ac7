"""Gradient reduction: full gradients of several params bucketed into one collective, averaged over the
ranks, and accumulated into each param's fp32 *grad shard* (``engine.param``).

A post-accumulate-grad hook on every trainable parameter hands its ``.grad`` to ``GradReducer.add`` as soon as
autograd has finished summing it (so a tied parameter arrives once, with both uses added), then drops
``.grad`` and, under stage 3, releases the gathered parameter. When a bucket reaches ``reduce_bucket_size``
elements it is reduce-scattered (stages 1-3) or all-reduced (stage 0); ``flush`` sends the rest when the
engine's backward ends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.collectives import Comm
from engine.param import ParamState


class GradReducer:
    """Collects full gradients and reduces them bucket by bucket into grad shards."""

    def __init__(self, comm: Comm, bucket_numel: int, partition_world: int) -> None:
        self.comm = comm
        self.bucket_numel = max(1, bucket_numel)
        self.partition_world = partition_world
        self._pending: dict[torch.dtype, list[tuple[ParamState, torch.Tensor]]] = {}
        self._pending_numel: dict[torch.dtype, int] = {}

    def add(self, state: ParamState, grad: torch.Tensor) -> None:
        bucket = self._pending.setdefault(grad.dtype, [])
        bucket.append((state, grad))
        n = self._pending_numel.get(grad.dtype, 0) + grad.numel()
        self._pending_numel[grad.dtype] = n
        if n >= self.bucket_numel:
            self._reduce(grad.dtype)

    def _reduce(self, dtype: torch.dtype) -> None:
        bucket = self._pending.pop(dtype, [])
        self._pending_numel.pop(dtype, None)
        if not bucket:
            return
        chunks = self.comm.reduce_grads(
            [g for _, g in bucket], [s.chunk for s, _ in bucket], self.partition_world
        )
        for (state, _), chunk in zip(bucket, chunks, strict=True):
            state.add_grad(chunk)

    def flush(self) -> None:
        """Reduce every pending gradient. Ranks must call it at the same point (end of backward)."""
        for dtype in sorted(self._pending, key=str):
            self._reduce(dtype)


def make_grad_hook(
    state: ParamState, reducer: GradReducer, after: Callable[[ParamState], None] | None = None
) -> Callable[[torch.Tensor], None]:
    """The post-accumulate-grad hook of one parameter: hand over ``.grad``, drop it, then ``after(state)``."""

    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        reducer.add(state, grad)
        if after is not None:
            after(state)

    return hook
