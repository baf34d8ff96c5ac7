"""Stage-3 module hooks: they tell the ``ParamFetcher`` (``engine.zero.fetcher``) when each module runs.

``install_hooks`` puts on every module of the model:

- a forward pre-hook: the module's params (own and external) are claimed and gathered, with the next
  modules' prefetched; the module joins the stack of running forwards (which ``engine.zero.external`` reads
  to attribute a param read to the module that made it);
- a forward post-hook: the module's params are unclaimed and released (or kept for a near backward use);
  a param the module *returned* becomes an external param of its caller. When autograd records, a
  multi-grad hook on the outputs gathers the params again when the first output gradient arrives in
  backward (pre-backward), and, for a module with frozen params, one on the inputs releases them once the
  input gradients are computed (post-backward). Trainable params are released as their gradient is
  accumulated (``engine.zero.grads``), and the engine releases whatever is left after backward.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from engine.zero.external import tensor_params, watch
from engine.zero.fetcher import ParamFetcher


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors inside forward inputs/outputs (tensor, tuple/list, dict or dict-like ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def install_hooks(model: nn.Module, fetcher: ParamFetcher) -> list[Any]:
    """Register the stage-3 hooks on every module of ``model`` and watch its params; return the handles."""
    handles: list[Any] = []
    graph = torch.autograd.graph

    def root_pre(_m: nn.Module, _args: Any) -> None:
        fetcher.start_forward()

    def pre(module: nn.Module, _m: nn.Module, args: Any, kwargs: Any) -> None:
        fetcher.pre_forward(module)
        if torch.is_grad_enabled() and any(not s.trainable for s in fetcher.params_of(module)):
            ins = [t for t in _tensors((args, kwargs)) if t.requires_grad]
            if ins:
                graph.register_multi_grad_hook(ins, partial(post_backward, module), mode="all")

    def post(module: nn.Module, _m: nn.Module, _args: Any, output: Any) -> None:
        outs = _tensors(output)
        fetcher.post_forward(module, tensor_params(outs, fetcher.known))
        if torch.is_grad_enabled() and fetcher.params_of(module):
            grads = [t for t in outs if t.requires_grad]
            if grads:
                graph.register_multi_grad_hook(grads, partial(pre_backward, module), mode="any")

    def pre_backward(module: nn.Module, _grads: Any) -> None:
        fetcher.pre_backward(module)

    def post_backward(module: nn.Module, _grads: Any) -> None:
        fetcher.post_backward(module)

    # under torch.compile (``engine.compile``) the hooks run eagerly, as DeepSpeed's stage-3 hooks do: they
    # gather and release params with collectives, which dynamo must not trace
    root_pre, pre, post = (torch.compiler.disable(f) for f in (root_pre, pre, post))
    watch(model, fetcher)
    handles.append(model.register_forward_pre_hook(root_pre))
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(partial(pre, module), with_kwargs=True))
        handles.append(module.register_forward_hook(partial(post, module)))
    return handles
