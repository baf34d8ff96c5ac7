"""Locating a DeepSpeed checkpoint's files: the tag folder (``latest``, ``--tag``, or the tag folder
itself), the rank files in it (natural-sorted, ``bf16_``/``fp16_``/legacy names), and the checks that
name missing, extra or stale rank files. No unpickling here; ``zckpt.formats.deepspeed`` builds the
checkpoint from these files.
"""

from __future__ import annotations

import re
from typing import Any

from zckpt.errors import CorruptCheckpoint, ShardMismatch, UnknownFormat, Unsupported
from zckpt.formats._latest import read_latest, valid_tag
from zckpt.storage.location import Location, absolute, location, ordered

_MODEL_RE = re.compile(r"^(?:zero_pp_rank_(?P<dp>\d+)_)?mp_rank_(?P<mp>\d+)_model_states\.pt$")
_OPTIM_RE = re.compile(
    r"^(?P<pre>bf16_|fp16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_?optim_states\.pt$"
)
_UNSUPPORTED = (
    (re.compile(r"^(?:layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt$"), "MoE expert weight files"),
    (re.compile(r"^expp_rank_\d+_mp_rank_\d+_optim_states\.pt$"), "MoE expert optimizer files"),
    (re.compile(r"^layer_\d+-.+-model_states\.pt$"), "pipeline-parallel per-layer files"),
)
_TAG_HINT = "give the folder that holds `latest`, or the tag folder itself (e.g. .../global_step100)"


# ---- locating the files ------------------------------------------------------------------------------
def _natural(s: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _has_model_states(d: Location) -> bool:
    try:
        return any(_MODEL_RE.match(f.name) for f in d.iterdir())  # any kind: the reader says what is wrong
    except OSError:
        return False


def _tags(save_dir: Location) -> list[str]:
    return sorted((d.name for d in save_dir.iterdir() if d.is_dir() and _has_model_states(d)), key=_natural)


def detect(path: Location) -> bool:
    p = location(path)
    if not p.is_dir():
        return False
    if _has_model_states(p):
        return True
    if (p / "latest").exists():
        # a save dir whose `latest` names a missing tag, or a tag folder of DeepSpeed rank files without its
        # model-states file, or a damaged `latest`, is still DeepSpeed's: resolve() then says what is wrong.
        # (The native format, also with `latest`, is detected before this one.)
        try:
            tag = read_latest(p)
            named = p / str(tag)
            if not named.is_dir():
                return True
            if any(_MODEL_RE.match(f.name) or _OPTIM_RE.match(f.name) for f in named.iterdir()):
                return True
        except (OSError, CorruptCheckpoint):
            return True
    return bool(_tags(p))


def resolve(path: Location, tag: str | None) -> tuple[Location, str, Location]:
    """(save dir, tag, tag folder)."""
    path = absolute(path)  # "." names its folder: a tag's save dir is its real parent
    if not path.is_dir():
        raise UnknownFormat(
            f"{path}: not a folder; a DeepSpeed checkpoint is a folder", hint=_TAG_HINT, path=str(path)
        )
    if _has_model_states(path) and (tag is None or tag == path.name):
        return path.parent, path.name, path
    if tag is not None:
        if not valid_tag(tag):
            raise UnknownFormat(f"--tag {tag!r:.80} is not a folder name", path=str(path))
        td = path / tag
        if not _has_model_states(td):
            tags = _tags(path) if not _has_model_states(path) else []
            raise UnknownFormat(
                f"{td}: no tag folder {tag!r} with DeepSpeed *_model_states.pt files",
                hint=f"tags here: {', '.join(tags) or 'none'}",
                path=str(td),
            )
        return path, tag, td
    latest = path / "latest"
    t = read_latest(path)
    if t is not None:
        td = path / t
        if not _has_model_states(td):
            raise ShardMismatch(
                f"{latest}: names tag {t!r} but {td} holds no *_model_states.pt files",
                hint=f"pass --tag; tags here: {', '.join(_tags(path)) or 'none'}",
                path=str(latest),
            )
        return path, t, td
    tags = _tags(path)
    if len(tags) == 1:
        return path, tags[0], path / tags[0]
    if tags:
        raise UnknownFormat(
            f"{path}: several DeepSpeed tags and no `latest` file: {', '.join(tags)}",
            hint="choose one with --tag",
            path=str(path),
        )
    nested = sorted((d.name for d in path.iterdir() if d.is_dir() and detect(d)), key=_natural)
    if nested:
        raise UnknownFormat(
            f"{path}: holds DeepSpeed checkpoint folders ({', '.join(nested[:5])}) but is not one",
            hint=f"give one of them, e.g. {path / nested[-1]}",
            path=str(path),
        )
    empty = not any(path.iterdir())
    raise UnknownFormat(
        f"{path}: {'the folder is empty' if empty else 'no DeepSpeed checkpoint here'} "
        "(no `latest`, no tag folder, no *_model_states.pt)",
        hint=_TAG_HINT,
        path=str(path),
    )


def scan(td: Location) -> tuple[dict[int, Location], dict[int, Location]]:
    """({dp rank: model-states file}, {dp rank: optim file}); ZeRO-0/1/2 model file is rank 0."""
    model: dict[int, Location] = {}
    optim: dict[int, Location] = {}
    for f in ordered(td.iterdir(), key=lambda f: _natural(f.name)):
        if f.name == "offloaded_tensors":
            raise Unsupported(
                f"{f}: ZeRO-3 NVMe-offloaded optimizer state (swap files) is not supported yet",
                hint="re-save with offload_optimizer.device=cpu or none",
                path=str(f),
            )
        for rx, what in _UNSUPPORTED:
            if rx.match(f.name):
                raise Unsupported(f"{f}: {what} are not supported yet", path=str(f))
        m, o = _MODEL_RE.match(f.name), _OPTIM_RE.match(f.name)
        hit = m or o
        if hit is None:
            continue
        if int(hit["mp"]) != 0:
            raise Unsupported(
                f"{f}: model-parallel rank {int(hit['mp'])}; tensor/pipeline parallel (mp > 1) "
                "checkpoints are not supported yet",
                path=str(f),
            )
        table, r = (model, int(m["dp"] or 0)) if m else (optim, int(o["dp"]))  # type: ignore[index]
        if r in table:
            raise ShardMismatch(
                f"{f}: second file for rank {r} besides {table[r].name}",
                hint="one of them is stale from another run; move it away",
                path=str(f),
            )
        table[r] = f
    zero3 = [f for f in model.values() if f.name.startswith("zero_pp_rank_")]
    if zero3 and len(zero3) != len(model):
        raise ShardMismatch(
            f"{td}: both mp_rank_00_model_states.pt and ZeRO-3 zero_pp_rank_*_model_states.pt",
            hint="files from two runs with different ZeRO stages are mixed",
            path=str(td),
        )
    return model, optim


def check_ranks(
    td: Location, files: dict[int, Location], ws: int, what: str, source: Location, example: str
) -> None:
    missing = sorted(set(range(ws)) - set(files))
    extra = sorted(set(files) - set(range(ws)))
    if missing:
        name = re.sub(r"zero_pp_rank_\d+_", f"zero_pp_rank_{missing[0]}_", example)
        raise ShardMismatch(
            f"{td / name}: missing {what} file of rank {missing[0]} (world size {ws} from {source.name})",
            hint="copy every rank's file; a partial copy cannot be read",
            path=str(td / name),
        )
    if extra:
        f = files[extra[0]]
        raise ShardMismatch(
            f"{f}: extra {what} file of rank {extra[0]}; the checkpoint has world size {ws} "
            f"(from {source.name})",
            hint="it is stale from a run with more ranks; move it away",
            path=str(f),
        )
