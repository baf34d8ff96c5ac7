"""``consolidate``: turn any checkpoint zckpt reads into one loadable model (safetensors or torch .bin).

Streams tensor by tensor: each tensor's pieces are read from the mmap'd rank files, cast in bounded
chunks (``zckpt.io.outputs.CHUNK_BYTES``) and written straight to the output, so peak memory is one
chunk plus the page cache, whatever the model size. Trainable params come from the checkpoint's
PARAM entries, which readers point at the fp32 masters where the format keeps them.

Output dtype (``dtype=``): ``fp32`` / ``bf16`` / ``fp16`` cast every floating tensor (a torch cast of
the stored value, bit-exact with ``tensor.to(dtype)``); ``auto`` uses the checkpoint's training
precision when the format records one (a bf16 or fp16 DeepSpeed run -> that dtype, an fp32 run ->
fp32) and otherwise keeps each tensor's own dtype. ``keep_fp32`` globs (fnmatch, on names) keep
matching floating tensors fp32. Non-floating tensors (int64 step counters, masks) always keep their
dtype.

Layout: ``OUT`` ending in ``.safetensors`` -> one file (or ``OUT``-stem shards + index when
``max_shard_size`` splits it); ``.bin``/``.pt``/``.pth`` -> a torch state dict; any other ``OUT`` is a
folder in the HF layout (``model.safetensors`` or ``pytorch_model.bin``, sharded with an index), and
receives the HF config/tokenizer files found beside the checkpoint so ``from_pretrained(OUT)``
works. Tied aliases: safetensors stores the owner once and records ``{alias: owner}`` in its
metadata and index (transformers re-ties from its config); ``.bin`` pickles both names on one storage.

Distributed (``distributed=``, or the CLI under ``torchrun``): the ranks of a process group split the
writing. Every rank opens the checkpoint (headers only) and computes the same shard plan; ranks check
that their plans agree, rank 0 creates the staging folder, each rank writes shards ``rank::world`` (with
their sidecars) into it, rank 0 the index and the HF config files, and after every rank reports
success rank 0 moves the folder into place. The output is byte-identical to a single-process run
with the same arguments. If any rank fails, every rank raises and nothing is published. ``OUT`` must
be on a filesystem every rank sees (one host, or a shared mount). Work is split by output file, so
pass a ``max_shard_size`` giving at least ``world`` shards; an output of one file (a ``.safetensors``
or ``.bin`` OUT without sharding) is written by rank 0 alone while the others wait (a warning says so).
Launch: ``torchrun --nproc_per_node N -m zckpt.cli.app consolidate CKPT OUT/ --max-shard-size 5GB``
(several hosts: ``--nnodes``/``--rdzv-endpoint`` as usual; the CLI starts a gloo group from ``env://``).

Integrity: every tensor file ``F`` gets ``F.sha256`` (``sha256sum`` format, whole-file hash computed
while streaming). Safety: an existing ``OUT`` is refused unless ``overwrite``; ``OUT`` may not lie
inside the input (nor, when overwriting a folder, contain it); everything is written in a hidden
temporary folder beside ``OUT`` and moved into place at the end, and removed on any failure.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zckpt.checkpoint import Checkpoint
from zckpt.errors import KeyMappingError, OutputExists
from zckpt.formats import hf, open_checkpoint, torch_file
from zckpt.io import pipeline
from zckpt.io.outputs import Staging, WriteItem, parse_size, plan_shards, planned_names
from zckpt.model import Role, dtype_name
from zckpt.ops import group as dist
from zckpt.ops.progress import bar as progress_bar

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_PRECISIONS = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16",
               "float16": "fp16", "half": "fp16"}  # fmt: skip
HF_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "processor_config.json",
)  # fmt: skip
FORMATS = ("safetensors", "bin")


@dataclass(frozen=True)
class ConsolidateResult:
    """What ``consolidate`` wrote."""

    out: Path
    format: str
    files: tuple[Path, ...]
    tensors: int
    bytes: int
    tied: dict[str, str] = field(default_factory=dict)
    dtypes: dict[str, int] = field(default_factory=dict)
    """Output dtype name -> number of tensors written in it."""
    copied: tuple[str, ...] = ()
    """HF config/tokenizer files copied from beside the checkpoint."""

    def to_json(self) -> dict[str, Any]:
        return {"out": str(self.out), "format": self.format, "files": [str(f) for f in self.files],
                "tensors": self.tensors, "bytes": self.bytes, "tied": dict(self.tied),
                "dtypes": dict(self.dtypes), "copied": list(self.copied)}  # fmt: skip


def _layout(out: Path, format: str | None) -> tuple[str, bool]:
    """(format, out is a folder)."""
    if format is not None and format not in FORMATS:
        raise KeyMappingError(f"unknown output format {format!r}; choose one of {', '.join(FORMATS)}")
    suffix = out.suffix
    if suffix == ".safetensors":
        fmt, is_dir = "safetensors", False
    elif suffix in torch_file.SUFFIXES:
        fmt, is_dir = "bin", False
    elif suffix and not out.is_dir():
        raise KeyMappingError(
            f"{out}: cannot tell the output format from {suffix!r}",
            hint="name it *.safetensors or *.bin, or give a folder for the HF layout",
        )
    else:
        return format or "safetensors", True
    if format is not None and format != fmt:
        raise KeyMappingError(f"{out}: --format {format} does not match the file suffix {suffix!r}")
    return fmt, is_dir


def _target_dtype(dtype: str, ckpt: Checkpoint) -> torch.dtype | None:
    """The cast for floating tensors, or None to keep each tensor's dtype."""
    if dtype in DTYPES:
        return DTYPES[dtype]
    if dtype != "auto":
        raise KeyMappingError(f"unknown dtype {dtype!r}; choose auto, fp32, bf16 or fp16")
    prec = _PRECISIONS.get(str(ckpt.meta.precision).lower()) if ckpt.meta.precision else None
    return DTYPES[prec] if prec else None


def plan(
    ckpt: Checkpoint, *, dtype: str = "auto", keep_fp32: Sequence[str] = (), exclude_frozen: bool = False
) -> tuple[list[WriteItem], dict[str, str]]:
    """The tensors ``consolidate`` writes (owners only, in checkpoint order) and the kept tied aliases."""
    target = _target_dtype(dtype, ckpt)
    items: list[WriteItem] = []
    for e in ckpt.model_entries():
        if exclude_frozen and e.role is Role.FROZEN:
            continue
        out = e.dtype
        if e.dtype.is_floating_point:
            if any(fnmatch.fnmatchcase(e.name, pat) for pat in keep_fp32):
                out = torch.float32
            elif target is not None:
                out = target
        items.append(WriteItem(e.name, e, out))
    kept = {it.name for it in items}
    tied = {a: o for a, o in ckpt.meta.tied.items() if o in kept}
    return items, tied


def _check_paths(src: Path, out: Path, *, overwrite: bool) -> None:
    src, res = src.resolve(), out.resolve()
    if res == src or src in res.parents:
        raise OutputExists(f"{out} is inside the input {src}", hint="write the output somewhere else",
                           path=str(out))  # fmt: skip
    if overwrite and res in src.parents:
        raise OutputExists(f"{out} contains the input {src}; overwriting it would delete the input",
                           path=str(out))  # fmt: skip


def _hf_files(src: Path) -> list[Path]:
    """HF config/tokenizer files beside the checkpoint (in its folder, or the parent of a tag folder)."""
    folders = [src] if src.is_dir() else [src.parent]
    if src.is_dir() and not (src / "config.json").is_file():
        folders.append(src.parent)
    for folder in folders:
        if (folder / "config.json").is_file():
            return [folder / n for n in HF_FILES if (folder / n).is_file()]
    return []


def consolidate(
    ckpt_or_path: Checkpoint | str | Path,
    out: str | Path,
    *,
    dtype: str = "auto",
    keep_fp32: Sequence[str] = (),
    max_shard_size: int | str | None = None,
    tag: str | None = None,
    exclude_frozen: bool = False,
    format: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    trust_pickle: bool = False,
    workers: int | None = None,
    distributed: bool | None = None,
) -> ConsolidateResult:
    """Write the model tensors of a checkpoint as one loadable model.

    Args:
        ckpt_or_path: an open ``Checkpoint`` or a path ``zckpt.open`` understands.
        out: ``*.safetensors`` / ``*.bin`` file, or a folder (HF layout).
        dtype (`str`, defaults to ``"auto"``): ``auto``, ``fp32``, ``bf16`` or ``fp16`` (see module doc).
        keep_fp32: fnmatch globs of tensor names kept in fp32.
        max_shard_size: split into shards of at most this size (``"5GB"`` or bytes), with an index.
        tag: checkpoint tag to read instead of ``latest``.
        exclude_frozen: leave out frozen (``requires_grad=False``) params.
        format (`str`, *optional*): ``safetensors`` or ``bin``; default from ``out``'s suffix.
        overwrite: replace an existing ``out``.
        progress: show a tqdm bar (only on a terminal).
        trust_pickle: resolve pickled globals outside the allowlist (only for files you trust).
        workers: reader threads overlapping reads and casts with writes (safetensors output;
            default ``zckpt.io.pipeline.default_workers()``, divided among the ranks of one host).
        distributed (`bool`, *optional*): split the writing over the ranks of a ``torch.distributed``
            group (module doc). ``None``: when a group of world > 1 is initialised; ``True``: also start
            one (gloo, ``env://``) under ``torchrun``; ``False``: never. Call it on every rank.

    Returns:
        A ``ConsolidateResult`` listing the files written (on every rank, when distributed).

    Example:
        >>> zckpt.consolidate("out/checkpoint-100", "model/", dtype="bf16", max_shard_size="5GB")
    """
    out = Path(out)
    fmt, is_dir = _layout(out, format)
    shard = parse_size(max_shard_size) if max_shard_size is not None else None
    g = dist.group(distributed)
    if g is not None:
        return _consolidate_group(
            g, ckpt_or_path, out, fmt, is_dir, shard, dtype=dtype, keep_fp32=keep_fp32, tag=tag,
            exclude_frozen=exclude_frozen, overwrite=overwrite, progress=progress,
            trust_pickle=trust_pickle, workers=workers,
        )  # fmt: skip
    opened = not isinstance(ckpt_or_path, Checkpoint)
    ckpt = (
        open_checkpoint(ckpt_or_path, tag=tag, trust_pickle=trust_pickle)
        if not isinstance(ckpt_or_path, Checkpoint)
        else ckpt_or_path
    )
    try:
        src = Path(ckpt.meta.path)
        _check_paths(src, out, overwrite=overwrite)
        items, tied = plan(ckpt, dtype=dtype, keep_fp32=keep_fp32, exclude_frozen=exclude_frozen)
        total = sum(it.nbytes for it in items)
        extras = _hf_files(src) if is_dir else []
        base = _base(out, fmt, is_dir)
        with (
            Staging(out, is_dir=is_dir, overwrite=overwrite) as st,
            progress_bar(total, "consolidate", enabled=progress) as bar,
        ):
            st.expect(planned_names(base, items, shard))
            _write(st.dir, fmt, base, items, tied, shard, bar.update, workers)
            for f in extras:
                shutil.copy2(f, st.dir / f.name)
            files = st.commit()
    finally:
        if opened:
            ckpt.close()
    return _result(out, fmt, files, items, total, tied, extras)


def _result(out: Path, fmt: str, files: Sequence[Path], items: Sequence[WriteItem], total: int,
            tied: dict[str, str], extras: Sequence[Path]) -> ConsolidateResult:  # fmt: skip
    counts: dict[str, int] = {}
    for it in items:
        counts[dtype_name(it.dtype)] = counts.get(dtype_name(it.dtype), 0) + 1
    return ConsolidateResult(out=out, format=fmt, files=tuple(files), tensors=len(items), bytes=total,
                             tied=tied, dtypes=counts, copied=tuple(f.name for f in extras))  # fmt: skip


def _base(out: Path, fmt: str, is_dir: bool) -> str:
    if fmt == "safetensors":
        return hf.SAFETENSORS if is_dir else out.name
    return torch_file.BIN if is_dir else out.name


def _write(
    folder: Path,
    fmt: str,
    base: str,
    items: Sequence[WriteItem],
    tied: dict[str, str],
    shard: int | None,
    on_bytes: Callable[[int], None],
    workers: int | None,
    part: tuple[int, int] = (0, 1),
) -> None:
    if fmt == "safetensors":
        hf.write_into(folder, base, items, tied=tied, max_shard_size=shard, on_bytes=on_bytes,
                      workers=workers, part=part)  # fmt: skip
    else:
        torch_file.write_into(folder, base, items, tied=tied, max_shard_size=shard, on_bytes=on_bytes,
                              part=part)  # fmt: skip


def _plan_digest(fmt: str, base: str, is_dir: bool, items: Sequence[WriteItem], tied: dict[str, str],
                 shard: int | None) -> str:  # fmt: skip
    """What every rank must agree on before writing: the exact files and tensors of the output."""
    tensors = [(it.name, list(it.shape), str(it.dtype), it.nbytes, it.role.value) for it in items]
    plan_ = [fmt, base, is_dir, shard, sorted(tied.items()), tensors]
    return hashlib.sha256(json.dumps(plan_).encode()).hexdigest()


def _consolidate_group(
    g: dist.Group,
    ckpt_or_path: Checkpoint | str | Path,
    out: Path,
    fmt: str,
    is_dir: bool,
    shard: int | None,
    *,
    dtype: str,
    keep_fp32: Sequence[str],
    tag: str | None,
    exclude_frozen: bool,
    overwrite: bool,
    progress: bool,
    trust_pickle: bool,
    workers: int | None,
) -> ConsolidateResult:
    """``consolidate`` split over the ranks of ``g`` (module doc); every step ends in a collective vote."""
    opened = not isinstance(ckpt_or_path, Checkpoint)
    ckpt = ckpt_or_path if isinstance(ckpt_or_path, Checkpoint) else None
    if workers is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        workers = max(1, pipeline.default_workers() // max(1, local))
    with contextlib.ExitStack() as stack:  # rank 0's Staging: removed on any exit before commit
        st: Staging | None = None
        err: BaseException | None = None
        try:  # 1. open and plan on every rank; rank 0 makes the staging folder
            if not isinstance(ckpt_or_path, Checkpoint):
                ckpt = open_checkpoint(ckpt_or_path, tag=tag, trust_pickle=trust_pickle)
            assert ckpt is not None
            src = Path(ckpt.meta.path)
            _check_paths(src, out, overwrite=overwrite)
            items, tied = plan(ckpt, dtype=dtype, keep_fp32=keep_fp32, exclude_frozen=exclude_frozen)
            base = _base(out, fmt, is_dir)
            digest = _plan_digest(fmt, base, is_dir, items, tied, shard)
            if g.rank == 0:
                st = stack.enter_context(Staging(out, is_dir=is_dir, overwrite=overwrite))
                st.expect(planned_names(base, items, shard))
        except BaseException as e:  # noqa: BLE001 - voted on, then re-raised on this rank
            err = e
        try:
            g.agree(err, "consolidate: opening the checkpoint")
            staging, digest0 = g.broadcast((str(st.dir), digest) if st is not None else None)
            g.agree(None if digest == digest0 else KeyMappingError(
                f"rank {g.rank}: the output plan differs from rank 0's (another checkpoint, tag or "
                "options on this rank?)", hint="give every rank the same checkpoint and options"),
                "consolidate: agreeing on the output plan")  # fmt: skip

            shards = plan_shards(items, shard)
            mine = shards[g.rank :: g.world]
            if g.rank == 0 and len(shards) < g.world:
                warnings.warn(
                    f"{out}: {len(shards)} output file(s) for {g.world} ranks; {g.world - len(shards)} "
                    "rank(s) idle (pass a smaller --max-shard-size to split the work)",
                    stacklevel=2,
                )
            total = sum(it.nbytes for it in items)
            mine_bytes = sum(it.nbytes for s in mine for it in s)
            err = None
            try:  # 2. every rank writes its shards (rank 0 also the index)
                with progress_bar(mine_bytes, "consolidate", enabled=progress and g.rank == 0) as bar:
                    _write(Path(staging), fmt, base, items, tied, shard, bar.update, workers,
                           part=(g.rank, g.world))  # fmt: skip
            except BaseException as e:  # noqa: BLE001
                err = e
            g.agree(err, "consolidate: writing shards")

            extras = _hf_files(src) if is_dir else []
            err, final = None, None
            if st is not None:  # 3. rank 0 publishes
                try:
                    for f in extras:
                        shutil.copy2(f, st.dir / f.name)
                    final = [str(p) for p in st.commit()]
                except BaseException as e:  # noqa: BLE001
                    err = e
            g.agree(err, "consolidate: publishing the output")
            files = [Path(p) for p in g.broadcast(final)]
        finally:
            if opened and ckpt is not None:
                ckpt.close()
    return _result(out, fmt, files, items, total, tied, extras)
