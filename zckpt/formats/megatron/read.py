"""Opening a Megatron-Core ``torch_dist`` checkpoint: TP1/PP1 model names, fp32 masters, Adam moments.

The iteration folder is a DCP folder (``zckpt.formats.dcp``: ``.metadata`` parsed through the allowlisted
unpickler, every chunk located in its ``.distcp`` archive) plus ``common.pt`` (``common``), whose ``args``
give the model (``config``). Keys are global and independent of TP/PP; this module renames them:

- **Layers are unstacked**: ``decoder.layers.<sub>`` of shape ``[L, ...]`` becomes
  ``decoder.layers.{i}.<sub>`` (one chunk per layer: each layer's pieces point into its own chunks). The
  layer norms Megatron saves under Transformer Engine's fused names get their module names:
  ``self_attention.linear_qkv.layer_norm_{weight,bias}`` -> ``input_layernorm.*``,
  ``mlp.linear_fc1.layer_norm_{weight,bias}`` -> ``pre_mlp_layernorm.*``
  (the names of ``GPTModel.state_dict()`` with the local spec).
- **Roles**: every floating model tensor is a trainable ``PARAM`` (Megatron saves no buffers but TE's
  ``_extra_state``, which is skipped; ``rng_state`` too).
- **Masters and moments**: the model tensor's ``PARAM`` entry is read from the fp32 master where one is
  saved (``optimizer.state.fp32_param.<key>`` of bf16/fp16 runs, ``optimizer.state.param.<key>`` of the
  distributed optimizer's ``fully_reshardable`` state, the ``param`` flat buckets of its default
  ``dp_reshardable`` state: ``flat``), else from the model tensor itself (fp32 runs, model-only saves). The
  precision is ``args``': ``consolidate`` writes bf16 weights of a bf16 run (the masters cast, which is what
  Megatron copies into its bf16 params) and ``--dtype fp32`` the masters themselves. Adam moments are
  ``<name>:exp_avg`` / ``<name>:exp_avg_sq``.
- ``trim_vocab``: the embedding and output rows past ``args.vocab_size`` (Megatron pads the vocab to a
  multiple of ``make_vocab_size_divisible_by`` x TP) are cut off (``open_megatron``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zckpt import dtypes
from zckpt.checkpoint import Checkpoint
from zckpt.dtypes import DType
from zckpt.errors import CorruptCheckpoint, Unsupported
from zckpt.formats.dcp.boxes import box_piece, check_tiling, distinct
from zckpt.formats.dcp.chunks import ChunkData, Files
from zckpt.formats.dcp.layout import rank_of
from zckpt.formats.dcp.locate import blob_files, tensor_chunks
from zckpt.formats.dcp.metadata import METADATA, Chunk, DcpMetadata, TensorMeta, load_metadata
from zckpt.formats.dcp.read import check_disjoint
from zckpt.formats.megatron import carve, flat
from zckpt.formats.megatron.common import Common, load_common
from zckpt.formats.megatron.config import ModelConfig, Parallel, check_shapes, model_config, parallel
from zckpt.formats.megatron.layout import NAME as layout_NAME
from zckpt.formats.megatron.layout import Source, resolve
from zckpt.model import Piece, Role, TensorEntry
from zckpt.state import CheckpointMeta, Counters, OptimizerState, ParamGroup, TrainingState
from zckpt.storage import collector
from zckpt.storage.location import Location

NAME = layout_NAME  # the format's name (``layout``: what detecting it imports)
LAYERS = "decoder.layers."
RENAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
"""Transformer Engine's fused layer-norm names (what ``torch_dist`` saves) -> the local spec's modules."""
OPTIM_PREFIX = "optimizer.state."
MASTERS = ("fp32_param", "param")
MOMENTS = ("exp_avg", "exp_avg_sq")
EMBEDDINGS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class Opened:
    """What a Megatron reader built besides the ``Checkpoint``: config, layout and ``common.pt``."""

    source: Source
    config: ModelConfig
    parallel: Parallel
    common: Common


def _located(
    folder: Location, md: DcpMetadata, keys: list[str]
) -> dict[str, dict[tuple[int, ...], ChunkData]]:
    files = Files(folder)
    try:
        blobs = blob_files(files, md)
        check_disjoint(md, blobs)  # every item's bytes its own, read or not (as a DCP open checks)
        return {k: dict(tensor_chunks(files, md, k, blobs)) for k in keys}
    finally:
        files.close()


def _pieces(
    shape: tuple[int, ...], t: TensorMeta, chunks: Mapping[tuple[int, ...], ChunkData]
) -> tuple[Piece, ...]:
    out = []
    for box in distinct(t.chunks):
        d = chunks[box.offsets]
        p = box_piece(shape, box, d.file, d.byte_offset, t.dtype, rank_of(d.file), d.check)
        if p is not None:
            out.append(p)
    return tuple(out)


def _layer_pieces(md: DcpMetadata, key: str, t: TensorMeta, chunks: Mapping[tuple[int, ...], ChunkData],
                  i: int) -> tuple[Piece, ...]:  # fmt: skip
    """Layer ``i`` of a stacked ``[L, ...]`` tensor: the chunks holding it, each cut to that layer's rows."""
    inner = t.shape[1:]
    boxes: list[Chunk] = []
    out = []
    for box in distinct(t.chunks):
        o0, s0 = box.offsets[0], box.sizes[0]
        if not o0 <= i < o0 + s0:
            continue
        sub = Chunk(box.offsets[1:], box.sizes[1:])
        boxes.append(sub)
        d = chunks[box.offsets]
        off = d.byte_offset + (i - o0) * math.prod(sub.sizes) * t.dtype.itemsize
        p = box_piece(inner, sub, d.file, off, t.dtype, rank_of(d.file), d.check)
        if p is not None:
            out.append(p)
    check_tiling(md.source, f"{key} layer {i}", inner, boxes)
    return tuple(out)


def unstacked(key: str, t: TensorMeta, num_layers: int) -> list[tuple[str, int | None]]:
    """The model names of stored key ``key`` (a model key, no optimizer prefix), with the layer each is."""
    if key.startswith(LAYERS):
        sub = key[len(LAYERS) :]
        if not sub.split(".", 1)[0].isdigit():
            if not t.shape or t.shape[0] != num_layers:
                raise CorruptCheckpoint(
                    f"stacked layer tensor {key!r:.80} has shape {list(t.shape)}; args.num_layers is "
                    f"{num_layers}",
                    hint="common.pt's args do not match the .metadata (files of two saves mixed?)",
                )
            sub = RENAMES.get(sub, sub)
            return [(f"{LAYERS}{i}.{sub}", i) for i in range(num_layers)]
    return [(key, None)]


def _model_key(key: str) -> bool:
    return not key.startswith(("optimizer.", "rng_state")) and "_extra_state" not in key


def open_megatron(
    path: Location, *, tag: str | None = None, trust_pickle: bool = False, model_only: bool = False,
    trim_vocab: bool = False,
) -> tuple[Checkpoint, Opened]:  # fmt: skip
    """The checkpoint at ``path`` (save or iteration folder) and what it was built from (module doc)."""
    with collector.paused(long_lived=True):
        return _open(path, tag, trust_pickle, model_only, trim_vocab)


Model = dict[str, tuple[tuple[int, ...], DType, tuple[Piece, ...]]]
"""Model name -> (shape, stored dtype, pieces of the stored model tensor)."""


@dataclass(frozen=True)
class _Stored:
    """The iteration folder's tensors: metadata, located chunks, and the layer count that unstacks them."""

    md: DcpMetadata
    chunks: Mapping[str, Mapping[tuple[int, ...], ChunkData]]
    num_layers: int

    def pieces(self, key: str, layer: int | None) -> tuple[Piece, ...]:
        t = self.md.tensors[key]
        if layer is None:
            return _pieces(t.shape, t, self.chunks[key])
        return _layer_pieces(self.md, key, t, self.chunks[key], layer)

    def shape(self, key: str, layer: int | None) -> tuple[int, ...]:
        t = self.md.tensors[key]
        return t.shape if layer is None else t.shape[1:]

    def names(self, key: str) -> list[tuple[str, int | None]]:
        try:
            return unstacked(key, self.md.tensors[key], self.num_layers)
        except CorruptCheckpoint as e:
            src = self.md.source
            raise CorruptCheckpoint(f"{src}: {e.args[0]}", hint=e.hint, path=src) from None


def _open(path: Location, tag: str | None, trust_pickle: bool, model_only: bool,
          trim_vocab: bool) -> tuple[Checkpoint, Opened]:  # fmt: skip
    src = resolve(path, tag)
    md = load_metadata(src.folder)
    com = load_common(src.folder, trust_pickle=trust_pickle)
    cfg = model_config(com.args, com.source)
    par = parallel(com.args, com.source)
    model_keys = [k for k in md.keys if k in md.tensors and _model_key(k)]
    wanted = _is_master if model_only else (lambda k: k.startswith("optimizer."))  # consolidate: masters
    optim_keys = [k for k in md.keys if k in md.tensors and wanted(k)]
    st = _Stored(md, _located(src.folder, md, model_keys + optim_keys), cfg.num_layers)
    model: Model = {}
    for k in model_keys:
        for name, i in st.names(k):
            model[name] = (st.shape(k, i), md.tensors[k].dtype, st.pieces(k, i))
    model = {n: model[n] for n in sorted(model, key=_name_order)}
    check_shapes(cfg, {n: v[0] for n, v in model.items()}, com.source)
    masters, moments, buckets = _optim_states(st, optim_keys, model)
    if buckets:
        try:
            _flat_states(st, buckets, model, masters, moments, cfg, par, com)
        except Unsupported as e:
            if not model_only:
                raise
            warnings.warn(f"{e.args[0]}; the model tensors are read as saved (in {par.precision}), not the "
                          "fp32 masters", stacklevel=3)  # fmt: skip
    entries: list[TensorEntry] = []
    for name, (shape, dtype, ps) in model.items():
        role = Role.PARAM if dtype.is_floating_point else Role.BUFFER
        if name in masters:
            entries.append(TensorEntry(name, shape, dtypes.float32, role, masters[name]))
        else:
            entries.append(TensorEntry(name, shape, dtype, role, ps))
    if trim_vocab:
        entries = [_trimmed(e, cfg) for e in entries]
        moments = [_trimmed(e, cfg) for e in moments]
    order = {n: j for j, n in enumerate(model)}
    moments.sort(key=lambda e: (order.get(e.name, 0), e.state or ""))
    meta = _meta(src, cfg, par, com, entries, moments)
    return Checkpoint(meta, entries + moments), Opened(src, cfg, par, com)


def _optim_states(
    st: _Stored, keys: list[str], model: Model
) -> tuple[dict[str, tuple[Piece, ...]], list[TensorEntry], list[flat.Bucket]]:
    """Model-space optimizer states (masters, moments) and the flat buckets, left for ``_flat_states``."""
    md = st.md
    masters: dict[str, tuple[Piece, ...]] = {}
    moments: list[TensorEntry] = []
    buckets: list[flat.Bucket] = []
    for k in keys:
        b = flat.parse_key(k, md.tensors[k].numel)
        if b is not None:
            if len(md.tensors[k].shape) != 1:
                raise CorruptCheckpoint(f"{md.source}: flat bucket {k!r:.100} is not 1-D", path=md.source)
            buckets.append(b)
            continue
        if not k.startswith(OPTIM_PREFIX):
            continue
        kind, _, mkey = k[len(OPTIM_PREFIX) :].partition(".")
        if kind not in MASTERS + MOMENTS or mkey not in md.tensors:
            continue
        if md.tensors[k].shape != md.tensors[mkey].shape:
            raise CorruptCheckpoint(
                f"{md.source}: optimizer state {k!r:.100} has shape {list(md.tensors[k].shape)}, its "
                f"parameter {mkey!r:.80} {list(md.tensors[mkey].shape)}",
                path=md.source,
            )
        for name, i in st.names(mkey):
            shape = st.shape(k, i)
            if name not in model or model[name][0] != shape:
                raise CorruptCheckpoint(
                    f"{md.source}: optimizer state {k!r:.100} has shape {list(md.tensors[k].shape)}, its "
                    f"parameter {mkey!r:.80} {list(md.tensors[mkey].shape)}",
                    path=md.source,
                )
            if kind in MASTERS:
                masters[name] = st.pieces(k, i)
            else:
                dt = md.tensors[k].dtype
                moments.append(TensorEntry(name, shape, dt, Role.OPTIM, st.pieces(k, i), state=kind))
    return masters, moments, buckets


def _flat_states(
    st: _Stored, buckets: list[flat.Bucket], model: Model, masters: dict[str, tuple[Piece, ...]],
    moments: list[TensorEntry], cfg: ModelConfig, par: Parallel, com: Common,
) -> None:  # fmt: skip
    """The ``dp_reshardable`` flat buckets decoded (``flat``) into ``masters`` and ``moments``."""
    md = st.md
    flat_pieces = {b.key: st.pieces(b.key, None) for b in buckets}
    dec = flat.decode(
        buckets, flat_pieces, {n: v[0] for n, v in model.items()}, {n: v[1] for n, v in model.items()},
        cfg, par, com.args, md.source,
    )  # fmt: skip
    for (name, kind), ps in dec.pieces.items():
        if name not in model:
            continue
        if kind == "param":
            masters[name] = ps
        else:
            moments.append(TensorEntry(name, model[name][0], dtypes.float32, Role.OPTIM, ps, state=kind))


def _meta(
    src: Source, cfg: ModelConfig, par: Parallel, com: Common, entries: list[TensorEntry],
    moments: list[TensorEntry],
) -> CheckpointMeta:  # fmt: skip
    files = tuple(sorted({p.file for e in entries + moments for p in e.pieces if p.file}))
    return CheckpointMeta(
        format=NAME,
        path=str(src.folder),
        world_size=par.world,
        tag=src.tag,
        save_dir=str(src.save_dir) if src.save_dir is not None else None,
        files=(str(src.folder / METADATA), *files),  # common.pt: checked by ``verify`` (its allowlist)
        state=TrainingState(
            precision=par.precision,
            optimizer=_optimizer(com, moments),
            scheduler=dict(com.scheduler) or None,
            counters=Counters(global_steps=com.iteration),
            config=_config_json(cfg),
            framework={NAME: {"sharding_type": com.sharding_type}},
        ),
        extra=_extra(src, cfg, par, com),
    )


def _name_order(name: str) -> tuple[int, int, str]:
    """``GPTModel.state_dict()`` order: embeddings, layers by number, the rest."""
    if name.startswith("embedding."):
        return (0, 0, name)
    if name.startswith(LAYERS):
        i, _, sub = name[len(LAYERS) :].partition(".")
        if i.isdigit():
            return (1, int(i), sub)
    return (2 if name.startswith("decoder.") else 3, 0, name)


def _is_master(key: str) -> bool:
    if key.startswith(OPTIM_PREFIX):
        return key[len(OPTIM_PREFIX) :].partition(".")[0] in MASTERS
    b = flat.KEY.match(key)
    return b is not None and b.group(6) == "param"


def _trimmed(e: TensorEntry, cfg: ModelConfig) -> TensorEntry:
    if e.name not in EMBEDDINGS or cfg.vocab_size is None or cfg.vocab_size == e.shape[0]:
        return e
    row = math.prod(e.shape[1:])
    ps = carve.rows(e.pieces, row, [(0, cfg.vocab_size)])
    return TensorEntry(e.name, (cfg.vocab_size, *e.shape[1:]), e.dtype, e.role, ps, state=e.state)


def _optimizer(com: Common, moments: list[TensorEntry]) -> OptimizerState | None:
    """Adam's state names and ``common.pt``'s param groups. Which parameters each group holds Megatron does
    not save (it rebuilds the groups from the model: no weight decay for biases and norms...), so the groups
    name none rather than a guess."""
    if not moments and not com.param_groups:
        return None
    states = tuple(dict.fromkeys(str(e.state) for e in moments))
    groups = tuple(ParamGroup((), dict(g)) for g in com.param_groups)
    kind = "adam" if "exp_avg_sq" in states else "unknown"
    return OptimizerState(kind, groups, states)


def _config_json(cfg: ModelConfig) -> dict[str, Any]:
    out = {k: v for k, v in vars(cfg).items() if k != "params_dtype"}
    out["params_dtype"] = str(cfg.params_dtype).removeprefix("torch.")
    return out


def _extra(src: Source, cfg: ModelConfig, par: Parallel, com: Common) -> dict[str, Any]:
    return {
        "layout": "megatron torch_dist",
        "iteration_folder": str(src.folder),
        "parallel": {
            "tensor": par.tp,
            "pipeline": par.pp,
            "data": par.dp,
            "world": par.world,
            "virtual_pipeline": par.vpp,
            "expert": par.ep,
            "distributed_optimizer": par.distributed_optimizer,
        },
        "optimizer_sharding": com.sharding_type,
        "checkpoint_version": com.checkpoint_version,
        "iteration": com.iteration,
        "padded_vocab_size": cfg.padded_vocab_size,
        "vocab_size": cfg.vocab_size,
        "content_metadata": dict(com.content_metadata),
        "values": _values(cfg, par, com),
    }


def _values(cfg: ModelConfig, par: Parallel, com: Common) -> dict[str, str]:
    """What ``inspect`` lists beside the tensors (its ``values`` table): the model config read from ``args``
    and the parallel layout the run saved with."""
    out = {f"model.{k}": str(v) for k, v in _config_json(cfg).items()}
    out["parallel"] = (
        f"TP {par.tp} x PP {par.pp} x DP {par.dp} (world {par.world})"
        + (f", virtual PP {par.vpp}" if par.vpp else "")
        + (f", EP {par.ep}" if par.ep > 1 else "")
    )
    opt = (
        "none saved" if not com.has_optimizer else "distributed" if par.distributed_optimizer else "per rank"
    )
    out["optimizer"] = opt + (f" ({com.sharding_type})" if com.sharding_type else "")
    out["checkpoint_version"] = str(com.checkpoint_version)
    return out  # fmt: skip
