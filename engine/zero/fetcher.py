"""Stage-3 parameter fetching: gather and release param shards in buckets, within a live-parameter budget.

``ParamFetcher`` is driven by the module hooks (``engine.zero.hooks``) and owns every decision about *which*
params are gathered *when*:

- **claims**: a param used by a running forward (its module's, or an external param registered to a running
  module) or held by ``GatheredParameters`` is *claimed* and never released under it; a param gathered for
  a module's backward is held until its gradient is accumulated (trainable) or until the gradients of that
  module's inputs are computed (frozen);
- **prefetch by trace**: the params of the modules that ran next in the previous forward (reverse order in
  backward) are gathered with the current module's, up to ``stage3_prefetch_bucket_size`` elements;
- **reuse distance**: after its forward, a module keeps its params gathered when its backward use comes
  within ``stage3_max_reuse_distance`` gathered elements (DeepSpeed's rule), so the backward needs no
  second all-gather;
- **live budget**: the gathered non-persistent elements (``LiveParams``) stay within
  ``stage3_max_live_parameters``: prefetch stops at the budget, and a gather that would exceed it first
  releases unclaimed params (oldest first: params kept for reuse, then unused prefetches). Only what one
  module needs at once can go over it;
- **host-to-device copies** (``offload_param`` on CUDA): shards are copied on a dedicated copy stream into
  buffers allocated there; each gathered param carries the event of its copy (``ParamState.ready``) and the
  compute stream waits on it just before the first use, so a prefetch's copy overlaps the current module's
  compute.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from engine.zero.collectives import Comm
from engine.zero.external import register_external_parameter
from engine.zero.param import LiveParams, ParamState


class ParamFetcher:
    """Gathers and releases the sharded params of one engine (see the module docstring)."""

    def __init__(
        self,
        comm: Comm,
        device: torch.device,
        states: Sequence[ParamState],
        *,
        bucket_numel: int,
        prefetch_numel: int,
        max_reuse: int = 0,
        max_live: int = 1 << 62,
        copy_stream: Any = None,
    ) -> None:
        self.comm = comm
        self.device = device
        self.bucket_numel = max(1, bucket_numel)
        self.prefetch_numel = prefetch_numel
        self.max_reuse = max_reuse
        self.max_live = max_live
        self.copy_stream = copy_stream
        """A ``torch.cuda.Stream`` for host-to-device shard copies (param offload on CUDA), else None."""
        self.states = [s for s in states if s.sharded]
        self.known = {id(s) for s in self.states}
        self.live = LiveParams()
        for s in self.states:
            if not s.persistent:
                s.live = self.live
        self.module_params: dict[nn.Module, list[ParamState]] = {}
        """Each module's own (direct) params; ``params_of`` adds its registered external params."""
        self.stack: list[tuple[nn.Module, list[ParamState]]] = []
        """The modules whose forward is running, innermost last, each with the params it claimed."""
        self.claims: dict[int, int] = {}
        self._bwd: dict[int, ParamState] = {}
        self._retained = False
        self._trace: list[nn.Module] = []
        self._prev_trace: list[nn.Module] = []
        self._pos: dict[nn.Module, int] = {}
        self._suffix_of: tuple[int, list[int]] = (0, [])
        self._fwd_pos = 0
        self._bwd_pos = -1
        self._bwd_len = 0
        self._ahead: _Lookahead | None = None
        self._behind: _Lookahead | None = None

    # -- which params ---------------------------------------------------------------------------------
    def params_of(self, module: nn.Module) -> list[ParamState]:
        """The module's direct params, then its external params (``register_external_parameter``)."""
        own = self.module_params.get(module, [])
        ext = module.__dict__.get("_external_params")  # (getattr on a module raises first: slow)
        if not ext:
            return own
        out = list(own)
        for p in ext.values():
            s = getattr(p, "_zstate", None)
            if s is not None and id(s) in self.known and all(s is not o for o in out):
                out.append(s)
        return out

    def claim(self, states: Iterable[ParamState]) -> None:
        for s in states:
            self.claims[id(s)] = self.claims.get(id(s), 0) + 1

    def unclaim(self, states: Iterable[ParamState]) -> None:
        for s in states:
            n = self.claims.get(id(s), 0) - 1
            if n > 0:
                self.claims[id(s)] = n
            else:
                self.claims.pop(id(s), None)

    def _free(self, s: ParamState) -> bool:
        """Whether nothing holds ``s``: no running forward, no ``GatheredParameters``, no backward."""
        return not self.claims.get(id(s)) and id(s) not in self._bwd

    # -- gather / release -------------------------------------------------------------------------------
    def gather(self, states: Iterable[ParamState], prefetch: Iterable[ParamState] = ()) -> None:
        """Make ``states`` gathered and ready on the current stream; start gathering ``prefetch`` as far as
        the live budget allows (ready when first used)."""
        states = list(states)
        need: list[ParamState] = []
        seen: set[int] = set()
        for s in states:
            if not s.gathered and id(s) not in seen:
                seen.add(id(s))
                need.append(s)
        cost = sum(s.numel for s in need if s.live is not None)
        over = self.live.numel + cost - self.max_live
        if over > 0:
            self._evict(over, {id(s) for s in states})
        room = self.max_live - self.live.numel - cost
        for s in prefetch:
            if s.gathered or id(s) in seen:
                continue
            c = s.numel if s.live is not None else 0
            if c > room:
                break
            room -= c
            seen.add(id(s))
            need.append(s)
        self._fetch(need)
        for s in states:
            self.wait(s)

    def _evict(self, over: int, keep: set[int]) -> None:
        """Release unclaimed gathered params, oldest first, until ``over`` elements are freed."""
        for s in list(self.live.order.values()):
            if over <= 0:
                return
            if id(s) not in keep and self._free(s):
                over -= s.numel
                s.release()

    def _fetch(self, states: Sequence[ParamState]) -> None:
        """One all-gather per bucket of same-dtype shards (``allgather_bucket_size`` elements)."""
        todo: dict[torch.dtype, list[ParamState]] = {}
        for s in states:
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
            if bucket:
                self._gather_bucket(bucket)

    def _gather_bucket(self, bucket: Sequence[ParamState]) -> None:
        for s in bucket:
            assert s.shard is not None, s
        if self.comm.world == 1:
            # the shard is the whole param (stage 3 at world 1 only shards with param offload): its copy to
            # the device is the gathered tensor
            fulls, events = self._to_device(bucket, whole=True)
            for s, full, event in zip(bucket, fulls, events, strict=True):
                s.set_gathered(full)
                s.ready = event
            return
        shards, events = self._to_device(bucket, whole=False)
        if events[0] is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(events[-1])
            for t in {sh.untyped_storage().data_ptr(): sh for sh in shards}.values():
                t.record_stream(cur)
        fulls = self.comm.all_gather_params(shards, [s.numel for s in bucket])
        for s, full in zip(bucket, fulls, strict=True):
            s.set_gathered(full)

    def _to_device(self, bucket: Sequence[ParamState], whole: bool) -> tuple[list[torch.Tensor], list[Any]]:
        """The bucket's shards on the device (``whole``: each param's own full tensor, first ``numel``
        elements) and the copy-stream events to wait on, one per tensor (``whole``: each param's, so the first
        param is usable while the next ones are still copied) or one for all (None: nothing copied there)."""
        shards = [s.shard for s in bucket if s.shard is not None]
        none: list[Any] = [None] * len(shards)
        if shards[0].device == self.device:
            return (
                [sh[: s.numel].clone() for sh, s in zip(shards, bucket, strict=True)] if whole else shards
            ), none
        if self.copy_stream is None:
            moved = [sh.to(self.device, non_blocking=True) for sh in shards]
            return ([m[: s.numel] for m, s in zip(moved, bucket, strict=True)] if whole else moved), none
        events: list[Any] = []
        with torch.cuda.stream(self.copy_stream):
            if whole:  # one buffer per param: each is freed on its own release
                out = [torch.empty(s.numel, dtype=s.dtype, device=self.device) for s in bucket]
                for o, sh in zip(out, shards, strict=True):
                    o.copy_(sh[: o.numel()], non_blocking=True)
                    events.append(torch.cuda.Event())
                    events[-1].record(self.copy_stream)
                return out, events
            else:  # back to back in one buffer: the bucket's all-gather input, no concatenation
                flat = torch.empty(
                    sum(sh.numel() for sh in shards), dtype=shards[0].dtype, device=self.device
                )
                out, off = [], 0
                for sh in shards:
                    out.append(flat[off : off + sh.numel()])
                    out[-1].copy_(sh, non_blocking=True)
                    off += sh.numel()
                events.append(torch.cuda.Event())
                events[-1].record(self.copy_stream)
        return out, events

    def wait(self, s: ParamState) -> None:
        """Order the current stream after ``s``'s host-to-device copy (no-op when it has none pending)."""
        if s.ready is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(s.ready)
            s.param.data.record_stream(cur)  # allocated on the copy stream, used (and freed) on this one
            s.ready = None

    def sync(self) -> None:
        """Block the host until every host-to-device copy is done (before the host rewrites the shards)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def release_after_grad(self, s: ParamState) -> None:
        """A trainable param's gradient is accumulated: its backward uses are over."""
        self._bwd.pop(id(s), None)
        if not self.claims.get(id(s)):
            s.release()

    def release_all(self) -> None:
        """End of backward (or a forward no backward followed): drop every non-persistent gathered param."""
        self._bwd.clear()
        self.claims.clear()
        self.stack.clear()
        for s in self.states:
            s.release()
        self._retained = False

    # -- forward ----------------------------------------------------------------------------------------
    def start_forward(self) -> None:
        if self._retained or self.stack:  # a forward that no backward followed (or one that raised)
            self.release_all()
        if self._trace:  # without what a backward ran again (activation checkpointing)
            self._prev_trace = self._trace[: self._bwd_len] if self._bwd_len else self._trace
        self._bwd_len = 0
        self._trace = []
        self._pos = {}
        self._fwd_pos = 0
        self._ahead = (
            _Lookahead(self._prev_trace, self) if self.prefetch_numel > 0 and self._prev_trace else None
        )

    def pre_forward(self, module: nn.Module) -> None:
        states = self.params_of(module)
        self.stack.append((module, list(states)))
        self.claim(states)
        prev = self._prev_trace
        ahead = self._ahead
        upcoming: list[ParamState] = []
        if ahead is not None and self._fwd_pos < len(prev) and prev[self._fwd_pos] is module:
            upcoming = ahead.next(self._fwd_pos, self.prefetch_numel)
        self._pos[module] = len(self._trace)
        self._trace.append(module)
        self._fwd_pos += 1
        if states or upcoming:
            self.gather(states, upcoming)
            if ahead is not None:
                ahead.settle()

    def post_forward(self, module: nn.Module, returned: Sequence[ParamState] = ()) -> None:
        """Unclaim the module's params; release them unless its backward reuses them soon (``max_reuse``).
        ``returned``: params the module returned, now external params of the module that called it."""
        top, claimed = self.stack.pop() if self.stack else (module, [])
        if top is not module:  # a hook went missing (an exception inside a nested forward): resynchronise
            self.stack.clear()
        if returned and self.stack:
            self.add_external(returned)
        self.unclaim(claimed)
        if claimed and self._keep(module):
            self._retained = True
            return
        for s in claimed:
            if self._free(s):
                s.release()

    def add_external(self, states: Iterable[ParamState]) -> None:
        """Register ``states`` as external params of the innermost running module, claim and gather them."""
        module, claimed = self.stack[-1]
        new = [s for s in states if all(s is not c for c in claimed)]
        for s in new:
            register_external_parameter(module, s.param)
        claimed.extend(new)
        self.claim(new)
        self.gather(new)

    def _keep(self, module: nn.Module) -> bool:
        if self.max_reuse <= 0 or not torch.is_grad_enabled():
            return False
        prev = self._prev_trace
        i = self._pos.get(module)
        if i is None or i >= len(prev) or prev[i] is not module:
            return False  # no complete trace to go by (first step, or the order changed)
        if self._suffix_of[0] != id(prev):
            sizes = [sum(s.numel for s in self.params_of(m)) for m in prev]
            suffix = [0] * (len(prev) + 1)
            for j in range(len(prev) - 1, -1, -1):
                suffix[j] = suffix[j + 1] + sizes[j]
            self._suffix_of = (id(prev), suffix)
        # gathered between this forward use and the backward one: the rest of the forward, then the
        # backward of those same modules
        return 2 * self._suffix_of[1][i + 1] < self.max_reuse

    # -- backward ---------------------------------------------------------------------------------------
    def start_backward(self) -> None:
        # a forward run again in backward (activation checkpointing) adds to ``_trace`` after this point;
        # the backward walks the trace of the forward proper, whose length is taken here
        self._bwd_len = len(self._trace)
        self._bwd_pos = self._bwd_len - 1
        self._behind = _Lookahead(self._trace[::-1], self) if self.prefetch_numel > 0 else None

    def pre_backward(self, module: nn.Module) -> None:
        states = self.params_of(module)
        for s in states:
            self._bwd[id(s)] = s
        upcoming: list[ParamState] = []
        trace = self._trace
        pos = self._bwd_pos
        while pos >= 0 and trace[pos] is not module:
            pos -= 1
        behind = self._behind
        if pos >= 0:
            self._bwd_pos = pos - 1
            if behind is not None:
                upcoming = behind.next(self._bwd_len - 1 - pos, self.prefetch_numel)
        self.gather(states, upcoming)
        if behind is not None:
            behind.settle()

    def post_backward(self, module: nn.Module) -> None:
        """The gradients of the module's inputs are computed: its frozen params are no longer needed."""
        for s in self.params_of(module):
            if not s.trainable and self._bwd.pop(id(s), None) is not None and not self.claims.get(id(s)):
                s.release()


class _Lookahead:
    """The params of one pass in order of use (forward: the previous forward's trace; backward: this
    forward's, reversed) and how far prefetching has got: each module's prefetch tops the window up to
    ``prefetch`` elements past the module, so a pass scans every param once, not once per module."""

    def __init__(self, modules: Sequence[nn.Module], fetcher: ParamFetcher) -> None:
        self.states: list[ParamState] = []
        self.starts: list[int] = []
        for m in modules:
            self.starts.append(len(self.states))
            self.states.extend(fetcher.params_of(m))
        self.starts.append(len(self.states))
        self.cum = [0]
        for s in self.states:
            self.cum.append(self.cum[-1] + (s.numel if s.live is not None else 0))
        self.frontier = 0
        self._asked: list[tuple[int, ParamState]] = []

    def next(self, pos: int, window: int) -> list[ParamState]:
        """The not yet gathered params after the module at position ``pos``, until ``window`` elements lie
        between its end and the frontier; ``settle`` after the gather moves the frontier."""
        lo = self.starts[pos + 1]
        j = max(self.frontier, lo)
        asked: list[tuple[int, ParamState]] = []
        while j < len(self.states) and self.cum[j] - self.cum[lo] < window:
            if not self.states[j].gathered:
                asked.append((j, self.states[j]))
            j += 1
        self._asked = asked
        self.frontier = j
        return [s for _, s in asked]

    def settle(self) -> None:
        """Move the frontier back to the first asked param the gather left out (the live budget)."""
        for j, s in self._asked:
            if not s.gathered:
                self.frontier = j
                break
        self._asked = []
