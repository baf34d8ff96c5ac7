"""Which folders are Megatron-Core ``torch_dist`` checkpoints, and which iteration folder a path names.

A save folder holds ``latest_checkpointed_iteration.txt`` (an iteration number, or ``release``) and
``iter_NNNNNNN/`` (seven digits) or ``release/``. An iteration folder holds DCP's ``.metadata``, the
``.distcp`` files, Megatron's ``common.pt`` and ``metadata.json`` (``{"sharded_backend": "torch_dist",
...}``). ``resolve`` maps either (and a ``tag``: ``iter_0000003``, ``3`` or ``release``) to a ``Source``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from zckpt.errors import CorruptCheckpoint, InvalidArgument, PathNotFound, Unsupported
from zckpt.storage import fileio
from zckpt.storage.location import Location

NAME = "megatron"

LATEST = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
MARKER = "metadata.json"
RELEASE = "release"
_ITER = re.compile(r"^iter_\d{7,}$")
MAX_LATEST = 64
MAX_MARKER = 1 << 16


@dataclass(frozen=True)
class Source:
    """An iteration folder to read: ``folder``, its ``tag`` (folder name) and the save folder, if given."""

    folder: Location
    tag: str
    save_dir: Location | None


def is_iteration(path: Location) -> bool:
    """``path`` is an iteration folder of a ``torch_dist`` save (cheap: names and ``metadata.json``)."""
    if not (path.is_dir() and (path / ".metadata").is_file() and (path / COMMON).is_file()):
        return False
    return _backend(path / MARKER) == "torch_dist"


def _backend(marker: Location) -> str | None:
    try:
        with fileio.open_regular(marker) as f:
            doc = json.loads(f.read(MAX_MARKER))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    got = doc.get("sharded_backend") if isinstance(doc, dict) else None
    return got if isinstance(got, str) else None


def is_save_folder(path: Location) -> bool:
    return path.is_dir() and (path / LATEST).is_file()


def detect(path: Location) -> bool:
    return is_iteration(path) or is_save_folder(path)


def tag_folder(tag: str) -> str:
    """The folder name of ``tag``: ``release``, ``iter_0000003`` as given, or a number padded to 7 digits."""
    t = tag.strip()
    if t == RELEASE or _ITER.match(t):
        return t
    if t.isdigit() and len(t) <= 18:
        return f"iter_{int(t):07d}"
    raise InvalidArgument(f"Megatron tag {tag!r:.60} is not an iteration number, iter_NNNNNNN or release")


def read_latest(save_dir: Location) -> str:
    """The iteration folder ``latest_checkpointed_iteration.txt`` names (a number or ``release``)."""
    f = save_dir / LATEST
    with fileio.open_regular(f) as fh:
        raw = fh.read(MAX_LATEST + 1)
    text = raw.decode("ascii", "replace").strip()
    if len(raw) > MAX_LATEST or not (text == RELEASE or (text.isdigit() and len(text) <= 18)):
        raise CorruptCheckpoint(
            f"{f}: not an iteration number or 'release' ({text[:40]!r})",
            hint="write the iteration to load into it, or give the iter_NNNNNNN folder itself",
            path=str(f),
        )
    return tag_folder(text)


def resolve(path: Location, tag: str | None) -> Source:
    """The iteration folder ``path`` (a save or iteration folder) and ``tag`` name."""
    if tag is None and is_iteration(path):
        return Source(path, path.name, path.parent if is_save_folder(path.parent) else None)
    if not is_save_folder(path):
        raise CorruptCheckpoint(f"{path}: not a Megatron torch_dist save or iteration folder", path=str(path))
    name = tag_folder(tag) if tag is not None else read_latest(path)
    folder = path / name
    if not folder.is_dir():
        what = f"tag {tag!r}" if tag is not None else f"{LATEST} names {name}, which"
        raise PathNotFound(
            f"{path}: {what} is not a folder here",
            hint="give an existing iter_NNNNNNN folder (or --tag)",
            path=str(folder),
        )
    if not is_iteration(folder):
        raise CorruptCheckpoint(
            f"{folder}: not a torch_dist iteration folder (needs .metadata, common.pt and metadata.json "
            "with sharded_backend torch_dist)",
            hint=f"a legacy 'torch' format save (mp_rank_XX/model_optim_rng.pt) is not read: {LEGACY_HINT}",
            path=str(folder),
        )
    return Source(folder, name, path)


LEGACY_RANK = re.compile(r"^mp_rank_\d{2}(_\d{3})?$")
"""A Megatron-LM legacy ``--ckpt-format torch`` rank folder (``mp_rank_TT`` or ``mp_rank_TT_PPP``)."""
LEGACY_FILES = ("model_optim_rng.pt", "distrib_optim.pt")
"""A legacy rank folder's files: model, optimizer and RNG states; the distributed optimizer's states."""
LEGACY_HINT = "Megatron-LM converts one with --ckpt-convert-format torch_dist --ckpt-convert-save DIR"


def refuse_legacy(p: Location, children: list[Location]) -> None:
    """An unrecognised folder ``p`` (with its ``children``) that is a legacy iteration folder (``mp_rank_*``
    folders) or one of its rank folders: refused as what it is (``Unsupported``), with the way to convert
    it."""
    if any(LEGACY_RANK.match(c.name) and c.is_dir() for c in children) or (
        LEGACY_RANK.match(p.name) and any(c.name in LEGACY_FILES for c in children)
    ):
        raise Unsupported(
            f"{p}: a Megatron-LM legacy 'torch' format save (mp_rank_XX/model_optim_rng.pt), which zckpt "
            "does not read (it reads torch_dist)",
            hint=LEGACY_HINT,
            path=str(p),
        )
