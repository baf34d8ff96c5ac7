"""``engine.zero``: DeepSpeed's ``deepspeed.zero`` namespace over the engine's partitioned params; the ZeRO
machinery itself lives in the submodules (``param``, ``partition``, ``collectives``, ``shm``, ``fetcher``,
``hooks``, ``external``, ``grads``).

``GatheredParameters(params, modifier_rank=None)`` makes stage-3 params full inside the block (one bucketed
all-gather; they are not released under it) and releases them on exit. With ``modifier_rank`` set, the
values that rank holds at exit are broadcast and written back into every rank's partition (master, shard
and, under stages 0-2, the full param), so edits made inside the block survive. Params that the engine does
not manage pass through untouched.

``register_external_parameter`` / ``unregister_external_parameter``: see ``engine.zero.external``.

``Init`` is accepted for compatibility: build the model under it (or on the meta device) and the engine
partitions it at ``initialize``; it does not partition at construction time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from engine.zero.external import register_external_parameter, unregister_external_parameter
from engine.zero.param import ParamState

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter"]


def _states(params: Any) -> list[tuple[ParamState, Any]]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        params = [params]
    out: list[tuple[ParamState, Any]] = []
    seen: set[int] = set()
    for p in params:
        st = getattr(p, "_zstate", None)
        ref = getattr(p, "_zengine", None)
        eng = ref() if ref is not None else None
        if st is not None and eng is not None and id(st) not in seen:
            seen.add(id(st))
            out.append((st, eng))
    return out


class GatheredParameters:
    """Context manager: the given params are full inside; edits on ``modifier_rank`` are kept at exit."""

    def __init__(
        self,
        params: Iterable[Any] | torch.Tensor | None,
        modifier_rank: int | None = None,
        fwd_module: Any = None,
        enabled: bool = True,
    ) -> None:
        self.items = _states(params) if enabled else []
        self.modifier_rank = modifier_rank
        self._was_gathered: list[bool] = []

    def __enter__(self) -> GatheredParameters:
        self._was_gathered = [s.gathered for s, _ in self.items]
        for s, eng in self.items:
            if eng.fetcher is not None:
                eng.fetcher.claim([s])
                eng.fetcher.gather([s])
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.items:
            return
        if self.modifier_rank is not None and exc[0] is None:
            with torch.no_grad():
                for s, eng in self.items:
                    if eng.fetcher is not None:
                        eng.fetcher.sync()  # no copy still reads the host shard rewritten below
                    eng.comm.broadcast_(s.param.data, self.modifier_rank)
                    if s.master is not None:
                        s.master.copy_(s.slice_of(s.param.data))
                    if s.shard is not None and s.shard is not s.master:
                        s.shard.copy_(s.slice_of(s.param.data))
        for (s, eng), was in zip(self.items, self._was_gathered, strict=True):
            if eng.fetcher is not None:
                eng.fetcher.unclaim([s])
            if not was and (eng.fetcher is None or not eng.fetcher.claims.get(id(s))):
                s.release()


@contextlib.contextmanager
def Init(*_args: Any, **_kwargs: Any) -> Any:  # noqa: N802  (DeepSpeed's name)
    """Compatibility no-op: the engine partitions the model at ``initialize``."""
    yield
