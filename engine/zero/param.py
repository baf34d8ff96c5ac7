"""Per-parameter partition state: which slice of each parameter this rank owns, and the tensors that hold it.

Note: engine tensors
--------------------
Every unique ``nn.Parameter`` of the model gets one ``ParamState``. The names below are used everywhere:

- **original**: the user's ``nn.Parameter`` (``state.param``). The autograd leaf the model uses; under
  stage 3 its ``.data`` is swapped between *gathered* and an empty tensor, so the object never changes.
- **gathered**: the full parameter in the compute dtype (fp32/fp16/bf16), shape ``param.shape``. Under stages
  0-2 the original always holds it; under stage 3 only between a module's pre-hook and its release.
- **shard**: this rank's partition in the compute dtype, flat, ``chunk`` elements (padding zero). Stage 3 only
  (stages 0-2 keep the gathered tensor instead), and only where there is something to partition (partition
  world > 1) or to offload (``offload_param``, then on the CPU); otherwise ``sharded`` is False and the
  original keeps the full tensor.
- **master**: the fp32 partition the optimizer updates (trainable params only), flat, ``chunk`` elements.
  With fp32 compute under stage 3 the shard *is* the master (one tensor). Lives on the CPU with
  ``offload_optimizer``.
- **grad shard**: partition of the rank-averaged gradient (trainable params only), ``chunk`` elements,
  accumulated over the micro-steps of one optimizer step; its padding stays zero. fp32, except where a
  compute-dtype buffer holds exactly what autograd produced (one process, one micro-step per optimizer
  step, gradients on the device): then it has the compute dtype and the optimizer widens it chunk by chunk.

Partitioning is per parameter in every stage: the flat parameter is split in ``partition_world`` chunks of
``chunk = ceil(numel / partition_world)`` elements; rank r owns ``[r * chunk, r * chunk + valid)``
(``zckpt.partition.chunk_range``), the trailing ranks holding padding. ``partition_world`` is the world size
(stages 1-3) or 1 (stage 0, plain data parallel).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zckpt.partition import chunk_range, chunk_size


class ParamStatus(enum.Enum):
    """Where the original's ``.data`` points."""

    GATHERED = "gathered"
    """``param.data`` is the full tensor (always, under stages 0-2)."""
    RELEASED = "released"
    """``param.data`` is an empty tensor; the values live in the shard (stage 3)."""


class LiveParams:
    """The gathered, non-persistent stage-3 params of this rank, oldest first: DeepSpeed's *live parameters*
    (``stage3_max_live_parameters`` bounds ``numel``); ``peak`` is the most seen at once."""

    def __init__(self) -> None:
        self.numel = 0
        self.peak = 0
        self.order: dict[int, ParamState] = {}

    def add(self, s: ParamState) -> None:
        if id(s) not in self.order:
            self.order[id(s)] = s
            self.numel += s.numel
            self.peak = max(self.peak, self.numel)

    def drop(self, s: ParamState) -> None:
        if self.order.pop(id(s), None) is not None:
            self.numel -= s.numel


@dataclass(eq=False)
class ParamState:
    """The partition of one unique parameter on this rank (see the Note above for each tensor's meaning)."""

    name: str
    """The owner name (first name in ``named_parameters(remove_duplicate=False)``)."""
    param: nn.Parameter
    shape: tuple[int, ...]
    numel: int
    partition_world: int
    rank: int
    trainable: bool
    sharded: bool
    """True under stage 3: the gathered tensor is released after use."""
    persistent: bool = False
    """Stage 3 param small enough (``stage3_param_persistence_threshold``) to stay gathered."""
    aliases: tuple[str, ...] = ()
    flat_offset: int = -1
    """Where this param's chunk starts in the engine's flat buffers (trainable params; see ``Engine``)."""
    shard: torch.Tensor | None = None
    master: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None
    status: ParamStatus = ParamStatus.GATHERED
    live: LiveParams | None = None
    """The fetcher's count of gathered params, for sharded non-persistent params (None otherwise)."""
    ready: Any = None
    """A CUDA event the gathered tensor's host-to-device copy records on the copy stream; a consumer's stream
    waits on it before the first use (``engine.zero.fetcher``). None: ready on the current stream."""

    @property
    def chunk(self) -> int:
        return chunk_size(self.numel, self.partition_world)

    @property
    def start(self) -> int:
        return chunk_range(self.numel, self.partition_world, self.rank)[0]

    @property
    def valid(self) -> int:
        return chunk_range(self.numel, self.partition_world, self.rank)[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype

    @property
    def gathered(self) -> bool:
        return self.status is ParamStatus.GATHERED

    # -- building blocks ----------------------------------------------------------------------------
    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk (padded with zeros to ``chunk``) of a full tensor, as a new flat tensor."""
        flat = full.reshape(-1)[self.start : self.start + self.valid]
        return F.pad(flat, (0, self.chunk - self.valid)).clone()

    def local_values(self) -> torch.Tensor:
        """This rank's chunk of the current parameter values in the compute dtype (padding included)."""
        if self.sharded:
            assert self.shard is not None
            return self.shard
        return self.slice_of(self.param.data)

    def set_gathered(self, full_flat: torch.Tensor) -> None:
        """Point the original at a full tensor (``numel`` elements, compute dtype)."""
        self.param.data = full_flat.view(self.shape)
        self.status = ParamStatus.GATHERED
        self.ready = None
        if self.live is not None:
            self.live.add(self)

    def release(self) -> None:
        """Drop the gathered tensor (stage 3, non-persistent params only)."""
        if self.sharded and not self.persistent and self.gathered:
            self.param.data = torch.empty(0, dtype=self.param.dtype, device=self.param.device)
            self.status = ParamStatus.RELEASED
            self.ready = None
            if self.live is not None:
                self.live.drop(self)

    def __repr__(self) -> str:
        return (
            f"ParamState({self.name!r}, shape={list(self.shape)}, chunk={self.chunk}, start={self.start}, "
            f"valid={self.valid}, status={self.status.value}, trainable={self.trainable})"
        )
