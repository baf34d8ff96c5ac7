"""Cross-checks between the rank files of one DeepSpeed save: every field DeepSpeed 0.19.8 writes that is the
same on every rank of one save must agree; a file that disagrees with the majority is named as the one mixed
in or altered, beside a file that holds the majority's value, with the field (and, for nested values such as
``ds_config``, the first differing key).

The fields (docs/deepspeed-format.md §2-3):
- every file (model and optimizer states) that records them: ``ds_config``, ``ds_version``;
- model-states files (one per rank under ZeRO-3): the counters ``global_steps``, ``global_samples``,
  ``skipped_steps``, ``dp_world_size``, ``mp_world_size``, ``param_shapes``, ``frozen_param_shapes``,
  ``buffer_names``, ``lr_scheduler``, ``checkpoint_parallel_dimensions``, ``random_ltd``, ``optimizer`` (None
  in ZeRO's model files) and the names and kinds of the ``module`` entries, buffers with their dtype and
  shape, the type of ``shared_params`` (its entries are rank 0's alone: ``{}`` on the other ranks);
  client-state keys and the curriculum ``data_sampler``, which holds RNG states, may differ per rank);
- optimizer ``optimizer_state_dict``s: ``zero_stage``, ``loss_scaler`` (all its state),
  ``dynamic_loss_scale``, ``overflow``, ``clip_grad``, ``partition_count``, ``param_alignment_paddings``
  (per group and param: DeepSpeed pads the flat group before partitioning it), ``ds_version``, the number of
  flat fp32 groups, the inner optimizer's ``param_groups`` (every hyper-parameter and the group indices)
  and its ``step`` values.
Values that legitimately differ per rank (the partitions, their paddings, ``param_slice_mappings``, frozen
fragments) are not compared. Two files equal in every one of these fields -- same run settings, step and
layout -- cannot be told apart here (docs/safety.md, "Files of one save").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zckpt.codecs.pickle_safe import TensorRef
from zckpt.dtypes import DType
from zckpt.errors import ShardMismatch
from zckpt.formats._schema import Node
from zckpt.state import to_json

_MODEL_FIELDS = (
    "global_steps",
    "global_samples",
    "skipped_steps",
    "dp_world_size",
    "mp_world_size",
    "param_shapes",
    "frozen_param_shapes",
    "buffer_names",
    "lr_scheduler",
    "checkpoint_parallel_dimensions",
    "random_ltd",
    "optimizer",
)
_OPTIM_FIELDS = (
    "zero_stage",
    "loss_scaler",
    "dynamic_loss_scale",
    "overflow",
    "clip_grad",
    "partition_count",
    "param_alignment_paddings",
    "ds_version",
)
_HINT = "files of two saves or runs are mixed, or one was altered"
_LINE = 280
"""Longest error line aimed at (values are shortened to fit)."""


def plain(v: Any, depth: int = 0) -> Any:
    """``v`` as comparable JSON values: stand-in objects by their state, tensors by shape and dtype."""
    if depth > 50:
        return "..."
    if isinstance(v, TensorRef):
        return f"<tensor {list(v.shape)} {to_json(v.dtype)}>"
    if isinstance(v, dict):
        return {str(k): plain(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x, depth + 1) for x in v]
    if v is not None and not isinstance(v, (bool, int, float, str, DType)) and hasattr(v, "__dict__"):
        return {type(v).__name__: plain(vars(v), depth + 1)}
    return to_json(v)


def _steps(o: Node) -> list[float]:
    """The inner optimizer's ``step`` values (4 bytes read per 0-d tensor)."""
    steps: set[float] = set()
    inner = _inner(o)
    state = inner.get("state") if isinstance(inner, dict) else None
    for per in state.values() if isinstance(state, dict) else ():
        v = per.get("step") if isinstance(per, dict) else None
        if isinstance(v, TensorRef) and v.numel == 1:
            steps.add(float(v.scalar()))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            steps.add(float(v))
    return sorted(steps)


def _inner(o: Node) -> Any:
    """The wrapped torch optimizer's state dict of one ``optimizer_state_dict`` (ZeRO-3 or ZeRO-1/2)."""
    return (
        o.value.get("optimizer_state_dict")
        if o.has("fp32_flat_groups")
        else o.value.get("base_optimizer_state")
    )


def _param_groups(o: Node) -> Any:
    inner = _inner(o)
    return plain(inner.get("param_groups")) if isinstance(inner, dict) else None


def _flat_groups(o: Node) -> Any:
    flat = o.value.get("fp32_flat_groups", o.value.get("single_partition_of_fp32_groups"))
    return len(flat) if isinstance(flat, (list, tuple)) else type(flat).__name__


def _module_kinds(n: Node) -> Any:
    """The names of a model-states file's ``module`` entries and whether each is a tensor; a buffer's dtype
    and shape too (every rank saves the whole buffer; params' shapes may differ: ZeRO-3's placeholders)."""
    m = n.value.get("module")
    if not isinstance(m, dict):
        return type(m).__name__
    names = n.value.get("buffer_names")
    buffers = {str(b) for b in names} if isinstance(names, (list, tuple)) else set()

    def kind(k: Any, v: Any) -> Any:
        if not isinstance(v, TensorRef):
            return False
        return [str(v.dtype), list(v.shape)] if str(k) in buffers else True

    return [[str(k), kind(k, v)] for k, v in m.items()]


def _shared_kind(n: Node) -> str:
    """What a model-states file's ``shared_params`` is: a dict on every rank (DeepSpeed fills rank 0's)."""
    return type(n.value["shared_params"]).__name__ if n.has("shared_params") else _MISSING


def _first_diff(a: Any, b: Any, path: str = "") -> str:
    """The dotted path of the first place ``a`` and ``b`` differ ("" when at the top)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if a.get(k, _MISSING) != b.get(k, _MISSING):
                return _first_diff(a.get(k, _MISSING), b.get(k, _MISSING), f"{path}.{k}" if path else k)
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return _first_diff(x, y, f"{path}[{i}]")
    return path


_MISSING = "<absent>"


def _short(v: Any, n: int) -> str:
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def _agree(files: list[Node], field: str, value: Callable[[Node], Any]) -> None:
    """Refuse when one file's ``value`` differs from the majority's, naming it, a majority file, the field
    and (for nested values) the first differing key."""
    vals = [value(n) for n in files]
    keys = [repr(v) for v in vals]
    if len(set(keys)) <= 1:
        return
    common = Counter(keys).most_common(1)[0][0]
    i = next(i for i, k in enumerate(keys) if k != common)
    j = keys.index(common)
    odd, ref = vals[i], vals[j]
    where = _first_diff(odd, ref)
    label, a, b = (f"{field}.{where}", _at(odd, where), _at(ref, where)) if where else (field, odd, ref)
    other = Path(files[j].file).name
    room = max(20, (_LINE - len(files[i].file) - len(label) - len(other) - 12) // 2)  # one readable line
    raise ShardMismatch(
        f"{files[i].file}: {label} {_short(a, room)} vs {_short(b, room)} in {other}",
        hint=_HINT,
        path=files[i].file,
    )


def _at(v: Any, path: str) -> Any:
    """The value at a ``_first_diff`` path."""
    for part in path.replace("[", ".[").split("."):
        if not part:
            continue
        if part.startswith("[") and isinstance(v, list):
            v = v[int(part[1:-1])]
        elif isinstance(v, dict):
            v = v.get(part, _MISSING)
    return v


def cross_check(models: list[Node], outers: list[Node], osds: list[Node]) -> None:
    """The files of one save agree (see the module doc): ``models`` are the model-states files, ``outers``
    the optimizer files' top-level dicts, ``osds`` their ``optimizer_state_dict``s."""
    for key in _MODEL_FIELDS:
        _agree(models, key, lambda n, key=key: plain(n.value.get(key, _MISSING)))  # type: ignore[misc]
    _agree(models, "module entries (names, kinds)", _module_kinds)
    _agree(models, "shared_params (its type)", _shared_kind)  # its value is rank 0's alone: {} elsewhere
    for key in ("ds_version", "ds_config"):  # among the files that record it (DeepSpeed >= 0.4 writes both)
        having = [n for n in models + outers if n.has(key)]
        _agree(having, key, lambda n, key=key: plain(n.value[key]))  # type: ignore[misc]
    for key in _OPTIM_FIELDS:
        _agree(osds, key, lambda n, key=key: plain(n.value.get(key, _MISSING)))  # type: ignore[misc]
    _agree(osds, "number of flat fp32 groups", _flat_groups)
    _agree(osds, "optimizer param_groups", _param_groups)
    _agree(osds, "optimizer step", _steps)
