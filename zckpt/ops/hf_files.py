"""The Hugging Face side files (config, tokenizer, generation config) a consolidated HF folder needs, found
beside the checkpoint and copied byte for byte — except ``config.json``, whose ``dtype``/``torch_dtype`` is
set to the dtype the weights were written in, so ``from_pretrained`` loads them as written."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from zckpt.dtypes import DType
from zckpt.errors import CorruptCheckpoint
from zckpt.model import dtype_name
from zckpt.storage import copied, fileio
from zckpt.storage.location import Location, lexists, location

if TYPE_CHECKING:
    import torch

HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)
_DTYPE_KEYS = ("dtype", "torch_dtype")
MAX_CONFIG = 16 << 20
MAX_SIDE_FILE = 1 << 30
"""Largest side file copied: configs and tokenizers are kilobytes to tens of megabytes (a 256k-token
``tokenizer.json`` ~35 MB); more is damage (a sparse file), refused before minutes of copying."""


def beside(path: Location, save_dir: str | None) -> list[Location]:
    """HF files in the checkpoint's folder, or in the save folder holding it (``checkpoint-N``), each one a
    regular file of that folder (``copied.checked``)."""
    folders = [path] if path.is_dir() else [path.parent]
    if save_dir is not None:
        folders.append(location(save_dir))
    elif path.is_dir():
        folders.append(path.parent)
    for folder in folders:
        if lexists(folder / "config.json"):  # a FIFO or a link leading out is refused, not passed over
            named = [folder / n for n in HF_FILES if lexists(folder / n)]
            return [copied.checked(f, folder, MAX_SIDE_FILE) for f in named]
    return []


def weights_dtype(dtypes: Iterable[DType | torch.dtype]) -> str | None:
    """The dtype ``config.json`` names for weights in ``dtypes``: the most common floating one."""
    floats = Counter(d for d in dtypes if d.is_floating_point)
    return dtype_name(floats.most_common(1)[0][0]) if floats else None


def copy(files: Iterable[Location], dest: Path, dtypes: Iterable[DType | torch.dtype]) -> None:
    """Copy ``files`` into ``dest``; ``config.json`` gets the weights' (most common floating) dtype."""
    dtype = weights_dtype(dtypes)
    for f in files:
        if f.name == "config.json" and dtype is not None:
            _write_config(f, dest / f.name, dtype)
        else:
            fileio.copy_file(f, dest / f.name)


def write_config(config: Mapping[str, object], dest: Path, dtypes: Iterable[DType | torch.dtype]) -> None:
    """Write a ``config.json`` a format built (``Format.hf_model``) into ``dest``, its ``dtype`` (and
    ``torch_dtype``) the weights' dtype."""
    doc = dict(config)
    dtype = weights_dtype(dtypes)
    if dtype is not None:
        doc["dtype"] = doc["torch_dtype"] = dtype
    (dest / "config.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def kept_config_dtype(path: Location) -> str | None:
    """The dtype a ``config.json`` that zckpt kept (did not write) names, if it names one (else None; an
    unreadable one is not zckpt's to judge)."""
    try:
        cfg = _read_config(path)
    except (CorruptCheckpoint, OSError):
        return None
    got = [v for k in _DTYPE_KEYS if isinstance(v := cfg.get(k), str)]
    return got[0].removeprefix("torch.") if got else None


def _read_config(src: Location) -> dict[str, object]:
    with fileio.open_regular(src) as fh:
        raw = fh.read(MAX_CONFIG + 1)
    try:
        cfg = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CorruptCheckpoint(
            f"{src}: not valid JSON", hint="fix or remove config.json", path=str(src)
        ) from None
    if not isinstance(cfg, dict) or len(raw) > MAX_CONFIG:
        raise CorruptCheckpoint(f"{src}: not an HF config (a JSON object)", path=str(src))
    return cfg


def _write_config(src: Location, dst: Path, dtype: str) -> None:
    cfg = _read_config(src)
    present = [k for k in _DTYPE_KEYS if k in cfg] or ["dtype"]
    for k in present:
        cfg[k] = dtype
    dst.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
