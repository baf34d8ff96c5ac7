"""Gradient reduction: full gradients of several params bucketed into one collective, averaged over the
ranks, and accumulated into each param's *grad shard* (``engine.zero.param``).

A post-accumulate-grad hook on every trainable parameter hands its ``.grad`` to ``GradReducer.add`` as soon as
autograd has finished summing it (so a tied parameter arrives once, with both uses added), then drops
``.grad`` and, under stage 3, releases the gathered parameter. When a bucket reaches ``reduce_bucket_size``
elements it is reduce-scattered (stages 1-3) or all-reduced (stage 0) *asynchronously*: the collective runs
while autograd computes the next bucket's gradients, and its result is added into the grad shards when the
next bucket is launched (one reduction in flight, as DeepSpeed's ``overlap_comm``). ``flush`` sends the rest
and waits when the engine's backward ends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.zero.collectives import Comm, Reduction
from engine.zero.param import ParamState


class GradReducer:
    """Collects full gradients and reduces them bucket by bucket into grad shards.

    World 1 has nothing to reduce: each gradient is added straight into its slot of the engine's flat grad
    buffer (one ``add_``, mixed-dtype into fp32 or exact into a compute-dtype buffer), so no bucket is held.
    With the grad buffer on the host and the gradients on an accelerator (optimizer offload), each gradient
    is copied asynchronously into a pinned compute-dtype mirror of that buffer, and ``flush`` adds the mirror
    in one host op.
    """

    def __init__(
        self,
        comm: Comm,
        bucket_numel: int,
        partition_world: int,
        device: torch.device,
        flat_grad: torch.Tensor,
        dtype: torch.dtype,
    ) -> None:
        self.comm = comm
        self.bucket_numel = max(1, bucket_numel)
        self.partition_world = partition_world
        self.device = device
        self.flat_grad = flat_grad
        self.dtype = dtype
        self.comm_dtype: torch.dtype | None = None
        """The dtype gradients are reduced in (``communication_data_type``, set by the engine); None: own."""
        self.direct = comm.world == 1
        self.to_host = flat_grad.device != device
        self._staging: torch.Tensor | None = None
        self._staged: list[ParamState] = []
        self.n_trainable = 0
        self._norms: list[torch.Tensor] = []
        self._sum_sq: torch.Tensor | None = None
        self.fresh = False
        """The flat grad buffer counts as zero (set by the optimizer instead of zeroing it; staging path
        only): the next flush copies instead of adding. ``materialize`` zeroes it for real."""
        self._pending: dict[torch.dtype, list[tuple[ParamState, torch.Tensor]]] = {}
        self._pending_numel: dict[torch.dtype, int] = {}
        self._inflight: tuple[Reduction, list[ParamState]] | None = None

    def add(self, state: ParamState, grad: torch.Tensor) -> None:
        assert state.grad_shard is not None
        if self.direct:
            if not self.to_host:
                state.grad_shard.add_(grad.reshape(-1))
                return
            if self._staging is None:
                self._staging = torch.empty(
                    self.flat_grad.numel(), dtype=self.dtype, pin_memory=torch.cuda.is_available()
                )
            off = state.flat_offset
            self._staging[off : off + state.numel].copy_(grad.reshape(-1), non_blocking=True)
            self._staged.append(state)
            # the norm on the accelerator, while the gradient is there (saves a host pass at the step)
            self._norms.append(torch.linalg.vector_norm(grad, dtype=torch.float32))
            return
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
        self._finish()  # the previous bucket's result is read before its buffers are reused
        states = [s for s, _ in bucket]
        work = self.comm.start_reduce_grads(
            [g for _, g in bucket], [s.chunk for s in states], self.partition_world, self.comm_dtype
        )
        bucket.clear()  # laid out: the full gradients can go now
        self._inflight = (work, states)

    def _finish(self) -> None:
        """Wait for the reduction in flight, if any, and add its result into the grad shards."""
        if self._inflight is None:
            return
        work, states = self._inflight
        self._inflight = None
        mine = work.wait()
        if mine.device != self.flat_grad.device:
            mine = mine.to(self.flat_grad.device)  # one device-to-host copy per bucket
        off = 0
        for s in states:
            assert s.grad_shard is not None
            s.grad_shard.add_(mine[off : off + s.chunk])
            off += s.chunk

    def take_sum_sq(self) -> torch.Tensor | None:
        """The squared norm of the grad buffer when the accelerator computed it (float64, on the host)."""
        sq, self._sum_sq = self._sum_sq, None
        return None if sq is None else sq.cpu()

    def materialize(self) -> None:
        """Make a lazily zeroed grad buffer really zero."""
        if self.fresh:
            self.flat_grad.zero_()
            self.fresh = False

    def flush(self) -> None:
        """Reduce every pending gradient. Ranks must call it at the same point (end of backward)."""
        for dtype in sorted(self._pending, key=str):
            self._reduce(dtype)
        self._finish()
        if self._staged:
            assert self._staging is not None
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            norms, self._norms = self._norms, []
            if len(self._staged) == self.n_trainable:
                if self.fresh:
                    self.flat_grad.copy_(self._staging)
                    # the buffer now holds exactly these gradients: their norms give its norm
                    self._sum_sq = torch.stack(norms).double().square().sum()
                else:
                    self.flat_grad.add_(self._staging)
                    self._sum_sq = None
                self.fresh = False
            else:
                self._sum_sq = None
                self.materialize()
                for s in self._staged:
                    assert s.grad_shard is not None
                    s.grad_shard.add_(self._staging[s.flat_offset : s.flat_offset + s.numel])
            self._staged.clear()


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
