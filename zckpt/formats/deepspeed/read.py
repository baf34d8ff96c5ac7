"""Reading a DeepSpeed checkpoint (``DeepSpeedEngine.save_checkpoint``): ZeRO-0/1/2/3, BF16_Optimizer.

Finds the tag folder and its rank files (``files``), loads rank 0's model-states file and every
optimizer file through the schema (``common.load``), cross-checks the files with each other (world size,
partition counts, steps, versions, configs, archive names, partition sizes) and hands the layout to
``zero0`` / ``zero12`` / ``zero3``. Trainable params point at the fp32 master partitions, optimizer states
at the flat state partitions (same layout), frozen params and buffers at the 16-bit ``module`` /
``frozen_param_fragments`` tensors. Only each file's ``data.pkl`` is read here; tensor bytes are read later,
on demand. Everything that is not a tensor becomes the ``TrainingState``. ``deepspeed`` is never imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zckpt.checkpoint import Checkpoint
from zckpt.codecs.pickle_safe import TensorRef
from zckpt.errors import CorruptCheckpoint, ShardMismatch, Unsupported
from zckpt.formats._schema import Node
from zckpt.formats.deepspeed import zero0, zero3, zero12
from zckpt.formats.deepspeed.common import (
    DS_KEYS,
    MAX_WORLD,
    check_ties_declared,
    load,
    load_all,
    optim_entries,
    ref,
    tied_from_module,
    whole,
)
from zckpt.formats.deepspeed.crosscheck import cross_check
from zckpt.formats.deepspeed.files import check_ranks, resolve, scan
from zckpt.formats.deepspeed.required import (
    ALIGNMENT_SINCE,
    MODEL_KEYS,
    ZERO12_KEYS,
    check_config,
    check_shared,
    require,
)
from zckpt.model import Role, TensorEntry, precision_of
from zckpt.state import CheckpointMeta, Counters, OptimizerState, ParamGroup, TrainingState, to_json
from zckpt.storage.location import Location, location


@dataclass
class _Body:
    """What a layout reader found: the entries and the optimizer's shape."""

    stage: int
    world: int
    precision: str | None
    entries: list[TensorEntry] = field(default_factory=list)
    groups: list[Node] = field(default_factory=list)
    """The inner optimizer's param groups (hyper-parameters; ``params`` as slot indices)."""
    names_by_slot: dict[int, list[str]] = field(default_factory=dict)
    state_names: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    files: list[Location] = field(default_factory=list)
    optim0: Node | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _model0(td: Location, model_files: dict[int, Location], trust: bool) -> Node:
    if 0 not in model_files:
        f0 = td / "zero_pp_rank_0_mp_rank_00_model_states.pt"
        raise ShardMismatch(f"{f0}: missing model-states file of rank 0", path=str(f0))
    m0 = load(model_files[0], trust)
    mp = m0.get("mp_world_size")
    if mp is not None and mp.as_int(lo=1) > 1:
        raise Unsupported(
            f"{m0.file}: mp_world_size {mp.value}; tensor/pipeline parallel checkpoints are not "
            "supported yet",
            path=m0.file,
        )
    if not isinstance(m0["module"].value, dict):
        raise Unsupported(
            f"{m0.file}: `module` is {type(m0['module'].value).__name__} (pipeline-parallel layer files?)",
            path=m0.file,
        )
    require(m0, MODEL_KEYS, m0.value.get("ds_version"))
    return m0


def _names(node: Node | None) -> list[str]:
    return [] if node is None else [n.as_str() for n in node]


def read(path: Location, *, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
    save_dir, tag, td = resolve(location(path), tag)
    model_files, optim_files = scan(td)
    m0 = _model0(td, model_files, trust_pickle)
    buffer_names = _names(m0.get("buffer_names"))
    module = m0["module"]
    for name, t in module.items():  # a state dict holds tensors (and modules' own ``_extra_state`` objects)
        if not isinstance(t.value, TensorRef) and not str(name).endswith("_extra_state"):
            raise CorruptCheckpoint(
                f"{m0.file}: `module` entry {name!r:.80} is {type(t.value).__name__}, not a tensor",
                hint="the file was altered or is damaged",
                path=m0.file,
            )
    check_shared(m0, bool(optim_files))
    check_config(m0)
    if not optim_files:
        body = _zero0(td, model_files, m0, module, buffer_names)
    else:
        body = _partitioned(td, model_files, optim_files, m0, module, trust_pickle)
    for name in buffer_names:
        if name not in module.as_dict():
            raise CorruptCheckpoint(
                f"{m0.file}: buffer {name!r:.80} is listed but not in `module`", path=m0.file
            )
        body.entries.append(whole(name, ref(module[name]), Role.BUFFER))
    _check_module_covered(m0, module, body)
    check_ties_declared(m0, module, body.tied, buffer_names)
    state = _training_state(m0, body)
    meta = CheckpointMeta(
        format="deepspeed",
        path=str(td),
        world_size=body.world,
        tag=tag,
        save_dir=str(save_dir),
        tied=body.tied,
        files=tuple(str(f) for f in body.files),
        state=state,
        extra=body.extra,
    )
    return Checkpoint(meta, body.entries)


def _check_module_covered(m0: Node, module: Node, body: _Body) -> None:
    """Every tensor in ``module`` must be accounted for: a param, frozen param, buffer or tied alias, of that
    param's shape (ZeRO-3's empty placeholders aside). A renamed ``buffer_names``/``frozen_param_shapes``/
    ``shared_params`` leaves some unexplained; swapped tensors disagree with ``param_shapes``. And every
    trainable param must be in ``module`` (DeepSpeed saves the module's whole state dict, ZeRO-3 params as
    empty placeholders): a renamed module key would otherwise read as a frozen param of ZeRO-1, which names
    its frozen params nowhere else."""
    names = module.as_dict()
    for e in body.entries:
        if e.role is Role.PARAM and e.name not in names:
            raise CorruptCheckpoint(
                f"{m0.file}: trainable param {e.name!r:.80} (in `param_shapes`) is not in `module`",
                hint="the file was altered or is damaged",
                path=m0.file,
            )
    for alias, source in body.tied.items():  # DeepSpeed's aliases are the module's own duplicate names
        if alias not in names or source not in names:
            missing = alias if alias not in names else source
            raise CorruptCheckpoint(
                f"{m0.file}: tied weight {alias!r:.80} -> {source!r:.80} (in `shared_params`) names "
                f"{missing!r:.80}, which is not in `module`",
                hint="the file was altered or is damaged",
                path=m0.file,
            )
    shapes = {e.name: e.shape for e in body.entries if e.role is not Role.OPTIM}
    for name, t in module.items():
        if not isinstance(t.value, TensorRef):
            continue
        if name not in shapes and name not in body.tied:
            raise CorruptCheckpoint(
                f"{m0.file}: module tensor {name!r:.80} is neither a trainable param, a "
                "frozen param, a buffer nor a tied alias",
                hint="the file was altered or is damaged",
                path=m0.file,
            )
        if name in shapes and t.value.numel and tuple(t.value.shape) != tuple(shapes[name]):
            raise CorruptCheckpoint(
                f"{m0.file}: module tensor {name!r:.80} has shape {list(t.value.shape)} but the "
                f"checkpoint records {list(shapes[name])} for it",
                hint="the file was altered or is damaged",
                path=m0.file,
            )


def _zero0(
    td: Location, model_files: dict[int, Location], m0: Node, module: Node, buffers: list[str]
) -> _Body:
    if len(model_files) > 1:
        raise ShardMismatch(f"{td}: ZeRO-3 model-state files without optimizer files", path=str(td))
    sp = m0.get("shared_params")
    tied = (
        {a: o.as_str() for a, o in sp.items()} if sp is not None else tied_from_module(module, set(buffers))
    )
    z = zero0.read_zero0(m0, module, buffers, tied)
    world = m0.get("dp_world_size")
    body = _Body(
        stage=0,
        world=world.as_int(lo=1, hi=MAX_WORLD) if world is not None else 1,
        precision=z.precision,
        entries=z.entries,
        tied=tied,
        files=[model_files[0]],
        state_names=z.state_names,
        extra=dict(z.extra),
    )
    body.groups = [Node(g, m0.file, f"optimizer.param_groups[{i}]") for i, g in enumerate(z.opt_groups)]
    body.names_by_slot = {i: list(g.get("params", [])) for i, g in enumerate(z.opt_groups)}
    return body


def _partition_count(o: Node) -> int:
    pc = o["partition_count"]
    counts = (
        {n.as_int(lo=1, hi=MAX_WORLD) for n in pc}
        if isinstance(pc.value, list)
        else {pc.as_int(lo=1, hi=MAX_WORLD)}
    )
    if len(counts) != 1:
        raise Unsupported(
            f"{o.file}: param groups with different partition counts {sorted(counts)} (MoE expert "
            "groups) are not supported yet",
            path=o.file,
        )
    return counts.pop()


def _optim_files(
    td: Location, optim_files: dict[int, Location], trust: bool
) -> tuple[list[Node], list[Node]]:
    """(each rank's optimizer file, its ``optimizer_state_dict``), for ranks ``0..partition_count-1``."""
    first = optim_files[min(optim_files)]
    loads = dict(zip(optim_files, load_all(list(optim_files.values()), trust), strict=True))
    top_first = loads[min(optim_files)]()
    o_first = top_first["optimizer_state_dict"]
    ws = _partition_count(o_first)
    check_ranks(td, optim_files, ws, "optimizer-states", first, first.name)
    tops = [top_first if optim_files[r] == first else loads[r]() for r in range(ws)]
    osds = [o_first if t is top_first else t["optimizer_state_dict"] for t in tops]
    for o in osds:
        if o["partition_count"].value != o_first["partition_count"].value:
            raise ShardMismatch(
                f"{o.file}: partition_count {o['partition_count'].value!r:.40} but {first.name} "
                f"has {o_first['partition_count'].value!r:.40}",
                hint="the file is stale from another run; move it away",
                path=o.file,
            )
    return tops, osds


def _partitioned(
    td: Location,
    model_files: dict[int, Location],
    optim_files: dict[int, Location],
    m0: Node,
    module: Node,
    trust: bool,
) -> _Body:
    tops, osds = _optim_files(td, optim_files, trust)
    ws = len(osds)
    dp = m0.get("dp_world_size")
    if dp is not None and dp.as_int(lo=1) != ws:
        raise ShardMismatch(
            f"{m0.file}: dp_world_size {dp.value} but the optimizer files were partitioned over {ws} ranks",
            hint="files from two runs are mixed",
            path=m0.file,
        )
    o0 = osds[0]
    is3 = o0.has("fp32_flat_groups")
    bf16_opt = not is3 and not o0.has("zero_stage")
    if not is3:
        for top, o in zip(tops, osds, strict=True):
            version = top.value.get("ds_version") or o.value.get("ds_version")
            require(o, ZERO12_KEYS, version, "optimizer_state_dict.")
            if not bf16_opt:
                key = ("param_alignment_paddings",)
                require(o, key, version, "optimizer_state_dict.", since=ALIGNMENT_SINCE)
    stage = 3 if is3 else (1 if bf16_opt else o0["zero_stage"].as_int(lo=1, hi=2))
    models = [m0]
    if is3:
        first = optim_files[min(optim_files)]
        check_ranks(td, model_files, ws, "model-states", first, model_files[0].name)
        models += [load(model_files[r], trust) for r in range(1, ws)]
    elif len(model_files) != 1:
        raise ShardMismatch(
            f"{td}: ZeRO-{stage} checkpoint with per-rank model-state files",
            hint="files from a ZeRO-3 run are mixed in",
            path=str(td),
        )
    cross_check(models, tops, osds)
    shapes_node = m0["param_shapes"]
    param_shapes = [shapes_node] if isinstance(shapes_node.value, dict) else list(shapes_node)
    part = zero3.zero3(osds, param_shapes, ws) if is3 else zero12.zero12(osds, param_shapes, ws, bf16_opt)
    bases = [o["optimizer_state_dict"] if is3 else o["base_optimizer_state"] for o in osds]
    body = _Body(
        stage=stage,
        world=ws,
        precision=_precision(module, part),
        optim0=o0,
        files=[location(m.file) for m in models] + [location(o.file) for o in osds],
    )
    sp = m0.get("shared_params")
    body.tied = {a: o.as_str() for a, o in sp.items()} if sp is not None else tied_from_module(module, set())
    body.entries = part.layout.entries(part.flats, Role.PARAM, None)
    # torch's state_dict always holds ``state`` (empty before the first step): a file without it lost every
    # param's moments, refused here rather than resharded without them
    states = [dict(b["state"].int_items()) for b in bases]
    opt_entries, body.state_names = optim_entries(part.layout, states, part.sizes)
    body.entries += _frozen(models, module, part, body.tied, ws, is3)
    body.entries += opt_entries
    per_rank = [list(b["param_groups"]) for b in bases]  # every rank's optimizer records its groups
    for b, groups in zip(bases, per_rank, strict=True):
        if len(groups) != len(per_rank[0]) or not groups:
            raise ShardMismatch(
                f"{b.file}: {len(groups)} optimizer param_groups, rank 0's file has {len(per_rank[0])}",
                hint="a rank file is damaged or from another run",
                path=b.file,
            )
    body.groups = per_rank[0]
    for name, slot in part.layout.slot_of.items():
        body.names_by_slot.setdefault(slot, []).append(name)
    body.extra = {"bf16_optimizer": bf16_opt, ("sub_groups" if is3 else "param_groups"): part.groups}
    return body


def _precision(module: Node, part: zero12.Partitioned) -> str:
    for name in part.layout.shapes:
        t = module.value.get(name)
        if isinstance(t, TensorRef):
            return precision_of(t.dtype)
    return "fp32"


def _frozen(
    models: list[Node], module: Node, part: zero12.Partitioned, tied: dict[str, str], ws: int, is3: bool
) -> list[TensorEntry]:
    """Frozen params: ZeRO-3 per-rank chunks; stage 2 whole fragments; stage 1 only in ``module``."""
    if is3:
        return zero3.frozen3(models, ws)
    m0 = models[0]
    shapes = m0.get("frozen_param_shapes")
    if shapes is not None and shapes.as_dict():
        frags = m0.get("frozen_param_fragments")
        return [
            whole(
                name,
                ref(frags[name] if frags is not None and frags.has(name) else module[name]),
                Role.FROZEN,
                shp.as_shape(),
            )
            for name, shp in shapes.items()
        ]
    buffers = set(_names(m0.get("buffer_names")))
    return [
        whole(name, ref(t), Role.FROZEN)
        for name, t in module.items()
        if name not in part.layout.shapes and name not in tied and name not in buffers
    ]


_VERBATIM = frozenset(
    [
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "csr_tensor_module_names",
        "checkpoint_parallel_dimensions",
        "universal_checkpoint_info",
        "ds_autoep_layers",
        "autoep_layers",
    ]
)
_REPRESENTED = DS_KEYS - _VERBATIM
"""DeepSpeed's keys that the entries or the typed state already carry; the others travel verbatim."""


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _client(o: Any, path: str) -> Any:
    """A client-state value with tensors as entries (nested dicts/lists walked; other values kept)."""
    if isinstance(o, TensorRef):
        return whole(f"client/{path}", o, Role.BUFFER)
    if isinstance(o, dict):
        return {k: _client(v, f"{path}.{k}") for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        out = [_client(v, f"{path}.{i}") for i, v in enumerate(o)]
        return out if isinstance(o, list) else tuple(out)
    return o


def _optimizer(m0: Node, body: _Body) -> OptimizerState | None:
    if not body.groups:
        return None
    groups = []
    for g in body.groups:
        params: list[str] = []
        for p in g.get("params") or Node([], g.file):
            v = p.value
            params += [v] if isinstance(v, str) else body.names_by_slot.get(p.as_int(lo=0), [])
        options = {
            k: to_json(v) for k, v in g.as_dict().items() if k != "params" and not isinstance(v, TensorRef)
        }
        groups.append(ParamGroup(tuple(params), options))
    cfg = m0.value.get("ds_config")
    opt_cfg = cfg.get("optimizer") if isinstance(cfg, dict) else None
    kind = opt_cfg.get("type") if isinstance(opt_cfg, dict) else None
    if not isinstance(kind, str) or not kind:
        names = set(body.state_names)
        decoupled = any(g.options.get("decoupled_weight_decay") for g in groups)
        kind = (
            ("AdamW-like" if decoupled else "Adam-like")
            if {"exp_avg", "exp_avg_sq"} <= names
            else "SGD-like"
            if "momentum_buffer" in names
            else "torch"
        )
    return OptimizerState(kind, tuple(groups), tuple(body.state_names))


def _exact_options(body: _Body) -> list[dict[str, Any]]:
    """Per param group, the hyper-parameters that JSON values would change (tuples such as Adafactor's
    ``eps``, tensors, numpy scalars), verbatim with tensors as entries: a DeepSpeed writer gives them back
    in their own types."""
    out = []
    for i, g in enumerate(body.groups):
        exact = {}
        for k, v in g.as_dict().items():
            j = None if isinstance(v, TensorRef) else to_json(v)
            if k != "params" and (isinstance(v, TensorRef) or type(j) is not type(v) or j != v):
                exact[k] = _client(v, f"param_groups.{i}.{k}")
        out.append(exact)
    return out


def _training_state(m0: Node, body: _Body) -> TrainingState:
    top = m0.as_dict()
    cfg = top.get("ds_config") if isinstance(top.get("ds_config"), dict) else None
    gas = (cfg or {}).get("gradient_accumulation_steps")
    gas = gas if isinstance(gas, int) and gas > 0 else 1
    steps = _int_or_none(top.get("global_steps"))
    o0 = body.optim0.as_dict() if body.optim0 is not None else {}
    scaler = o0.get("loss_scaler")
    private = {
        "module_order": list(m0["module"].as_dict()),
        "top": {k: v for k, v in top.items() if k in DS_KEYS and k not in _REPRESENTED},
        "ds_version": top.get("ds_version"),
        "dynamic_loss_scale": o0.get("dynamic_loss_scale"),
        "overflow": o0.get("overflow"),
        "clip_grad": o0.get("clip_grad"),
        "bf16_optimizer": bool(body.extra.get("bf16_optimizer")),
        "group_exact": _exact_options(body),
    }
    return TrainingState(
        stage=body.stage,
        precision=body.precision,
        optimizer=_optimizer(m0, body),
        scheduler=to_json(top.get("lr_scheduler")),
        loss_scaler=to_json(scaler) if hasattr(scaler, "to_dict") else None,
        counters=Counters(
            steps,
            _int_or_none(top.get("global_samples")),
            _int_or_none(top.get("skipped_steps")),
            steps * gas if steps is not None else None,
        ),
        client_state={k: _client(v, k) for k, v in top.items() if k not in DS_KEYS},
        config=to_json(cfg) if cfg is not None else None,
        framework={"deepspeed": private},
    )
