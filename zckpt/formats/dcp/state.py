"""The ``TrainingState`` of a DCP checkpoint, from its classified non-model keys.

- Optimizer: param groups from ``param_groups.<i>.<k>`` (``params`` = the FQN list) or torchtitan's flattened
  ``param_groups.<fqn>.<k>`` (one copy per parameter: consecutive parameters with equal options form a
  group, so two adjacent groups with identical options read as one); ``kind`` from the state names and
  ``decoupled_weight_decay`` (DCP does not record the class). Options keep ``None`` values (``foreach``,
  ``fused``...) and ``initial_lr``: a DCP writer needs every key the optimizer has.
- Scheduler: the ``lr_scheduler``/``scheduler`` values rebuilt at their paths.
- Counters: ``train_state.step`` (an int or a 0-d tensor) when saved, else the optimizer's ``step``.
- Client state: every other value at its path (``train_state``, ``dataloader``, user keys), tensors as
  entries. Opaque values (pickles, ``io.BytesIO``) are not in it: they are listed in
  ``meta.extra["values"]`` and kept as raw byte ranges in ``framework["dcp"]["raw"]`` for a DCP writer to
  copy verbatim.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from zckpt.formats.dcp.layout import Slot
from zckpt.formats.dcp.values import Value
from zckpt.model import TensorEntry
from zckpt.state import Counters, OptimizerState, ParamGroup, to_json
from zckpt.storage import fileio


def set_path(root: dict[Any, Any], path: tuple[str | int, ...], value: Any) -> None:
    """``root[p0][p1]...[pn] = value``, creating dicts on the way (list indices stay int keys)."""
    node = root
    for p in path[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = node[p] = {}
        node = nxt
    node[path[-1]] = value


def listify(o: Any) -> Any:
    """Dicts keyed ``0..n-1`` (list indices of DCP paths) back into lists, recursively."""
    if isinstance(o, dict):
        d = {k: listify(v) for k, v in o.items()}
        if d and all(isinstance(k, int) for k in d) and sorted(d) == list(range(len(d))):
            return [d[i] for i in range(len(d))]
        return d
    return o


def _options(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {k: to_json(v) for k, v in raw.items() if k != "params"}


def param_groups(
    groups: Mapping[int | str, Mapping[str, Any]], optim_names: Iterable[str]
) -> list[ParamGroup]:
    """Groups from indexed (``{i: {params, ...}}``) or flattened (``{fqn: {...}}``) options, in order."""
    indexed = sorted((k, v) for k, v in groups.items() if isinstance(k, int))
    out = [ParamGroup(tuple(str(p) for p in g.get("params") or ()), _options(g)) for _, g in indexed]
    flat = [(k, v) for k, v in groups.items() if isinstance(k, str)]
    order = {n: i for i, n in enumerate(optim_names)}
    flat.sort(key=lambda kv: order.get(str(kv[0]), len(order)))
    names: list[str] = []
    current: dict[str, Any] | None = None
    for fqn, g in flat:
        opts = _options(g)
        if current is not None and opts != current:
            out.append(ParamGroup(tuple(names), current))
            names = []
        names.append(str(fqn))
        current = opts
    if current is not None:
        out.append(ParamGroup(tuple(names), current))
    return out


def kind_of(state_names: Iterable[str], groups: Iterable[ParamGroup]) -> str:
    """The optimizer class, as far as its state names and options tell (DCP does not record it)."""
    names = set(state_names)
    if {"exp_avg", "exp_avg_sq"} <= names:
        decoupled = any(g.options.get("decoupled_weight_decay") for g in groups)
        return "AdamW-like" if decoupled else "Adam-like"
    return "SGD-like" if "momentum_buffer" in names else "torch"


def optimizer(
    groups: Mapping[int | str, Mapping[str, Any]], optim: list[TensorEntry]
) -> OptimizerState | None:
    if not optim and not groups:
        return None
    names = list(dict.fromkeys(e.name for e in optim))
    states = tuple(dict.fromkeys(str(e.state) for e in optim))
    pg = tuple(param_groups(groups, names))
    return OptimizerState(kind_of(states, pg), pg, states)


def _scalar(e: TensorEntry) -> Any:
    """The one value of a one-element entry: a Python number kept inline, or its stored bytes (no torch)."""
    (p,) = e.pieces
    if p.file:
        fd = fileio.open_fd(p.file)
        try:
            raw = fileio.pread(fd, p.dtype.itemsize, p.byte_offset)
        finally:
            fileio.close_fd(fd)
        try:
            return p.dtype.unpack(raw)
        except ValueError:  # cut short, or a dtype with no Python number (no counter either)
            return None
    return p.value if isinstance(p.value, (int, float)) else p.inline().reshape(-1)[0].item()


def _int_of(v: Any) -> int | None:
    if isinstance(v, TensorEntry):
        if v.numel != 1:
            return None
        v = _scalar(v)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def counters(client: Mapping[str, Any], optim: list[TensorEntry]) -> Counters:
    ts = client.get("train_state")
    step = _int_of(ts.get("step")) if isinstance(ts, Mapping) else None
    if step is None:
        first = next((e for e in optim if e.state == "step"), None)
        step = _int_of(first) if first is not None else None
    return Counters(global_steps=step)


def assemble(
    slots: Mapping[str, Slot],
    paths: Mapping[str, tuple[str | int, ...]],
    values: Mapping[str, Value],
    client_tensors: Mapping[str, TensorEntry],
) -> tuple[dict[int | str, dict[str, Any]], Any, dict[str, Any], dict[str, Any]]:
    """(raw param-group options, scheduler state, client state, raw byte ranges of opaque values, each with
    its full ``planner_data`` path)."""
    groups: dict[int | str, dict[str, Any]] = {}
    sched: dict[Any, Any] = {}
    client: dict[Any, Any] = {}
    raw: dict[str, Any] = {}
    for key, v in values.items():
        s = slots[key]
        if v.opaque is not None or v.inner:
            raw[key] = {
                "path": list(paths[key]),
                "file": v.file,
                "offset": v.info.offset,
                "length": v.info.length,
                "what": v.describe(),
            }
        elif s.kind == "group" and s.group is not None:
            groups.setdefault(s.group, {})[s.state] = v.value
        elif s.kind == "scheduler" and s.path:
            set_path(sched, s.path, v.value)
        elif s.kind == "client":
            set_path(client, s.path, v.value)
    for key, e in client_tensors.items():  # a tensor option (torch takes a tensor ``lr``) goes to its group
        s = slots[key]
        if s.kind == "group" and s.group is not None:
            groups.setdefault(s.group, {})[s.state] = e
        else:
            set_path(client, s.path, e)
    return groups, listify(sched) if sched else None, listify(client), raw
