"""safetensors files and Hugging Face model folders: lazy reading (headers only) and streaming writing.

Reads a single ``.safetensors`` file, or an HF folder holding ``model.safetensors``, sharded
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``, or ``pytorch_model.bin``
(sharded with ``pytorch_model.bin.index.json``; the ``.bin`` files are read by ``torch_file``). Headers
are parsed strictly by ``zckpt.codecs.safetensors``; each tensor becomes one ``Piece`` pointing into its file.

zckpt's own metadata (``zckpt.formats._flat``), written here and read back:

- ``__metadata__["format"] = "pt"`` (transformers requires it);
- ``__metadata__["zckpt.tied"]``: JSON ``{alias: owner}``. One copy is stored, under the owner's name;
  transformers re-ties aliases itself from ``config.tie_word_embeddings``, so aliases are *not*
  listed in the index's ``weight_map`` (that would make them "missing" from their shard). The
  index's ``metadata`` also holds ``"zckpt.tied"`` (as a JSON object);
- ``__metadata__["zckpt.roles"]``: JSON ``{name: "frozen" | "buffer" | "optim"}`` for tensors that are
  not trainable params. Without it, floating tensors are params and the others (int, bool) buffers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zckpt.checkpoint import Checkpoint
from zckpt.codecs import safetensors
from zckpt.errors import CorruptCheckpoint, KeyMappingError, ShardMismatch
from zckpt.formats import _flat, torch_file
from zckpt.formats._names import HF_WEIGHT_BASES, PUBLISH_ORDER
from zckpt.formats.base import Format, ModelWriteOptions, ModelWriter
from zckpt.model import Piece, TensorEntry
from zckpt.state import CheckpointMeta
from zckpt.storage import fileio
from zckpt.storage.location import Location, location, ordered
from zckpt.storage.objstore import RemotePath
from zckpt.stream import integrity
from zckpt.stream.integrity import SIDECARS, Problem, VerifyContext
from zckpt.stream.shards import family, planned_names, write_sharded

if TYPE_CHECKING:  # writers stream tensors (torch); reading needs none
    from zckpt.stream.items import WriteItem

NAME = "hf"
SAFETENSORS = "model.safetensors"
TIED_KEY, ROLES_KEY = _flat.TIED_KEY, _flat.ROLES_KEY
_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<k>\d{5})-of-(?P<n>\d{5})(?P<suffix>\..+)$")


def _folder_layout(folder: Location) -> tuple[str, Location] | None:
    """("index"|"single", file) for an HF folder; safetensors before .bin, an index before a lone file."""
    for suffix in (".safetensors", ".bin"):
        indexes = ordered(folder.glob(f"*{suffix}.index.json"))
        if len(indexes) == 1:
            return "index", indexes[0]
        base = folder / (SAFETENSORS if suffix == ".safetensors" else torch_file.BIN)
        if base.is_file():
            return "single", base
        if suffix == ".safetensors":
            files = ordered(folder.glob("*.safetensors"))
            if len(files) == 1:
                return "single", files[0]
    return None


_NATIVE_RANK = re.compile(r"^rank_\d{5}\.safetensors$")
_NATIVE_KEYS = ("param/", "frozen/", "optim/", "rng/")


def file_entries(path: Location) -> tuple[list[TensorEntry], dict[str, str], dict[str, str]]:
    """(entries, tied aliases, raw metadata) of one safetensors file."""
    h = safetensors.read_header(path)
    if _NATIVE_RANK.match(path.name) and any(k.startswith(_NATIVE_KEYS) for k in h.tensors):
        raise KeyMappingError(
            f"{path}: one rank file of a zckpt-native checkpoint; alone it holds partitions, not the model",
            hint=f"give the tag folder that holds it ({path.parent}) or the folder holding `latest`",
            path=str(path),
        )
    roles = _flat.json_map(h.metadata.get(_flat.ROLES_KEY), _flat.ROLES_KEY, path)
    check = integrity.file_check(path)
    entries = []
    for name, e in h.tensors.items():
        role = _flat.role_of(name, e.dtype, roles, path)
        piece = Piece(str(path), e.begin, e.dtype, 0, e.numel, check=check)
        entries.append(_flat.entry_of(name, e.shape, e.dtype, role, (piece,), path))
    tied = _flat.json_map(h.metadata.get(_flat.TIED_KEY), _flat.TIED_KEY, path)
    return entries, _flat.tied_map(tied, _flat.TIED_KEY, path), h.metadata


MAX_INDEX = 64 << 20
"""Bytes of a shard index read at most (a model of 100k tensors indexes them in a few MB)."""


def _read_json(path: Location) -> Any:
    try:
        raw = fileio.read_capped(path, MAX_INDEX, "a shard index", "the file is damaged or not an index")
        return json.loads(raw)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpoint(f"{path}: unreadable JSON ({type(e).__name__})", path=str(path)) from None


def _read_index(path: Location) -> tuple[dict[str, str], dict[str, str]]:
    idx = _read_json(path)
    wm = idx.get("weight_map") if isinstance(idx, dict) else None
    if not isinstance(wm, dict) or not all(
        isinstance(v, str) and v and "/" not in v and "\\" not in v and v not in (".", "..")
        for v in wm.values()
    ):
        raise CorruptCheckpoint(f"{path}: index has no valid weight_map", path=str(path))
    md = idx.get("metadata", {})  # absent is fine; null or [] would break transformers' loader
    if not isinstance(md, dict):
        raise CorruptCheckpoint(
            f"{path}: index metadata is {type(md).__name__}, not an object", path=str(path)
        )
    total = md.get("total_size")  # absent is fine; present, it is a byte count (null too is damage)
    if "total_size" in md and (type(total) is not int or total < 0):  # noqa: E721 - bool is not a size
        raise CorruptCheckpoint(
            f"{path}: index metadata.total_size is {total!r:.40}, not a byte count", path=str(path)
        )
    tied = md.get(_flat.TIED_KEY) or {}
    return dict(wm), _flat.tied_map(tied, f"metadata.{_flat.TIED_KEY}", path)


def _read_folder(path: Location, trust_pickle: bool) -> Checkpoint:
    layout = _folder_layout(path)
    if layout is None:
        raise CorruptCheckpoint(
            f"{path}: no model.safetensors, pytorch_model.bin or index in this folder", path=str(path)
        )
    kind, file = layout
    weight_map: dict[str, str] | None = None
    tied: dict[str, str] = {}
    files = [file]
    if kind == "index":
        weight_map, tied = _read_index(file)
        files = [path / f for f in sorted(set(weight_map.values()))]  # shard order = original order
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ShardMismatch(
                f"{file}: shard files listed in the index are missing: {', '.join(missing)}", path=str(file)
            )
    tied_files = dict.fromkeys(tied, str(file))
    stored_aliases: dict[str, str] = {}
    entries: list[TensorEntry] = []
    for f in files:
        if f.suffix == ".safetensors":
            es, t, _ = file_entries(f)
        else:
            es, t, _ = torch_file.file_entries(f, trust_pickle=trust_pickle)
        entries += es
        tied.update(t)
        tied_files.update(dict.fromkeys(t, str(f)))
        if f.suffix != ".safetensors":  # a .bin's aliases are keys of the file (shared storage)
            stored_aliases.update(dict.fromkeys(t, f.name))
    extra: dict[str, Any] = {}
    if weight_map is not None:
        _check_index(file, weight_map, entries, tied, stored_aliases)
        extra["index"] = str(file)
    meta = CheckpointMeta(
        format=NAME,
        path=str(path),
        tied=tied,
        tied_files=tied_files,
        files=tuple(str(f) for f in files),
        extra=extra,
    )
    return Checkpoint(meta, entries)


def _check_index(
    file: Location,
    weight_map: dict[str, str],
    entries: list[TensorEntry],
    tied: Mapping[str, str],
    stored_aliases: Mapping[str, str],
) -> None:
    """The index and the shards agree both ways: every listed tensor is in its shard, every tensor a shard
    stores (a ``.bin``'s tied aliases included) is listed. A tied alias no shard stores (safetensors keeps
    one copy) may be listed anywhere; one a ``.bin`` stores must be listed under that shard (fuzz seed
    331/86: the index moved a stored alias to another shard and ``verify`` passed it)."""
    where = {e.key: Path(e.pieces[0].file).name if e.pieces else weight_map.get(e.key, "") for e in entries}
    where.update({k: f for k, f in stored_aliases.items() if k not in where})
    bad = [k for k, f in weight_map.items() if where.get(k) != f and (k in where or k not in tied)]
    if bad:
        raise ShardMismatch(
            f"{file}: {len(bad)} tensors listed in the index are not in their shard, e.g. {bad[0]!r:.80} "
            f"(expected in {weight_map[bad[0]]})",
            hint="the index and the shard files come from different saves",
            path=str(file),
        )
    unlisted = [k for k in where if k not in weight_map]
    if unlisted:
        raise ShardMismatch(
            f"{file}: {len(unlisted)} tensors of the shards are not in the index, e.g. {unlisted[0]!r:.80}",
            hint="the index and the shard files come from different saves",
            path=str(file),
        )


def _file_metadata(items: Sequence[WriteItem], tied: Mapping[str, str]) -> dict[str, str]:
    names = {it.name for it in items}
    md = {"format": "pt"}
    mine = {a: o for a, o in tied.items() if o in names}
    if mine:
        md[_flat.TIED_KEY] = json.dumps(mine, sort_keys=True)
    roles = _flat.roles_json((it.name, it.role) for it in items)
    if roles:
        md[_flat.ROLES_KEY] = roles
    return md


class SafetensorsWriter(ModelWriter):
    kind = "safetensors"
    suffixes = (".safetensors",)
    base_name = SAFETENSORS

    def write_into(
        self, folder: Path, base: str, items: Sequence[WriteItem], opts: ModelWriteOptions
    ) -> list[str]:
        def one(p: Path, shard: list[WriteItem]) -> object:
            md = _file_metadata(shard, opts.tied)
            return safetensors.write_file(p, shard, metadata=md, on_bytes=opts.on_bytes, workers=opts.workers)

        index_md = {_flat.TIED_KEY: dict(opts.tied)} if opts.tied else None
        return write_sharded(
            folder, base, items, opts.max_shard_size, one, index_metadata=index_md, part=opts.part
        )


def write_safetensors(
    out: str | Location,
    items: Sequence[WriteItem],
    *,
    tied: Mapping[str, str] | None = None,
    max_shard_size: int | None = None,
    overwrite: bool = False,
    on_bytes: Callable[[int], None] | None = None,
    workers: int | None = None,
) -> list[Path] | list[RemotePath]:
    """Write tensors to ``out`` (a ``.safetensors`` file, or a folder for the HF layout), atomically.

    Args:
        out: a file name ending in ``.safetensors``, or a folder (gets ``model.safetensors``, sharded
            with an index when ``max_shard_size`` splits it).
        items: what to write (see ``zckpt.stream.items.items_from_state_dict``).
        tied: ``{alias: owner}``; owners are stored once and aliases recorded in the metadata.

    Returns:
        The final paths written (tensor files, sidecars, index).
    """
    out = location(out)
    is_dir = out.suffix != ".safetensors"
    base = SAFETENSORS if is_dir else out.name
    from zckpt.storage.staging import open_staging  # the write path: reading needs none

    with open_staging(
        out, is_dir=is_dir, overwrite=overwrite, owns=family(HF_WEIGHT_BASES), order=PUBLISH_ORDER
    ) as st:
        st.expect(planned_names(base, items, max_shard_size))
        opts = ModelWriteOptions(dict(tied or {}), max_shard_size, on_bytes, workers)
        SafetensorsWriter().write_into(st.dir, base, items, opts)
        return st.commit()


def verify_index(p: Location) -> list[Problem]:
    """Shard files on disk that the index does not list (stale from a save with another shard count), and
    indexes whose shard names disagree with each other."""
    if not p.is_dir():
        return []
    out = []
    indexes = ordered(p.glob("*.index.json"))
    listed: set[str] = set()
    readable = True
    for idx in indexes:
        try:
            wm, _ = _read_index(idx)
        except CorruptCheckpoint:
            readable = False  # the reader reports an unreadable index
            continue
        names = set(wm.values())
        listed |= names
        counts = {m["n"] for f in names if (m := _SHARD_RE.match(f))}
        if len(counts) > 1:
            out.append(Problem(str(idx), f"index mixes shard counts {sorted(counts)}", "inconsistent"))
        have = {f for f in names if _SHARD_RE.match(f)}
        for n in counts:
            if len(have) != int(n):
                out.append(
                    Problem(
                        str(idx),
                        f"index lists {len(have)} shard files, their names say {int(n)}",
                        "inconsistent",
                    )
                )
    if indexes and readable:  # with an index unreadable, every shard would look unlisted
        for f in ordered(p.iterdir()):
            if _SHARD_RE.match(f.name) and not f.name.endswith(SIDECARS) and f.name not in listed:
                why = "shard file not listed in the index (stale from another save?)"
                out.append(Problem(str(f), why, "stale", "move it away"))
    return out


class HfFormat(Format):
    """A ``.safetensors`` file or an HF model folder."""

    name = NAME

    @property
    def model_writer(self) -> ModelWriter:
        return SafetensorsWriter()

    def detect(self, path: Location) -> bool:
        if path.is_file():
            return path.suffix == ".safetensors"
        return path.is_dir() and _folder_layout(path) is not None

    def read(self, path: Location, *, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
        if path.is_dir():
            return _read_folder(path, trust_pickle)
        entries, tied, md = file_entries(path)
        return Checkpoint(
            CheckpointMeta(
                format=NAME,
                path=str(path),
                tied=tied,
                tied_files=dict.fromkeys(tied, str(path)),
                files=(str(path),),
                extra={"metadata": md},
            ),
            entries,
        )

    def verify(self, path: Location, ckpt: Checkpoint | None, ctx: VerifyContext) -> list[Problem]:
        return verify_index(path)


FORMAT = HfFormat()
