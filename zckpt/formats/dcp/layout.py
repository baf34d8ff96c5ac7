"""Which folders make one DCP checkpoint, and what each flattened key is.

Folders (``resolve``): a DCP folder holds ``.metadata``; torchtitan keeps one per step (``<dir>/step-N/``:
the highest N with a ``.metadata`` unless ``--tag``); accelerate writes ``pytorch_model_fsdp_<i>/`` +
``optimizer_<i>/`` side by side (pass their parent or either folder: both are read as one checkpoint);
``HuggingFaceStorageWriter(save_distributed=True)`` writes ``shard-*.safetensors`` files with
``DCP_SHARDING_INFO`` and no ``.metadata``.

Keys (``classify``) by their ``planner_data`` path, never by splitting on dots: a 1-part path is a root model
tensor (model-only saves, torchtitan); ``("model", fqn)`` a nested model tensor (``get_state_dict`` recipe,
FSDP1, accelerate); under ``optim``/``optimizer``: ``("state", fqn, k)`` / ``("param_groups", i, k)`` or
torchtitan's flattened ``"state.<fqn>.<k>"`` / ``"param_groups.<fqn>.<k>"`` (the state or option name is the
part after the last dot: FQNs keep theirs); ``lr_scheduler``/``scheduler``: the scheduler's state; anything
else (``train_state``, ``dataloader``, user keys) is client state at its path.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from zckpt.errors import CorruptCheckpoint, KeyMappingError, PermissionDenied, UnknownFormat
from zckpt.formats.dcp.metadata import METADATA
from zckpt.storage import fileio
from zckpt.storage.location import Location, lexists, ordered

NAME = "dcp"

OPTIM = ("optim", "optimizer")
SCHEDULER = ("lr_scheduler", "scheduler")
_STEP_RE = re.compile(r"^step-(\d+)$")
_ACC_RE = re.compile(r"^(pytorch_model_fsdp|optimizer)_(\d+)$")
_DISTCP_RE = re.compile(r"^__\d+_\d+\.distcp$")
SHARD_RE = re.compile(r"^shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors$")
SHARDING_INFO = "DCP_SHARDING_INFO"


def is_dcp_folder(p: Location) -> bool:
    """A folder holding a ``.metadata`` pickle."""
    try:
        with fileio.open_regular(p / METADATA) as f:
            return f.read(1) == b"\x80"
    except (OSError, CorruptCheckpoint):
        return False


def is_hf_shards(p: Location) -> bool:
    """A folder of ``HuggingFaceStorageWriter(save_distributed=True)`` shards (their headers carry DCP's
    sharding info)."""
    if not p.is_dir():
        return False
    shards = ordered(f for f in p.glob("shard-*.safetensors") if SHARD_RE.match(f.name))
    if not shards:
        return False
    try:
        with fileio.open_regular(shards[0]) as f:
            head = f.read(1 << 16)
    except (OSError, CorruptCheckpoint):
        return False
    return SHARDING_INFO.encode() in head


@dataclass(frozen=True)
class Source:
    """A DCP checkpoint on disk: ``root`` (``meta.path``), its DCP ``folders`` and how they were found."""

    root: Location
    folders: tuple[Location, ...]
    layout: str
    """``dcp`` (one folder), ``accelerate`` (model + optimizer folders) or ``hf-shards``."""
    save_dir: Location | None = None
    tag: str | None = None


def _step_dirs(p: Location) -> list[tuple[int, Location]]:
    """Every ``step-N`` folder of ``p``, oldest first."""
    try:
        children = ordered(p.iterdir()) if p.is_dir() else []
    except OSError:
        return []
    out = []
    for d in children:
        m = _STEP_RE.match(d.name)
        if m and d.is_dir():
            out.append((int(m.group(1)), d))
    return sorted(out, key=lambda x: x[0])  # stable: equal steps stay in name order


def _steps(p: Location) -> list[tuple[int, Location]]:
    """The ``step-N`` folders of ``p`` that hold a readable ``.metadata``, oldest first."""
    return [(n, d) for n, d in _step_dirs(p) if is_dcp_folder(d)]


def _unreadable(md: Location) -> str:
    """Why the ``.metadata`` at ``md`` (not a readable DCP pickle) cannot be read, for an error line."""
    if not lexists(md):
        return "missing"
    try:
        with fileio.open_regular(md):
            pass
    except CorruptCheckpoint as e:  # a FIFO, a device, a folder, a dangling link...
        return str(e).removeprefix(f"{md}: ")
    except PermissionDenied:  # not damage: said as what it is
        raise
    except OSError as e:
        return f"cannot open ({e.strerror})"
    return "not a DCP metadata pickle"


def _broken_step(p: Location) -> Location | None:
    """The ``.metadata`` of a ``step-N`` folder that a step lookup must not pass over: one that is there but
    not readable, in a folder newer than every readable step (it is damage, not an unfinished save), or,
    when no step is readable, a missing one beside ``.distcp`` files. A newer step folder with no
    ``.metadata`` at all is an unfinished save: torchtitan skips it too, and so does ``resolve``."""
    dirs = _step_dirs(p)
    readable = [n for n, d in dirs if is_dcp_folder(d)]
    newest = readable[-1] if readable else -1
    for n, d in reversed(dirs):
        if n > newest and lexists(d / METADATA):
            return d / METADATA
    if not readable:
        for _, d in reversed(dirs):
            if _distcp_without_metadata(d):
                return d / METADATA
    return None


def _refuse_metadata(md: Location) -> CorruptCheckpoint:
    what = _unreadable(md)
    return CorruptCheckpoint(
        f"{md}: {what}, so this DCP checkpoint cannot be read"
        + (" (an unfinished save?)" if what == "missing" else ""),
        hint="DCP writes .metadata last; restore the folder from the original save",
        path=str(md),
    )


def _accelerate(parent: Location, index: str | None) -> Source | None:
    pairs: dict[str, dict[str, Location]] = {}
    unfinished: dict[str, Location] = {}
    for d in parent.iterdir() if parent.is_dir() else ():
        m = _ACC_RE.match(d.name)
        if m and is_dcp_folder(d):
            pairs.setdefault(m.group(2), {})[m.group(1)] = d
        elif m and d.is_dir():  # named as one half of a pair, but no readable .metadata
            unfinished[m.group(2)] = d
    if not pairs:
        return None
    gone = unfinished.get(index if index is not None else next(iter(pairs)))
    if gone is not None and (index is not None or len(pairs) == 1):  # half a pair: never read as a whole one
        md = gone / METADATA
        what = "missing" if not lexists(md) else "not a readable DCP metadata file"
        raise CorruptCheckpoint(
            f"{md}: {what}, so this accelerate checkpoint is incomplete (an unfinished save?)",
            hint="DCP writes .metadata last; restore the folder from the original save",
            path=str(md),
        )
    if index is None:
        if len(pairs) > 1:
            raise UnknownFormat(
                f"{parent}: holds {len(pairs)} accelerate models ({', '.join(sorted(pairs))})",
                hint=f"give one folder, e.g. {parent / ('pytorch_model_fsdp_' + min(pairs))}",
                path=str(parent),
            )
        index = next(iter(pairs))
    got = pairs.get(index, {})
    folders = tuple(got[k] for k in ("pytorch_model_fsdp", "optimizer") if k in got)
    return Source(parent, folders, "accelerate") if folders else None


def detect(p: Location) -> bool:
    """A DCP folder, a folder of them (torchtitan's steps, accelerate's pair), or one file of one (claimed
    only to be refused with the folder to give: a ``.distcp`` file ends like a torch zip of its last item)."""
    if p.is_file():
        return p.suffix == ".distcp" or p.name == METADATA
    if not p.is_dir():
        return False
    if is_dcp_folder(p) or is_hf_shards(p) or _distcp_without_metadata(p):
        return True
    return bool(_steps(p)) or _broken_step(p) is not None or _accelerate_quiet(p)


def _distcp_without_metadata(p: Location) -> bool:
    """``__<rank>_<n>.distcp`` files and no ``.metadata``: an unfinished save (or one that lost it), claimed
    so that ``resolve`` says so instead of "not a checkpoint"."""
    try:
        names = [f.name for f in p.iterdir()]
    except OSError:
        return False
    return METADATA not in names and any(_DISTCP_RE.match(n) for n in names)


def _accelerate_quiet(p: Location) -> bool:
    try:
        return _accelerate(p, None) is not None
    except UnknownFormat:
        return True  # several models: ``resolve`` names them


def resolve(p: Location, tag: str | None = None) -> Source:
    """The checkpoint at ``p`` (see the module doc); ``tag`` picks a torchtitan ``step-N`` folder."""
    if p.is_file():
        raise KeyMappingError(
            f"{p}: one file of a DCP checkpoint; alone it holds no complete tensor list",
            hint=f"give the folder that holds it ({p.parent})",
            path=str(p),
        )
    if tag is not None:
        inner = p if p.name == tag and is_dcp_folder(p) else p / tag
        if (
            not is_dcp_folder(inner)
            and inner.is_dir()
            and (lexists(inner / METADATA) or _distcp_without_metadata(inner))
        ):
            raise _refuse_metadata(inner / METADATA)
        if not is_dcp_folder(inner):
            raise CorruptCheckpoint(
                f"{p}: no DCP folder {tag!r:.80} (one holding {METADATA})",
                hint="give the folder holding the step-N folders, or drop --tag",
                path=str(p),
            )
        return Source(inner, (inner,), "dcp", inner.parent, inner.name)
    m = _ACC_RE.match(p.name)
    if m and is_dcp_folder(p):
        acc = _accelerate(p.parent, m.group(2))
        if acc is not None and len(acc.folders) == 2:
            return acc
    if is_dcp_folder(p):
        if _STEP_RE.match(p.name) and len(_steps(p.parent)) > 0:
            return Source(p, (p,), "dcp", p.parent, p.name)
        return Source(p, (p,), "dcp")
    if is_hf_shards(p):
        return Source(p, (p,), "hf-shards")
    broken = _broken_step(p)
    if broken is not None:
        raise _refuse_metadata(broken)
    steps = _steps(p)
    if steps:
        d = steps[-1][1]
        return Source(d, (d,), "dcp", p, d.name)
    acc = _accelerate(p, None)
    if acc is not None:
        return acc
    md = p / METADATA
    raise CorruptCheckpoint(
        f"{md}: missing (an unfinished save, or not a DCP folder)",
        hint="DCP writes .metadata last; without it the .distcp files cannot be read",
        path=str(md),
    )


# ---- keys ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    """What one flattened key holds.

    ``kind``: ``model`` (``name`` = FQN), ``optim`` (``name`` = FQN, ``state``), ``group`` (``group`` = index
    or FQN, ``state`` = option name), ``scheduler`` / ``client`` (``path`` inside that state)."""

    kind: str
    name: str = ""
    state: str = ""
    group: int | str | None = None
    path: tuple[str | int, ...] = ()


def _flat_optim(part: str) -> Slot | None:
    """torchtitan's flattened ``state.<fqn>.<k>`` / ``param_groups.<fqn>.<k>``."""
    for head, kind in (("state.", "optim"), ("param_groups.", "group")):
        if part.startswith(head):
            fqn, dot, k = part[len(head) :].rpartition(".")
            if dot and fqn and k:
                return Slot("optim", fqn, k) if kind == "optim" else Slot("group", state=k, group=fqn)
    return None


def classify(path: tuple[str | int, ...], is_tensor: bool) -> Slot:
    """The ``Slot`` of a key with ``planner_data`` path ``path`` (see the module doc)."""
    head = path[0]
    if len(path) == 1:
        return Slot("model", str(head)) if is_tensor else Slot("client", path=path)
    if head == "model" and len(path) == 2 and is_tensor:
        return Slot("model", str(path[1]))
    if head in OPTIM:
        if len(path) == 4 and path[1] == "state" and isinstance(path[2], str) and isinstance(path[3], str):
            return Slot("optim", path[2], path[3])
        if len(path) == 4 and path[1] == "param_groups" and isinstance(path[2], int):
            return Slot("group", state=str(path[3]), group=path[2])
        if len(path) == 2 and isinstance(path[1], str):
            flat = _flat_optim(path[1])
            if flat is not None:
                return flat
    if head in SCHEDULER:
        return Slot("scheduler", path=path[1:])
    return Slot("client", path=path)


@functools.lru_cache(maxsize=4096)
def rank_of(file: str) -> int | None:
    """The saving rank in a ``__<rank>_<n>.distcp`` name (cached: asked once per chunk, of a few files)."""
    m = re.match(r"^__(\d+)_\d+\.distcp$", Path(file).name)
    return int(m.group(1)) if m else None
