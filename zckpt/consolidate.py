"""``consolidate``: turn any checkpoint zckpt reads into one loadable model (safetensors or torch .bin).

Streams tensor by tensor: each tensor's pieces are read from the mmap'd rank files, cast in bounded
chunks (``zckpt.outputs.CHUNK_BYTES``) and written straight to the output, so peak memory is one
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

Integrity: every tensor file ``F`` gets ``F.sha256`` (``sha256sum`` format, whole-file hash computed
while streaming). Safety: an existing ``OUT`` is refused unless ``overwrite``; ``OUT`` may not lie
inside the input (nor, when overwriting a folder, contain it); everything is written in a hidden
temporary folder beside ``OUT`` and moved into place at the end, and removed on any failure.
"""

from __future__ import annotations

import fnmatch
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zckpt.errors import KeyMappingError, OutputExists
from zckpt.formats import hf, open_checkpoint, torch_file
from zckpt.model import Checkpoint, Role, dtype_name
from zckpt.outputs import Staging, WriteItem, parse_size, planned_names
from zckpt.progress import bar as progress_bar

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
            default ``zckpt.pipeline.default_workers()``).

    Returns:
        A ``ConsolidateResult`` listing the files written.

    Example:
        >>> zckpt.consolidate("out/checkpoint-100", "model/", dtype="bf16", max_shard_size="5GB")
    """
    out = Path(out)
    fmt, is_dir = _layout(out, format)
    shard = parse_size(max_shard_size) if max_shard_size is not None else None
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
        if fmt == "safetensors":
            base = hf.SAFETENSORS if is_dir else out.name
        else:
            base = torch_file.BIN if is_dir else out.name
        with (
            Staging(out, is_dir=is_dir, overwrite=overwrite) as st,
            progress_bar(total, "consolidate", enabled=progress) as bar,
        ):
            st.expect(planned_names(base, items, shard))
            if fmt == "safetensors":
                hf.write_into(
                    st.dir, base, items, tied=tied, max_shard_size=shard, on_bytes=bar.update, workers=workers
                )
            else:
                torch_file.write_into(
                    st.dir, base, items, tied=tied, max_shard_size=shard, on_bytes=bar.update
                )
            for f in extras:
                shutil.copy2(f, st.dir / f.name)
            files = st.commit()
    finally:
        if opened:
            ckpt.close()
    counts: dict[str, int] = {}
    for it in items:
        counts[dtype_name(it.dtype)] = counts.get(dtype_name(it.dtype), 0) + 1
    return ConsolidateResult(out=out, format=fmt, files=tuple(files), tensors=len(items), bytes=total,
                             tied=tied, dtypes=counts, copied=tuple(f.name for f in extras))  # fmt: skip
