"""External parameters: a stage-3 param used in the forward of a module that does not own it.

DeepSpeed's ``deepspeed.zero.register_external_parameter(module, param)`` declares one explicitly: the param
is then gathered with ``module``'s own in its forward (and backward) and released after it. Most external
uses are found without it, as DeepSpeed finds them: ``watch`` replaces each module's ``_parameters`` dict by
one that notices a param read (``self.wte.weight`` from a parent's forward, a head reading another module's
weight) while a forward runs that does not hold that param; the fetcher then registers it to the innermost
running module and gathers it before the read returns. Params reached without an attribute read (kept in a
list, say) need the explicit registration.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Gather ``parameter`` for ``module``'s forward and backward, as if ``module`` owned it (DeepSpeed's
    ``deepspeed.zero.register_external_parameter``; a no-op for the engine outside stage 3)."""
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")
    ext = module.__dict__.setdefault("_external_params", {})
    ext[id(parameter)] = parameter


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo ``register_external_parameter`` (DeepSpeed's ``unregister_external_parameter``)."""
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")
    ext = module.__dict__.get("_external_params")
    if not ext or id(parameter) not in ext:
        raise RuntimeError("Parameter is not a registered external parameter of module.")
    del ext[id(parameter)]


@torch.compiler.disable
def _add_external(fetcher: Any, s: Any) -> None:
    """Register and gather ``s`` (eagerly: under ``torch.compile`` dynamo must not trace the gather's
    collectives; the read's checks above stay traced, with guards)."""
    fetcher.add_external([s])


class _WatchedParams(dict[str, Any]):
    """A module's ``_parameters``: reading a param that no running forward holds registers it (see above)."""

    __slots__ = ("fetcher",)
    fetcher: Any

    def __getitem__(self, key: str) -> Any:
        p = dict.__getitem__(self, key)
        f = self.fetcher
        if f.stack and p is not None:
            s = getattr(p, "_zstate", None)
            if s is not None and s.live is not None and not f.claims.get(id(s)) and id(s) in f.known:
                _add_external(f, s)
        return p

    def __reduce__(self) -> Any:  # copies and pickles of the module get a plain dict back
        return (dict, (dict(self),))


def watch(model: nn.Module, fetcher: Any) -> None:
    """Replace the ``_parameters`` of every module of ``model`` that has params (see the module docstring)."""
    for m in model.modules():
        params = m.__dict__.get("_parameters")
        if params and not isinstance(params, _WatchedParams):
            watched = _WatchedParams(params)
            watched.fetcher = fetcher
            m.__dict__["_parameters"] = watched


def unwatch(model: nn.Module) -> None:
    """Give every module of ``model`` a plain ``_parameters`` dict back."""
    for m in model.modules():
        params = m.__dict__.get("_parameters")
        if isinstance(params, _WatchedParams):
            m.__dict__["_parameters"] = dict(params)


def tensor_params(tensors: list[torch.Tensor], known: set[int]) -> list[Any]:
    """The states of the managed params among ``tensors`` (a module that returns a param)."""
    out = []
    for t in tensors:
        s = getattr(t, "_zstate", None) if isinstance(t, nn.Parameter) else None
        if s is not None and id(s) in known:
            out.append(s)
    return out
