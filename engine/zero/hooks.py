"""Stage-3 parameter fetching: module hooks that gather params just in time and release them after use.

``ParamFetcher`` owns the gather/release of parameter *shards* in buckets; ``install_hooks``
wires it into a model:

- forward pre-hook of each module with direct parameters: gather them in ONE bucketed all-gather, with
  the params of the modules that ran next in the previous forward, up to ``prefetch_bucket_size`` elements
  (prefetch by trace, as DeepSpeed does);
- forward post-hook: release them (unless persistent, or reused by the backward within
  ``stage3_max_reuse_distance`` elements of the previous step's trace, as DeepSpeed decides), and put a
  multi-grad hook on the module's outputs so
  that, when the first gradient of an output arrives in backward, the params are gathered again (with the
  modules that ran before it prefetched, in reverse trace order);
- after backward, params are released as their gradient is accumulated (``engine.zero.grads``) and the engine
  releases whatever is left (frozen params, unused params).

A param used by several modules (tied weights) is gathered once and stays gathered while any user runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from engine.zero.collectives import Comm
from engine.zero.param import ParamState


class ParamFetcher:
    """Gathers and releases stage-3 params in buckets, and remembers the module order for prefetch."""

    def __init__(
        self, comm: Comm, device: torch.device, bucket_numel: int, prefetch_numel: int, max_reuse: int = 0
    ) -> None:
        self.comm = comm
        self.max_reuse = max_reuse
        """``stage3_max_reuse_distance``: after its forward, a module keeps its params gathered when its
        backward use comes within this many gathered elements (per the previous step's trace), as DeepSpeed
        does; the backward then needs no second all-gather."""
        self._pos: dict[nn.Module, int] = {}
        self._suffix_of: tuple[int, list[int]] = (0, [])
        self._retained = False
        self.device = device
        self.bucket_numel = max(1, bucket_numel)
        self.prefetch_numel = prefetch_numel
        self.module_params: dict[nn.Module, list[ParamState]] = {}
        self._trace: list[nn.Module] = []
        self._prev_trace: list[nn.Module] = []
        self._fwd_pos = 0
        self._bwd_pos = -1

    # -- gather / release -----------------------------------------------------------------------
    def gather(self, states: Iterable[ParamState]) -> None:
        """Make every state in ``states`` gathered; one all-gather per bucket of same-dtype shards."""
        todo: dict[torch.dtype, list[ParamState]] = {}
        seen: set[int] = set()
        for s in states:
            if not s.gathered and id(s) not in seen:
                seen.add(id(s))
                todo.setdefault(s.dtype, []).append(s)
        for group in todo.values():
            bucket: list[ParamState] = []
            size = 0
            for s in group:
                bucket.append(s)
                size += s.numel
                if size >= self.bucket_numel:
                    self._gather_bucket(bucket)
                    bucket, size = [], 0
            self._gather_bucket(bucket)

    def _gather_bucket(self, bucket: Sequence[ParamState]) -> None:
        if not bucket:
            return
        shards = []
        for s in bucket:
            assert s.shard is not None, s
            shards.append(s.shard.to(self.device, non_blocking=True))
        if self.comm.world == 1:
            # the shard is the whole param (stage 3 at world 1 only shards with param offload): its
            # host-to-device copy is the gathered tensor; copy only when the shard already lives there
            for s, sh in zip(bucket, shards, strict=True):
                s.set_gathered((sh.clone() if sh is s.shard else sh)[: s.numel])
            return
        fulls = self.comm.all_gather_params(shards, [s.numel for s in bucket])
        for s, full in zip(bucket, fulls, strict=True):
            s.set_gathered(full)

    @staticmethod
    def release(states: Iterable[ParamState]) -> None:
        for s in states:
            s.release()

    def release_all(self) -> None:
        for states in self.module_params.values():
            self.release(states)
        self._retained = False

    # -- prefetch by trace ----------------------------------------------------------------------
    def _upcoming(self, order: Sequence[nn.Module]) -> list[ParamState]:
        out: list[ParamState] = []
        size = 0
        for m in order:
            for s in self.module_params.get(m, ()):
                if size >= self.prefetch_numel:
                    return out
                if not s.gathered:
                    out.append(s)
                    size += s.numel
        return out

    def start_forward(self) -> None:
        if self._retained:  # a forward that no backward followed: drop what it kept
            self.release_all()
        if self._trace:
            self._prev_trace = self._trace
        self._trace = []
        self._pos = {}
        self._fwd_pos = 0

    def post_forward(self, module: nn.Module) -> None:
        """Release the module's params unless its backward reuses them soon (``max_reuse``)."""
        if self._keep(module):
            self._retained = True
            return
        self.release(self.module_params[module])

    def _keep(self, module: nn.Module) -> bool:
        if self.max_reuse <= 0 or not torch.is_grad_enabled():
            return False
        prev = self._prev_trace
        i = self._pos.get(module)
        if i is None or i >= len(prev) or prev[i] is not module:
            return False  # no complete trace to go by (first step, or the order changed)
        if self._suffix_of[0] != id(prev):
            sizes = [sum(s.numel for s in self.module_params.get(m, ())) for m in prev]
            suffix = [0] * (len(prev) + 1)
            for j in range(len(prev) - 1, -1, -1):
                suffix[j] = suffix[j + 1] + sizes[j]
            self._suffix_of = (id(prev), suffix)
        # gathered between this forward use and the backward one: the rest of the forward, then the
        # backward of those same modules
        return 2 * self._suffix_of[1][i + 1] < self.max_reuse

    def pre_forward(self, module: nn.Module) -> None:
        states = self.module_params[module]
        extra: list[ParamState] = []
        prev = self._prev_trace
        if self.prefetch_numel > 0 and self._fwd_pos < len(prev) and prev[self._fwd_pos] is module:
            extra = self._upcoming(prev[self._fwd_pos + 1 :])
        self._pos[module] = len(self._trace)
        self._trace.append(module)
        self._fwd_pos += 1
        self.gather([*states, *extra])

    def start_backward(self) -> None:
        self._bwd_pos = len(self._trace) - 1

    def pre_backward(self, module: nn.Module) -> None:
        states = self.module_params[module]
        extra: list[ParamState] = []
        trace = self._trace
        pos = self._bwd_pos
        while pos >= 0 and trace[pos] is not module:
            pos -= 1
        if pos >= 0:
            self._bwd_pos = pos - 1
            if self.prefetch_numel > 0:
                extra = self._upcoming(trace[pos - 1 :: -1] if pos > 0 else [])
        self.gather([*states, *extra])


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors inside a forward output (tensor, tuple/list, dict or dict-like ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def install_hooks(model: nn.Module, fetcher: ParamFetcher) -> list[Any]:
    """Register the stage-3 forward/backward hooks on every module owning params; return handles."""
    handles: list[Any] = []

    def root_pre(_m: nn.Module, _args: Any) -> None:
        fetcher.start_forward()

    def pre(module: nn.Module, _m: nn.Module, _args: Any) -> None:
        fetcher.pre_forward(module)

    def pre_backward(module: nn.Module, _grads: Any) -> None:
        fetcher.pre_backward(module)

    def post(module: nn.Module, _m: nn.Module, _args: Any, output: Any) -> None:
        fetcher.post_forward(module)
        if torch.is_grad_enabled():
            outs = [t for t in _tensors(output) if t.requires_grad]
            if outs:
                torch.autograd.graph.register_multi_grad_hook(outs, partial(pre_backward, module), mode="any")

    handles.append(model.register_forward_pre_hook(root_pre))
    for module, states in fetcher.module_params.items():
        if states:
            handles.append(module.register_forward_pre_hook(partial(pre, module)))
            handles.append(module.register_forward_hook(partial(post, module)))
    return handles
