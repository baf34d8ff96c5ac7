"""``consolidate``: turn any checkpoint zckpt reads into one loadable model (safetensors or torch .bin).

Streams tensor by tensor: each tensor's pieces are read from the rank files, cast in bounded chunks and
written straight to the output, so peak memory is a few chunks, whatever the model size. Trainable params
come from the checkpoint's PARAM entries, which readers point at the fp32 masters where the format keeps
them.

Output dtype (``dtype=``, any spelling ``zckpt.model.parse_output_dtype`` reads: ``bf16``, ``bfloat16``,
``torch.bfloat16``...). The default ``auto`` keeps what the model had: floating **parameters** (trainable
and frozen) are written in the checkpoint's training precision when the format records one (a bf16 or
fp16 DeepSpeed run -> that dtype, an fp32 run -> fp32; else each its own dtype), and **buffers keep their
stored dtype** (an fp32 ``pos_scale`` of a bf16 run stays fp32, as in DeepSpeed's own ``save_16bit_model``
output). An explicit ``fp32`` / ``bf16`` / ``fp16`` is asked for: it casts every floating tensor, buffers
included, as torch's ``module.to(dtype)`` does (a torch cast of the stored value, bit-exact with
``tensor.to(dtype)``). ``keep_fp32`` globs (fnmatch, on names) keep matching floating tensors fp32.
Non-floating tensors (int64 step counters, masks) always keep their dtype.

Layout: ``OUT`` with a model writer's suffix (``.safetensors``; ``.bin``/``.pt``/``.pth``) -> one file (or
``OUT``-stem shards + index when ``max_shard_size`` splits it); any other ``OUT`` is a folder in the HF
layout (``model.safetensors`` or ``pytorch_model.bin``, sharded with an index) that receives the HF
config/tokenizer files found beside the checkpoint, ``config.json``'s dtype set to the written one, so
``from_pretrained(OUT)`` loads what was written. Tied aliases: safetensors stores the owner once and records
``{alias: owner}`` in its metadata and index (transformers re-ties from its config); ``.bin`` pickles both
names on one storage.

One code path for one process and for several (``zckpt.ops.group``): under ``torchrun`` every rank opens
the checkpoint (headers only) and computes the same shard plan; the ranks check that their plans agree,
rank 0 creates the staging folder, each rank writes shards ``rank::world`` (with their sidecars) into it,
rank 0 the index and the HF files, and after every rank reports success rank 0 moves the folder into
place. The output is byte-identical to a single-process run. ``OUT`` must be on a filesystem every rank
sees; work is split by output file, so pass a ``max_shard_size`` giving at least ``world`` shards.

Safety: an existing ``OUT`` is refused unless ``overwrite``; ``OUT`` may not overlap the input
(``zckpt.ops.paths``); everything is written in a hidden staging folder and published whole.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zckpt import dtypes
from zckpt.checkpoint import Checkpoint
from zckpt.dtypes import DType
from zckpt.errors import InvalidArgument, Unsupported
from zckpt.formats import open_checkpoint, registry
from zckpt.formats._names import HF_WEIGHT_BASES, PUBLISH_ORDER
from zckpt.formats.base import ModelWriteOptions, ModelWriter
from zckpt.model import PRECISIONS, Role, dtype_name, parse_output_dtype, parse_precision
from zckpt.ops import group as zgroup
from zckpt.ops import hf_files
from zckpt.ops.paths import check_overlap
from zckpt.ops.progress import bar as progress_bar
from zckpt.ops.scope import storage_scoped
from zckpt.ops.select import require_globs
from zckpt.storage import checks, objstore
from zckpt.storage.location import Location, location
from zckpt.storage.remote_staging import RemoteStaging
from zckpt.storage.session import Storage
from zckpt.storage.staging import Staging, Ticket, open_staging, share
from zckpt.stream import pipeline
from zckpt.stream.items import WriteItem
from zckpt.stream.shards import family, oversized, parse_size, plan_shards, planned_names

if TYPE_CHECKING:  # a torch.dtype is accepted; the work itself needs no torch (``zckpt.stream.cast``)
    import torch


@dataclass(frozen=True)
class ConsolidateResult:
    """What ``consolidate`` wrote."""

    out: Location
    format: str
    files: tuple[Location, ...]
    tensors: int
    bytes: int
    tied: dict[str, str] = field(default_factory=dict)
    dtypes: dict[str, int] = field(default_factory=dict)
    """Output dtype name -> number of tensors written in it."""
    copied: tuple[str, ...] = ()
    """HF config/tokenizer files copied from beside the checkpoint."""
    kept: tuple[str, ...] = ()
    """Files of an existing output folder that zckpt did not write, kept by ``overwrite``."""

    def to_json(self) -> dict[str, Any]:
        """This result as JSON values (what ``zckpt consolidate --json`` prints)."""
        return {
            "out": str(self.out),
            "format": self.format,
            "files": [str(f) for f in self.files],
            "tensors": self.tensors,
            "bytes": self.bytes,
            "tied": dict(self.tied),
            "dtypes": dict(self.dtypes),
            "copied": list(self.copied),
            "kept": list(self.kept),
        }


_OWNS = family(HF_WEIGHT_BASES)
"""What ``overwrite`` of an HF folder replaces: the weight files zckpt writes there (either format's shard
set, index and sidecars; a stale set of the other format would shadow the new one in ``from_pretrained``);
the HF files copied in replace their namesakes; every other file is kept (``zckpt.storage.staging``)."""


def _writers() -> list[ModelWriter]:
    return [f.model_writer for f in registry().values() if f.model_writer is not None]


def _layout(out: Location, format: str | None) -> tuple[ModelWriter, bool]:
    """(the writer, whether ``out`` is a folder)."""
    writers = _writers()
    kinds = {w.kind: w for w in writers}
    if format is not None and format not in kinds:
        raise InvalidArgument(f"unknown output format {format!r}; choose one of {', '.join(kinds)}")
    by_suffix = next((w for w in writers if out.suffix in w.suffixes), None)
    if by_suffix is None:
        if out.suffix and not out.is_dir():
            raise InvalidArgument(
                f"{out}: cannot tell the output format from {out.suffix!r}",
                hint="name it *.safetensors or *.bin, or give a folder for the HF layout",
            )
        return kinds[format or "safetensors"], True
    if format is not None and format != by_suffix.kind:
        raise InvalidArgument(f"{out}: --format {format} does not match the file suffix {out.suffix!r}")
    return by_suffix, False


def _target_dtype(dtype: str | DType | torch.dtype, ckpt: Checkpoint) -> tuple[DType | None, bool]:
    """(the cast for floating params, or None to keep each tensor's dtype; whether buffers are cast too:
    only when the dtype was asked for explicitly)."""
    name = parse_output_dtype(dtype)
    if name != "auto":
        return PRECISIONS[name], True
    prec = parse_precision(ckpt.meta.precision) if ckpt.meta.precision else None
    return (PRECISIONS[prec] if prec else None), False


def plan(
    ckpt: Checkpoint,
    *,
    dtype: str | DType | torch.dtype = "auto",
    keep_fp32: Sequence[str] = (),
    exclude_frozen: bool = False,
) -> tuple[list[WriteItem], dict[str, str]]:
    """The tensors ``consolidate`` writes (owners only, in checkpoint order) and the kept tied aliases."""
    target, cast_buffers = _target_dtype(dtype, ckpt)
    items: list[WriteItem] = []
    for e in ckpt.model_entries():
        if exclude_frozen and e.role is Role.FROZEN:
            continue
        out = e.dtype
        if e.dtype.is_floating_point:
            if any(fnmatch.fnmatchcase(e.name, pat) for pat in keep_fp32):
                out = dtypes.float32
            elif target is not None and (cast_buffers or e.role is not Role.BUFFER):
                out = target
        items.append(WriteItem(e.name, e, out))
    floating = [it.name for it in items if it.entry.dtype.is_floating_point]
    require_globs("--keep-fp32", keep_fp32, floating, f"{ckpt.meta.path} (floating tensors)")
    kept = {it.name for it in items}
    tied = {a: o for a, o in ckpt.meta.tied.items() if o in kept}
    return items, tied


@dataclass(frozen=True)
class _Plan:
    """The output every rank computes the same way (checked through ``digest``)."""

    writer: ModelWriter
    is_dir: bool
    base: str
    items: list[WriteItem]
    tied: dict[str, str]
    shard: int | None
    extras: list[Location]
    config: Mapping[str, Any] | None = None
    """A ``config.json`` the format built (``Format.hf_model``), written instead of copied ones."""

    @property
    def digest(self) -> str:
        tensors = [(it.name, list(it.shape), str(it.dtype), it.nbytes, it.role.value) for it in self.items]
        doc = [self.writer.kind, self.base, self.is_dir, self.shard, sorted(self.tied.items()), tensors,
               self.config]  # fmt: skip
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()


@storage_scoped
def consolidate(
    ckpt_or_path: Checkpoint | str | Path,
    out: str | Location,
    *,
    dtype: str | DType | Any = "auto",  # Any: a torch.dtype too (hints resolve without torch)
    keep_fp32: Sequence[str] = (),
    max_shard_size: int | str | None = None,
    tag: str | None = None,
    exclude_frozen: bool = False,
    format: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    trust_pickle: bool = False,
    workers: int | None = None,
    distributed: bool = False,
    verify_data: bool = True,
    storage_options: Mapping[str, str] | None = None,
    storage: Storage | None = None,
) -> ConsolidateResult:
    """Write the model tensors of a checkpoint as one loadable model; returns a ``ConsolidateResult``
    listing the files written (on every rank, when distributed).

    Args:
        ckpt_or_path: an open ``Checkpoint`` or a path ``zckpt.open`` understands.
        out: ``*.safetensors`` / ``*.bin`` file, or a folder (HF layout).
        dtype: ``auto`` (params in the training precision, buffers as stored) or ``fp32``/``bf16``/``fp16``
            for every floating tensor; also ``bfloat16``, ``torch.float16``, a ``torch.dtype`` (module doc).
        keep_fp32: fnmatch globs of tensor names kept in fp32.
        max_shard_size: shards of at most this size + an index: ``int`` bytes or ``"5GB"`` (a unit is
            required; ``zckpt.stream.shards.parse_size``); a larger tensor gets its own shard, with a warning.
        tag: checkpoint tag to read instead of ``latest``; exclude_frozen: leave out frozen params.
        format (`str`, *optional*): ``safetensors`` or ``bin``; default from ``out``'s suffix.
        overwrite: replace an existing ``out`` (an HF folder keeps the files zckpt does not write).
        progress: a tqdm bar (on a terminal); trust_pickle: load pickled globals outside the allowlist.
        workers: reader threads overlapping reads and casts with writes (safetensors output;
            default ``zckpt.stream.pipeline.default_workers()``, divided among the ranks of one host; an
            ``s3://`` source: one, ``pipeline.REMOTE_WORKERS``).
        distributed: ``False`` (default): this process alone, whatever process group exists. ``True``:
            split the writing over the ranks of the default process group (gloo, ``env://`` under torchrun).
        verify_data: check the input's recorded checksums over the bytes read; publish no damaged data.
        storage_options, storage: the ``s3://`` client's options, or a ``zckpt.Storage`` to use (yours).

    Raises:
        InvalidArgument (``ValueError``): a bad ``dtype``, ``max_shard_size`` or ``format``;
        PathNotFound (``FileNotFoundError``); OutputExists (``out`` exists, no ``overwrite``); other
        ``ZckptError`` refusals (damaged input, unsupported feature), each with a ``hint``.

    Example:
        >>> zckpt.consolidate("out/checkpoint-100", "model/", dtype="bf16", max_shard_size="5GB")
    """
    out = location(out)
    writer, is_dir = _layout(out, format)
    shard = parse_size(max_shard_size) if max_shard_size is not None else None
    g = zgroup.group(distributed)
    with contextlib.ExitStack() as stack:
        ckpt = g.step("consolidate: opening the checkpoint", lambda: _open(ckpt_or_path, tag, trust_pickle))
        if not isinstance(ckpt_or_path, Checkpoint):
            stack.callback(ckpt.close)

        def make_plan() -> tuple[_Plan, Staging | RemoteStaging | None]:
            check_overlap(ckpt.meta, out)
            src, config, extras = _source(ckpt, is_dir)
            items, tied = plan(src, dtype=dtype, keep_fp32=keep_fp32, exclude_frozen=exclude_frozen)
            base = writer.base_name if is_dir else out.name
            p = _Plan(writer, is_dir, base, items, tied, shard, extras, config)
            st: Staging | RemoteStaging | None = None
            if g.rank == 0:
                st = open_staging(out, is_dir=is_dir, overwrite=overwrite, owns=_OWNS, order=PUBLISH_ORDER)
                stack.enter_context(st)
                names = planned_names(base, items, shard)
                _refuse_replacing_shards(st, names, out)
                st.expect(names)
            return p, st

        p, st = g.step("consolidate: planning the output", make_plan)
        staging, digest0 = g.broadcast((st.ticket(), p.digest) if st is not None else None)
        g.check_same("the output plan", p.digest, digest0)
        _warn_idle(g, out, p)
        files, kept = _write(g, p, out, staging, st, progress, _rank_workers(g, workers, ckpt), verify_data)
    return _result(out, p, files, kept)


def _refuse_replacing_shards(st: Staging | RemoteStaging, names: list[str], out: Location) -> None:
    """Refuse a sharded output (an index among ``names``) replacing an existing output in a store: its
    shards' names are fixed by the index; neither version would be whole while they upload."""
    sharded = any(n.endswith(".index.json") for n in names)
    if not isinstance(st, RemoteStaging) or not st.overwrite or not sharded:
        return
    if st.generation is not None or any(objstore.kind(f"{st.url.rsplit('/', 1)[0]}/{n}") for n in names):
        raise Unsupported(
            f"{out}: replacing a sharded output in an object store in place would leave neither version "
            "whole while its shards upload (a shard's name is fixed by its index)",
            hint="write to a new prefix, then delete the old one",
            path=str(out),
        )


def _warn_kept_config(st: Staging | RemoteStaging, written: str | None) -> None:
    """A ``config.json`` kept from an earlier folder (none was copied in) that names another dtype than the
    weights now written would make ``from_pretrained(dtype="auto")`` load them cast: say so."""
    if "config.json" not in st.kept or written is None:
        return
    named = hf_files.kept_config_dtype(st.dest / "config.json")
    if named is not None and named != written:
        warnings.warn(
            f"{st.dest / 'config.json'} (kept, not written by zckpt) names dtype {named}; the weights are "
            f"{written}: from_pretrained(dtype='auto') loads them as {named}",
            stacklevel=4,
        )


def _rank_workers(g: zgroup.Group, workers: int | None, ckpt: Checkpoint) -> int | None:
    """Reader threads per rank: the default is shared among the ranks of one host; an object source gets
    the pipeline's own count (``pipeline.REMOTE_WORKERS``) unless ``workers`` is given."""
    if workers is not None or any(objstore.is_url(f) for f in ckpt.meta.files):
        return workers
    if g.world > 1:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        return max(1, pipeline.default_workers() // max(1, local))
    return None


def _result(out: Location, p: _Plan, files: list[Location], kept: tuple[str, ...]) -> ConsolidateResult:
    counts: dict[str, int] = {}
    for it in p.items:
        counts[dtype_name(it.dtype)] = counts.get(dtype_name(it.dtype), 0) + 1
    total = sum(it.nbytes for it in p.items)
    return ConsolidateResult(
        out=out,
        format=p.writer.kind,
        files=tuple(files),
        tensors=len(p.items),
        bytes=total,
        tied=p.tied,
        dtypes=counts,
        copied=tuple(f.name for f in p.extras),
        kept=kept,
    )


def _source(ckpt: Checkpoint, is_dir: bool) -> tuple[Checkpoint, Mapping[str, Any] | None, list[Location]]:
    """What a consolidate writes: the checkpoint, under HF names with the ``config.json`` its format built
    when it has its own (``Format.hf_model``: Megatron) and ``out`` is a folder; the HF files beside it."""
    fmt = registry().get(ckpt.meta.format) if is_dir else None
    got = fmt.hf_model(ckpt) if fmt is not None else None
    if got is not None:
        return got[0], got[1], []
    extras = hf_files.beside(location(ckpt.meta.path), ckpt.meta.save_dir) if is_dir else []
    return ckpt, None, extras


def _open(ckpt_or_path: Checkpoint | str | Path, tag: str | None, trust_pickle: bool) -> Checkpoint:
    if isinstance(ckpt_or_path, Checkpoint):
        return ckpt_or_path
    return open_checkpoint(ckpt_or_path, tag=tag, trust_pickle=trust_pickle, model_only=True)


def _warn_idle(g: zgroup.Group, out: Location, p: _Plan) -> None:
    big = oversized(p.items, p.shard)
    if big and g.rank == 0:  # transformers puts them in shards of their own silently; say so
        top = max(big, key=lambda it: it.nbytes)
        warnings.warn(
            f"{out}: {len(big)} of {len(p.items)} tensors are larger than the shard limit of {p.shard} "
            f"bytes (largest: {top.name}, {top.nbytes} bytes); each is written as a shard of its own, over "
            "the limit",
            stacklevel=3,
        )
    n = len(plan_shards(p.items, p.shard))
    if g.world > 1 and g.rank == 0 and n < g.world:
        warnings.warn(
            f"{out}: {n} output file(s) for {g.world} ranks; {g.world - n} rank(s) idle (pass a smaller "
            "--max-shard-size to split the work)",
            stacklevel=3,
        )


def _write(
    g: zgroup.Group,
    p: _Plan,
    out: Location,
    staging: Ticket,
    st: Staging | RemoteStaging | None,
    progress: bool,
    workers: int | None,
    verify_data: bool,
) -> tuple[list[Location], tuple[str, ...]]:
    """Every rank writes its shards (rank 0 also the index; a rank on another node than rank 0, into an
    ``s3://`` output, through a stand-in of its own: ``staging.share``), then rank 0 adds the HF files and
    publishes."""
    mine = sum(it.nbytes for s in plan_shards(p.items, p.shard)[g.rank :: g.world] for it in s)

    def write() -> list[str]:
        bar_on = progress and g.rank == 0
        with share(staging, is_dir=p.is_dir) as (folder, done):
            with checks.verifying(verify_data), progress_bar(mine, "consolidate", enabled=bar_on) as bar:
                opts = ModelWriteOptions(p.tied, p.shard, bar.update, workers, (g.rank, g.world))
                p.writer.write_into(folder, p.base, p.items, opts)
            return done()

    elsewhere = g.gather(g.step("consolidate: writing shards", write))

    def publish() -> tuple[list[str], list[str]] | None:
        if st is None:
            return None
        if isinstance(st, RemoteStaging):  # what ranks on other nodes uploaded
            st.adopt([u for urls in elsewhere for u in urls])
        weights = [it.dtype for it in p.items if it.role is not Role.BUFFER]
        hf_files.copy(p.extras, st.dir, weights)
        if p.config is not None:
            hf_files.write_config(p.config, st.dir, weights)
        final = [str(f) for f in st.commit()]
        _warn_kept_config(st, hf_files.weights_dtype(weights))
        return final, st.kept

    final, kept = g.broadcast(g.step("consolidate: publishing the output", publish))
    return [location(f) for f in final], tuple(kept)
