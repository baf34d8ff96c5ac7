"""Registry of on-disk formats. Each format is one module (or package) exposing ``FORMAT``, an instance of
``zckpt.formats.base.Format``; adding a format means adding a module and a line to ``_MODULES`` — never an
elif. Order matters: more specific layouts are detected first.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from pathlib import Path

from zckpt.checkpoint import Checkpoint
from zckpt.errors import InvalidArgument, PathNotFound, PermissionDenied, UnknownFormat
from zckpt.formats._latest import LATEST, refuse_dangling, valid_tag
from zckpt.formats._latest import MAX_BYTES as MAX_LATEST
from zckpt.formats.base import Format
from zckpt.formats.megatron.layout import LEGACY_FILES, refuse_legacy
from zckpt.storage import fileio, session
from zckpt.storage.location import Location, location, ordered
from zckpt.storage.objstore import RemotePath

_MODULES = (
    "zckpt.formats.native",
    "zckpt.formats.deepspeed",
    "zckpt.formats.megatron",
    "zckpt.formats.dcp",
    "zckpt.formats.hf",
    "zckpt.formats.torch_file",
)
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.(safetensors|bin)$")
_TELLTALES = (
    "manifest.json",
    "latest",
    "latest_checkpointed_iteration.txt",
    ".metadata",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
"""Files that name a folder as a checkpoint of some format: when one is there but nothing reads it, say so."""
_HINT = "give the folder that holds `latest` (or a tag folder), a .safetensors/.bin/.pt file or an HF folder"


def registry() -> dict[str, Format]:
    """Format name -> format, in detection order."""
    out: dict[str, Format] = {}
    for name in _MODULES:
        fmt = importlib.import_module(name).FORMAT
        if not isinstance(fmt, Format):
            raise TypeError(f"{name}.FORMAT is not a zckpt.formats.base.Format")
        out[fmt.name] = fmt
    return out


def check_access(path: Location, tag: str | None = None) -> None:
    """Refuse, as "permission denied" naming it, what this process may not read of the input: the folder
    (list, enter), the files that name it a checkpoint (``_TELLTALES``: ``latest``, a manifest, an index,
    ``.metadata``), and the tag folder ``tag`` or ``latest`` names, with its own telltales. The formats'
    probes would take them for missing ("no tag", "not a checkpoint"). Objects in a store are not checked
    here: the store's own errors name them (``zckpt.storage.objstore``)."""
    if isinstance(path, RemotePath):
        return
    fileio.check_access(path)
    if not path.is_dir():
        return
    _telltales(path)
    if tag is None:
        latest = path / LATEST
        if not latest.is_file():
            return
        with latest.open("rb") as f:  # readable: ``_telltales`` checked it
            tag = f.read(MAX_LATEST + 1).decode("utf-8", "replace").strip()
    if valid_tag(tag):
        fileio.check_access(path / tag)
        if (path / tag).is_dir():
            _telltales(path / tag)


def _telltales(folder: Path) -> None:
    for name in _TELLTALES:
        if (folder / name).is_file():
            fileio.check_readable(folder / name)


def detect(path: str | Location) -> Format:
    """The format that recognises ``path``."""
    p = location(path)
    check_access(p)
    if not p.exists():
        raise PathNotFound(f"{p}: no such file or folder", path=str(p))
    if not (p.is_file() or p.is_dir()):
        raise UnknownFormat(f"{p}: not a file or folder (a FIFO, device or socket)", path=str(p))
    if p.name in LEGACY_FILES and p.is_file():  # a Megatron legacy rank file is a torch file too
        refuse_legacy(p.parent, [p])
    fmts = registry().values()
    for fmt in fmts:
        if fmt.detect(p):
            return fmt
    if p.is_dir():
        if p.suffix in (".safetensors", ".bin", ".pt", ".pth"):
            raise UnknownFormat(
                f"{p}: a folder, not a {p.suffix} file, and no checkpoint zckpt recognises",
                hint="give the file itself, or the folder holding `latest`",
                path=str(p),
            )
        try:
            children = ordered(p.iterdir())
        except PermissionError as e:
            raise PermissionDenied(f"{p}: cannot list the folder ({e.strerror})", path=str(p)) from None
        except OSError as e:
            raise UnknownFormat(f"{p}: cannot list the folder ({e.strerror})", path=str(p)) from None
        if not children:
            raise UnknownFormat(f"{p}: the folder is empty", hint=_HINT, path=str(p))
        inner = [d for d in children if d.is_dir() and any(f.detect(d) for f in fmts)]
        refuse_dangling(p, inner[-1] if inner else None)
        if inner:  # one level too high: name the checkpoints inside
            names = ", ".join(d.name for d in inner[:5]) + (", ..." if len(inner) > 5 else "")
            raise UnknownFormat(
                f"{p}: not a checkpoint, but holds {len(inner)} ({names})",
                hint=f"give one of them, e.g. {inner[-1]}",
                path=str(p),
            )
        shards = sorted(c.name for c in children if _SHARD.search(c.name))
        if shards:  # HF weight shards whose index is missing
            index = _SHARD.sub(r".\1.index.json", shards[0])
            raise UnknownFormat(
                f"{p}: holds weight shards ({', '.join(shards[:2])}{', ...' if len(shards) > 2 else ''}) "
                f"but not their index {index}",
                hint="restore the index file, or give one shard file to read it alone",
                path=str(p),
            )
        refuse_legacy(p, children)
        known = [c.name for c in children if c.name in _TELLTALES][:3]
        if known:  # a checkpoint's files are there, but none of them reads as one: say which
            raise UnknownFormat(f"{p}: holds {', '.join(known)} but no format reads it as a checkpoint "
                                "(a damaged or foreign file?)", hint=_HINT, path=str(p))  # fmt: skip
    raise UnknownFormat(f"{p}: not a checkpoint zckpt recognises", hint=_HINT, path=str(p))


def get(name: str) -> Format:
    reg = registry()
    if name not in reg:
        raise InvalidArgument(f"unknown format {name!r}; known: {', '.join(reg)}")
    return reg[name]


def open_checkpoint(
    path: str | Location,
    *,
    tag: str | None = None,
    format: str | None = None,
    trust_pickle: bool = False,
    model_only: bool = False,
    storage_options: Mapping[str, str] | None = None,
    storage: session.Storage | None = None,
) -> Checkpoint:
    """Open a checkpoint lazily: headers and metadata only; tensor bytes are read on access.

    Args:
        path: a DeepSpeed save folder (holding ``latest``) or tag folder, a torch DCP folder, a native
            (zckpt engine) folder, an HF Trainer ``checkpoint-N``, an HF folder, a ``.safetensors`` file
            or a torch ``.bin``/``.pt`` state dict.
        tag: the tag (sub-folder) to read instead of the one ``latest`` names (``global_step100``,
            torchtitan's ``step-100``).
        format: skip detection and read ``path`` as this format (``deepspeed``, ``dcp``, ``native``,
            ``hf``, ``torch``...); default: detected from the files.
        trust_pickle: resolve pickled globals outside zckpt's allowlist (only for files you trust);
            nothing is ever unpickled outside the allowlisted unpickler otherwise.
        model_only: the model tensors are all the caller needs: a format may then leave out optimizer
            and training state (DCP does: it opens only the model chunks' archives, each when its tensor
            is first read, so a damaged archive is reported then), and ``optim_keys()`` may be empty.
        storage_options: the object-store client's options for an ``s3://`` path (``zckpt.storage.objstore``).
        storage: a ``zckpt.Storage`` to read through (yours to close); by default the checkpoint makes its
            own, from ``storage_options``, and closes it with itself. The checkpoint sees the files as they
            were listed while it is open: open it again to see a newer save.

    Returns:
        A ``Checkpoint``: a ``Mapping`` of model tensors by state-dict name (``ckpt["emb.weight"]`` reads
        that one tensor), with ``ckpt.meta`` (format, world size, stage, precision, step, ties) and the
        optimizer states through ``optim_keys()`` / ``read(key)``. Close it (or use ``with``) to release
        its files.

    Raises:
        PathNotFound: (a ``FileNotFoundError``) ``path`` does not exist.
        PermissionDenied: (a ``PermissionError``) a file or folder cannot be read.
        UnknownFormat: no format recognises ``path`` (the message says what was found instead).
        InvalidArgument: (a ``ValueError``) an unknown ``format`` name.
        CorruptCheckpoint: the files are truncated, malformed or inconsistent (``ShardMismatch`` for
            missing or stale rank files).
        UnsafePickle: a pickle asks for a global outside the allowlist (nothing was executed).

    Example:
        >>> import zckpt
        >>> with zckpt.open("out/", tag="global_step100") as ckpt:
        ...     print(ckpt.meta.format, ckpt.meta.world_size, len(ckpt))
        ...     w = ckpt["emb.weight"]           # reads only this tensor's pieces
        ...     ckpt.get("missing", None)        # a Mapping: None, no error
    """
    given = storage if storage is not None else session.bound_storage()
    if given is not None and storage_options and storage is None:
        given = None  # called inside an operation, with options of its own: a storage of its own
    st = given if given is not None else session.Storage(storage_options)
    try:
        with st.bound():
            check_access(location(path), tag)
            fmt = get(format) if format is not None else detect(path)
            if model_only:
                ck = fmt.read_model(location(path), tag=tag, trust_pickle=trust_pickle)
            else:
                ck = fmt.read(location(path), tag=tag, trust_pickle=trust_pickle)
    except BaseException:
        if given is None:
            st.close()
        raise
    ck.attach(st, owned=given is None)
    return ck
