"""Cross-checks between the rank files of one DeepSpeed save: the same DeepSpeed version, step, shapes,
buffers, ``module`` entries, optimizer step, loss scale and config everywhere; a file that disagrees with
the majority is named as the one mixed in or altered."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from zckpt.errors import ShardMismatch
from zckpt.formats._schema import Node
from zckpt.io import storage
from zckpt.io.pickle_safe import TensorRef
from zckpt.state import to_json


def _signature(o: Node) -> tuple[tuple[float, ...], Any]:
    """(the inner optimizer's step values, the loss scale) of one optimizer file: the same on every rank of
    one save."""
    inner = (
        o.value.get("optimizer_state_dict")
        if o.has("fp32_flat_groups")
        else o.value.get("base_optimizer_state")
    )
    steps: set[float] = set()
    state = inner.get("state") if isinstance(inner, dict) else None
    for per in state.values() if isinstance(state, dict) else ():
        v = per.get("step") if isinstance(per, dict) else None
        if isinstance(v, TensorRef) and v.numel == 1:
            one = torch.empty(1, dtype=v.dtype)
            storage.read_into(v.file, v.byte_offset, one)  # 4 bytes: the one tensor value read at open
            steps.add(float(one.item()))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            steps.add(float(v))
    scale = getattr(o.value.get("loss_scaler"), "__dict__", {}).get("cur_scale")
    return tuple(sorted(steps)), scale


def _odd_one(files: list[Node], value: Callable[[Node], str]) -> tuple[Node, Node] | None:
    """(a file whose ``value`` is not the majority's, a file that holds the majority's), or None when all
    agree: the message then names the file that is likely mixed in, not whichever came last."""
    vals = [value(n) for n in files]
    if len(set(vals)) <= 1:
        return None
    common = Counter(vals).most_common(1)[0][0]
    odd = next(n for n, v in zip(files, vals, strict=True) if v != common)
    return odd, files[vals.index(common)]


def _value_repr(n: Node, key: str) -> str:
    return repr(to_json(n.value.get(key)))  # plain JSON values: repr never fails (a torch.Size's can)


def _module_kinds(n: Node) -> str:
    """The names of a model-states file's ``module`` entries and whether each is a tensor (shapes may differ
    between ranks: ZeRO-3 keeps placeholders)."""
    m = n.value.get("module")
    if not isinstance(m, dict):
        return type(m).__name__
    return repr([(str(k), isinstance(v, TensorRef)) for k, v in m.items()])


def cross_check(models: list[Node], osds: list[Node]) -> None:
    """Files of one save agree: same DeepSpeed version, config, step and loss scale everywhere."""
    for key in ("ds_version", "global_steps", "param_shapes", "frozen_param_shapes", "buffer_names"):
        pair = _odd_one(models, partial(_value_repr, key=key))
        if pair:
            odd, ref = pair
            mine, theirs = _value_repr(odd, key), _value_repr(ref, key)
            shown = (
                f" {mine:.40} differs from {Path(ref.file).name}'s {theirs:.40}"
                if len(mine) < 40
                else (f" differs from {Path(ref.file).name}'s")
            )
            raise ShardMismatch(
                f"{odd.file}: {key}{shown}",
                hint="files of two saves are mixed, or one was altered",
                path=odd.file,
            )
    pair = _odd_one(models, _module_kinds)
    if pair:
        odd, ref = pair
        raise ShardMismatch(
            f"{odd.file}: its `module` entries (names or kinds) differ from {Path(ref.file).name}'s",
            hint="files of two saves are mixed, or one was altered",
            path=odd.file,
        )
    sigs = {id(o): _signature(o) for o in osds}
    pair = _odd_one(osds, lambda o: repr(sigs[id(o)]))
    if pair:
        odd, ref = pair
        raise ShardMismatch(
            f"{odd.file}: its optimizer step or loss scale {sigs[id(odd)]} differs from "
            f"{Path(ref.file).name}'s {sigs[id(ref)]}",
            hint="a rank file of another save is mixed in",
            path=odd.file,
        )
    with_cfg = [n for n in models + osds if isinstance(n.value.get("ds_config"), dict)]
    pair = _odd_one(with_cfg, lambda n: repr(to_json(n.value.get("ds_config"))))
    if pair:
        odd, ref = pair
        raise ShardMismatch(
            f"{odd.file}: ds_config differs from {Path(ref.file).name}'s",
            hint="files of two runs are mixed",
            path=odd.file,
        )
