"""The distributed optimizer's default ``dp_reshardable`` state: flat fp32 buckets decoded per parameter.

Keys ``optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_(<param dtype>, <grad dtype>).bucket_idx_<k>
.<kind>`` (kind ``param`` = fp32 master, ``exp_avg``, ``exp_avg_sq``): one 1-D tensor per bucket. ``g`` is the
rank in the model-parallel group, ``pp_rank * TP + tp_rank``. A bucket holds the parameters of that TP/PP rank
whose dtype is ``<param dtype>`` in **reverse** ``module.parameters()`` order, each start rounded up to a
multiple of 64 elements, each its *local* TP shard; the tensor ends with the bucket's last parameter (the
padding to the DP multiple is not stored). Nothing in the checkpoint names the parameters: their order and
TP split dims come from the model's structure (Megatron-Core's local GPT spec, ``order``) and ``args``.

A parameter is cut from the bucket as ``Run`` segments (local elements -> full tensor elements) and written
as pieces over the bucket's stored chunks, so reading it touches only its bytes. Every bucket must be used
exactly: a parameter past its end, or a length left over, refuses the decode (a layout this module does not
know, rather than wrong values).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zckpt.dtypes import DType
from zckpt.errors import CorruptCheckpoint, Unsupported
from zckpt.formats.megatron.config import ModelConfig, Parallel
from zckpt.model import Piece

ALIGN = 64
KEY = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\((torch\.\w+), (torch\.\w+)\)"
    r"\.bucket_idx_(\d+)\.(\w+)$"
)
KINDS = ("param", "exp_avg", "exp_avg_sq")
_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
           "word_embeddings.weight", "output_layer.weight")  # fmt: skip
_ROW = ("linear_proj.weight", "linear_fc2.weight")
_LAYER = (
    "input_layernorm.weight", "input_layernorm.bias",
    "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
    "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
    "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
)  # fmt: skip
"""One layer's parameters in ``module.parameters()`` order (Megatron-Core's local spec, ``transformer_impl
local``)."""


@dataclass(frozen=True)
class Bucket:
    """One flat bucket tensor: its DP group, gbuf, param dtype, bucket index, kind and length."""

    key: str
    group: int
    gbuf: int
    param_dtype: str
    bucket: int
    kind: str
    length: int

    @property
    def short(self) -> str:
        """The bucket as error messages name it (the key is long)."""
        return f"flat bucket dp_group {self.group} gbuf {self.gbuf} bucket {self.bucket} ({self.kind})"


_MISMATCH = "the flat buckets do not fit the model in common.pt's args (damaged, or from another save)"


@dataclass(frozen=True)
class Run:
    """``count`` runs of ``length`` local elements, from local ``local``; run ``i`` goes to full element
    ``full + i * stride``."""

    local: int
    length: int
    count: int
    full: int
    stride: int


def parse_key(key: str, length: int) -> Bucket | None:
    m = KEY.match(key)
    if m is None:
        return None
    g, b, pd, _gd, k, kind = m.groups()
    return Bucket(key, int(g), int(b), pd, int(k), kind, length)


def order(names: Sequence[str], cfg: ModelConfig, par: Parallel, pp_rank: int) -> list[str]:
    """The parameters of pipeline stage ``pp_rank`` in ``module.parameters()`` order, from the model names
    the checkpoint holds (``decoder.layers.{i}.<sub>``); the last stage of a tied PP>1 run also has its
    synced copy ``output_layer.weight``."""
    have = set(names)
    per = cfg.num_layers // par.pp
    first, last = pp_rank == 0, pp_rank == par.pp - 1
    out: list[str] = []
    if first:
        out += [
            n
            for n in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
            if n in have
        ]
    for i in range(pp_rank * per, (pp_rank + 1) * per):
        out += [f"decoder.layers.{i}.{s}" for s in _LAYER if f"decoder.layers.{i}.{s}" in have]
    if last:
        out += [n for n in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias") if n in have]
        if "output_layer.weight" in have or (cfg.tied and par.pp > 1):
            out.append("output_layer.weight")
    return out


def runs(name: str, shape: tuple[int, ...], tp: int, tp_rank: int, swiglu: bool) -> tuple[int, list[Run]]:
    """(local numel, segments) of TP rank ``tp_rank``'s shard of parameter ``name`` of full ``shape``."""
    n = math.prod(shape)
    kind = "column" if name.endswith(_COLUMN) else "row" if name.endswith(_ROW) else "replicated"
    if tp == 1 or kind == "replicated":
        return n, [Run(0, n, 1, 0, n)]
    if shape[0] % tp if kind == "column" else len(shape) != 2 or shape[1] % tp:
        raise CorruptCheckpoint(f"{name}: shape {list(shape)} does not split over TP {tp}")
    if kind == "row":
        o, i = shape
        w = i // tp
        return o * w, [Run(0, w, o, tp_rank * w, i)]
    row = n // shape[0]
    if swiglu and ".linear_fc1." in name:
        half = shape[0] // 2 // tp * row
        return 2 * half, [
            Run(0, half, 1, tp_rank * half, half),
            Run(half, half, 1, n // 2 + tp_rank * half, half),
        ]
    local = n // tp
    return local, [Run(0, local, 1, tp_rank * local, local)]


def cut(flat: Sequence[Piece], start: int, segs: Sequence[Run]) -> list[Piece]:
    """Pieces of the full tensor holding the local shard at element ``start`` of a flat bucket."""
    out: list[Piece] = []
    for s in segs:
        for k in range(s.count):
            lo = start + s.local + k * s.length
            hi = lo + s.length
            for p in flat:
                for at, off, n in p.runs(lo, hi):
                    full = s.full + k * s.stride + (at - lo)
                    out.append(Piece(p.file, p.byte_offset + off * p.dtype.itemsize, p.dtype, full, n,
                                     rank=p.rank, check=p.check))  # fmt: skip
    return _merge(out)


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Runs that continue each other (same file, adjacent bytes and elements) as one piece; rows of a row
    split that repeat with one stride as one box piece."""
    pieces.sort(key=lambda p: (p.file, p.byte_offset))
    out: list[Piece] = []
    for p in pieces:
        q = out[-1] if out else None
        if (q is not None and not q.grid and q.file == p.file and q.check is p.check and q.dtype == p.dtype
                and q.byte_offset + q.nbytes == p.byte_offset and q.start + q.numel == p.start):  # fmt: skip
            out[-1] = Piece(
                q.file, q.byte_offset, q.dtype, q.start, q.numel + p.numel, rank=q.rank, check=q.check
            )
        else:
            out.append(p)
    return out


@dataclass(frozen=True)
class Decoded:
    """Per parameter name and kind (``param``, ``exp_avg``, ``exp_avg_sq``): its pieces."""

    pieces: Mapping[tuple[str, str], tuple[Piece, ...]]


def decode(
    buckets: Sequence[Bucket],
    flat_pieces: Mapping[str, Sequence[Piece]],
    shapes: Mapping[str, tuple[int, ...]],
    dtypes: Mapping[str, DType],
    cfg: ModelConfig,
    par: Parallel,
    args: Mapping[str, object],
    source: str,
) -> Decoded:
    """Every parameter's pieces out of the flat buckets (module doc)."""
    why = _unsupported(cfg, par, args)
    if why is not None:
        raise Unsupported(
            f"{source}: the distributed optimizer's dp_reshardable flat buckets of this model cannot be "
            f"decoded: {why}",
            hint="re-save with --dist-ckpt-optim-fully-reshardable (model-space optimizer state)",
            path=source,
        )
    names = list(shapes)
    got: dict[tuple[str, str], list[Piece]] = {}
    groups: dict[tuple[int, int, str, str], list[Bucket]] = {}
    for b in buckets:
        groups.setdefault((b.group, b.gbuf, b.param_dtype, b.kind), []).append(b)
    for (g, _gbuf, pdt, kind), bs in sorted(groups.items()):
        pp_rank, tp_rank = divmod(g, par.tp)
        if pp_rank >= par.pp:
            raise CorruptCheckpoint(f"{source}: dp_group_idx_{g} is outside TP {par.tp} x PP {par.pp}",
                                    path=source)  # fmt: skip
        params = [n for n in reversed(order(names, cfg, par, pp_rank))
                  if str(dtypes.get(n, dtypes.get("embedding.word_embeddings.weight"))) == pdt]  # fmt: skip
        bs = sorted(bs, key=lambda b: b.bucket)
        if [b.bucket for b in bs] != list(range(len(bs))):
            raise CorruptCheckpoint(f"{source}: buckets of dp_group_idx_{g} {kind} are not 0..{len(bs) - 1}",
                                    path=source)  # fmt: skip
        k, pos = 0, 0
        for name in params:
            shape = shapes.get(name, shapes["embedding.word_embeddings.weight"])
            numel, segs = runs(name, shape, par.tp, tp_rank, cfg.swiglu)
            if k >= len(bs):
                raise CorruptCheckpoint(
                    f"{source}: dp_group_idx_{g} {kind}: the buckets end before parameter {name}",
                    hint=_MISMATCH,
                    path=source,
                )
            start = -(-pos // ALIGN) * ALIGN
            end = start + numel
            if end > bs[k].length:
                raise CorruptCheckpoint(
                    f"{source}: {bs[k].short}: parameter {name} ({numel} elements at {start}) runs past the "
                    f"bucket's {bs[k].length} elements",
                    hint=_MISMATCH,
                    path=source,
                )
            skip = name == "output_layer.weight" and cfg.tied  # the last stage's synced copy of the embedding
            if not skip and (tp_rank == 0 or numel != math.prod(shape)):  # replicated: TP rank 0's copy
                got.setdefault((name, kind), []).extend(cut(flat_pieces[bs[k].key], start, segs))
            pos = end
            if end == bs[k].length:
                k, pos = k + 1, 0
        if k != len(bs) or pos:
            left = bs[min(k, len(bs) - 1)]
            raise CorruptCheckpoint(
                f"{source}: {left.short}: {left.length - pos if pos else left.length} elements hold no "
                "parameter of the model in args",
                hint=_MISMATCH,
                path=source,
            )
    return Decoded({k: tuple(sorted(v, key=lambda p: p.start)) for k, v in got.items()})


def _unsupported(cfg: ModelConfig, par: Parallel, args: Mapping[str, object]) -> str | None:
    impl = args.get("transformer_impl", "local")
    if impl != "local":
        return f"transformer_impl {impl!r} (the parameter order is known for the local spec only)"
    if par.vpp:
        return "virtual pipeline stages"
    if cfg.num_experts:
        return "mixture of experts"
    if cfg.multi_latent_attention:
        return "multi-latent attention"
    if (
        cfg.num_layers % par.pp
        or args.get("decoder_first_pipeline_num_layers")
        or args.get("decoder_last_pipeline_num_layers")
        or args.get("account_for_embedding_in_pipeline_split")
        or args.get("pipeline_model_parallel_layout")
    ):
        return "an uneven pipeline split"
    if (args.get("context_parallel_size") or 1) != 1:
        return "context parallelism"
    return None
