"""Reading the native format: find the tag folder, parse the manifest, cross-check it with every rank
file's safetensors header, and build the entries and the ``TrainingState``.

Every tensor is partitioned on its own: partitioned keys (``param/``, ``frozen/``, partitioned
``optim/``) become one ``Piece`` per rank ``r < partition_world`` with the padding excluded; buffers,
client tensors and replicated optimizer states are read from rank 0's file. Nothing is trusted that two
files could contradict: each rank file must hold exactly the keys the manifest implies, with the
shapes and dtypes it implies, and have the size the manifest records. Nothing here unpickles anything.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from zckpt.checkpoint import Checkpoint
from zckpt.codecs import safetensors
from zckpt.codecs.safetensors import Header, HeaderEntry
from zckpt.dtypes import DType
from zckpt.errors import CorruptCheckpoint, ShardMismatch
from zckpt.formats._latest import read_latest, valid_tag
from zckpt.formats.native import layout as L
from zckpt.formats.native import record
from zckpt.model import Checked, Piece, Role, TensorEntry, parse_dtype
from zckpt.partition import chunk_range, chunk_size
from zckpt.state import CheckpointMeta, Counters, OptimizerState, ParamGroup, RankRng, TrainingState
from zckpt.storage import fileio
from zckpt.storage.location import Location, absolute, location
from zckpt.storage.location import size as size_of

MAX_MANIFEST = 256 << 20


def is_tag_dir(p: Location) -> bool:
    """A folder with our ``manifest.json``: its format field says so, or rank 0's file lies beside it (a
    damaged or unreadable manifest is then reported by ``read``, not taken for a foreign folder)."""
    m = p / L.MANIFEST
    if (m.is_symlink() or m.exists()) and (p / L.rank_file(0)).is_file():
        return True
    try:
        with fileio.open_regular(m) as f:
            head = f.read(4096)
    except (OSError, CorruptCheckpoint):
        return False
    return f'"format": "{L.FORMAT_ID}"'.encode() in head


def detect(path: Location) -> bool:
    """A folder whose ``latest`` names a tag folder with our manifest, or such a tag folder itself."""
    if not path.is_dir():
        return False
    if is_tag_dir(path):
        return True
    try:
        tag = read_latest(path)
    except CorruptCheckpoint:
        return False
    return tag is not None and is_tag_dir(path / tag)


def resolve(path: Location, tag: str | None = None) -> tuple[Location | None, Location]:
    """(save folder or None, tag folder) for ``path`` (a save folder with ``latest``, or a tag folder)."""
    path = absolute(path)  # "." names its folder: a tag's save dir is its real parent
    if tag is not None:
        if not valid_tag(tag):
            raise CorruptCheckpoint(f"--tag {tag!r:.80} is not a folder name", path=str(path))
        if is_tag_dir(path) and path.name == tag:
            return path.parent, path
        return path, path / tag
    if is_tag_dir(path):
        return (path.parent if (path.parent / "latest").exists() else None), path
    latest = read_latest(path)
    if latest is None:
        raise CorruptCheckpoint(
            f"{path}: no `latest` file and no {L.MANIFEST}", hint="pass --tag", path=str(path)
        )
    return path, path / latest


def load_manifest(tag_dir: Location) -> L.Manifest:
    f = tag_dir / L.MANIFEST
    with fileio.open_regular(f) as fh:
        raw = fh.read(MAX_MANIFEST + 1)
    if len(raw) > MAX_MANIFEST:
        raise CorruptCheckpoint(f"{f}: larger than {MAX_MANIFEST >> 20} MiB; not a manifest", path=str(f))
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpoint(
            f"{f}: not valid JSON ({type(e).__name__})",
            path=str(f),
            hint="the save did not finish, or the file was damaged",
        ) from None
    return L.Manifest.from_json(doc, str(f))


def _headers(td: Location, man: L.Manifest) -> list[Header]:
    out = []
    for r in range(man.world_size):
        name = man.rank_file(r)
        f = td / name
        if not f.is_file():
            raise ShardMismatch(f"{f}: missing (world size {man.world_size})", path=str(f))
        if name not in man.files:
            raise ShardMismatch(f"{td / L.MANIFEST}: lists no {name}", path=str(td / L.MANIFEST))
        want = man.files[name][1]
        if size_of(f) != want:
            raise ShardMismatch(
                f"{f}: {size_of(f)} bytes, the manifest says {want} (truncated or another save)",
                path=str(f),
            )
        out.append(safetensors.read_header(f))
    extra = sorted(set(man.files) - {man.rank_file(r) for r in range(man.world_size)})
    if extra:
        raise ShardMismatch(
            f"{td / L.MANIFEST}: lists {extra[0]} beyond world size {man.world_size}",
            path=str(td / L.MANIFEST),
        )
    return out


class _Files:
    """The rank files' headers, checked key by key against what the manifest implies."""

    def __init__(self, td: Location, man: L.Manifest) -> None:
        self.td, self.man = td, man
        self.headers = _headers(td, man)
        self.used: list[set[str]] = [set() for _ in self.headers]
        for r, h in enumerate(self.headers):
            crcs = man.crc32.get(man.rank_file(r), {})
            stray = sorted(set(crcs) - set(h.tensors))
            if stray:
                raise ShardMismatch(
                    f"{td / L.MANIFEST}: records a CRC-32 for {stray[0]!r:.80}, which {man.rank_file(r)} "
                    "does not hold",
                    hint="the manifest and the rank files come from different saves",
                    path=str(td / L.MANIFEST),
                )
            unchecked = sorted(set(h.tensors) - set(crcs))
            if unchecked and man.files[man.rank_file(r)][0].sha256 is None:
                raise CorruptCheckpoint(  # only version 1's whole-file sha256 can stand in for the CRCs
                    f"{td / L.MANIFEST}: records no CRC-32 for {unchecked[0]!r:.80} of {man.rank_file(r)}",
                    hint="the manifest was edited or damaged; restore it from a good copy",
                    path=str(td / L.MANIFEST),
                )

    def piece(
        self, r: int, key: str, e: HeaderEntry, dt: DType, start: int, n: int, padding: int = 0
    ) -> Piece:
        """Elements ``[start, start + n)`` stored at ``e`` of rank ``r``'s file; checked against the tensor's
        CRC-32 when the manifest records one, else (a manifest written before per-tensor CRCs) against the
        file's sha256 (reads inside ``zckpt.storage.checks.session`` verify either). A block-digest file
        records a CRC-32 for every tensor (``_Files`` refuses one without)."""
        name = self.man.rank_file(r)
        f = str(self.td / name)
        crc = self.man.crc32.get(name, {}).get(key)
        if crc is not None:
            check = Checked(f, e.begin, e.end - e.begin, crc, f"tensor {key!r:.80}")
        else:
            digest, size = self.man.files[name]
            check = Checked(f, 0, size, None, "the manifest's sha256 of the file", sha256=digest.sha256)
        return Piece(f, e.begin, dt, start, n, rank=r, padding=padding, check=check)

    def take(self, r: int, key: str, dtype: str, shape: tuple[int, ...]) -> HeaderEntry:
        f = self.td / self.man.rank_file(r)
        e = self.headers[r].tensors.get(key)
        if e is None:
            raise ShardMismatch(f"{f}: has no tensor {key!r:.100} that the manifest lists", path=str(f))
        if e.dtype != parse_dtype(dtype) or e.shape != shape:
            raise ShardMismatch(
                f"{f}: {key!r:.100} is {list(e.shape)} {e.dtype}, the manifest implies {list(shape)} {dtype}",
                hint="the manifest and the rank files come from different saves",
                path=str(f),
            )
        self.used[r].add(key)
        return e

    def pieces(self, key: str, dtype: str, shape: tuple[int, ...], partitioned: bool) -> tuple[Piece, ...]:
        n = math.prod(shape)
        dt = parse_dtype(dtype)
        if not partitioned:
            e = self.take(0, key, dtype, shape)
            for r in range(1, self.man.partition_world):  # replicated copies must agree in shape too
                if key in self.headers[r].tensors:
                    self.take(r, key, dtype, shape)
            return (self.piece(0, key, e, dt, 0, n),)
        pw = self.man.partition_world
        c = chunk_size(n, pw)
        out = []
        for r in range(pw):
            e = self.take(r, key, dtype, (c,))
            start, valid = chunk_range(n, pw, r)
            if valid > 0:
                out.append(self.piece(r, key, e, dt, start, valid, c - valid))
        return tuple(out)

    def optional(self, r: int, key: str) -> TensorEntry | None:
        e = self.headers[r].tensors.get(key)
        if e is None:
            return None
        self.used[r].add(key)
        return TensorEntry(key, e.shape, e.dtype, Role.BUFFER, (self.piece(r, key, e, e.dtype, 0, e.numel),))

    def check_all_used(self) -> None:
        for r, h in enumerate(self.headers):
            extra = sorted(set(h.tensors) - self.used[r])
            if extra:
                f = self.td / self.man.rank_file(r)
                raise ShardMismatch(
                    f"{f}: holds {extra[0]!r:.100}, which the manifest does not list",
                    hint="the manifest and the rank files come from different saves",
                    path=str(f),
                )


def _entries(files: _Files) -> list[TensorEntry]:
    man = files.man
    out: list[TensorEntry] = []
    for t in man.tensors:
        if t.role is not Role.BUFFER and not t.partitioned:
            raise CorruptCheckpoint(
                f"{files.td / L.MANIFEST}: {t.role.value} {t.name!r:.80} is not partitioned",
                path=str(files.td / L.MANIFEST),
            )
        pieces = files.pieces(L.tensor_key(t.role, t.name), t.dtype, t.shape, t.partitioned)
        out.append(TensorEntry(t.name, t.shape, parse_dtype(t.dtype), t.role, pieces))
    shapes = {t.name: t.shape for t in man.tensors}
    for o in man.optim_states:
        if o.partitioned and o.shape != shapes.get(o.param, o.shape):  # partitioned = shaped like its param
            raise CorruptCheckpoint(
                f"{files.td / L.MANIFEST}: optimizer state {o.state!r:.40} of {o.param!r:.80} is partitioned "
                f"with shape {list(o.shape)}, but the param's shape is {list(shapes[o.param])}",
                hint="the manifest was altered or is damaged",
                path=str(files.td / L.MANIFEST),
            )
        pieces = files.pieces(L.optim_key(o.state, o.param), o.dtype, o.shape, o.partitioned)
        out.append(
            TensorEntry(
                o.param, o.shape, parse_dtype(o.dtype), Role.OPTIM, pieces, state=o.state, pytype=o.python
            )
        )
    return out


def _client(o: Any, files: _Files) -> Any:
    """``client_state`` with every ``{"__tensor__": key}`` replaced by rank 0's tensor entry."""
    if isinstance(o, dict):
        if set(o) == {L.CLIENT_REF}:
            key = o[L.CLIENT_REF]
            e = files.optional(0, key) if isinstance(key, str) and key.startswith("client/") else None
            if e is None:
                raise ShardMismatch(
                    f"{files.td / files.man.rank_file(0)}: client_state names tensor {key!r:.80}, "
                    "which the file does not hold",
                    path=str(files.td / files.man.rank_file(0)),
                )
            return e
        return {k: _client(v, files) for k, v in o.items()}
    if isinstance(o, list):
        return [_client(v, files) for v in o]
    return o


def _state(files: _Files) -> TrainingState:
    man = files.man
    opt = man.optimizer
    optimizer = None
    if opt is not None:
        groups = tuple(
            ParamGroup(tuple(g["params"]), {k: v for k, v in g.items() if k != "params"})
            for g in opt["param_groups"]
        )
        optimizer = OptimizerState(str(opt["kind"]), groups, tuple(opt.get("state_names") or ()))
    rng = tuple(
        RankRng(
            st.get("python"),
            st.get("numpy"),
            {k: e for k in L.RNG_KEYS if (e := files.optional(r, L.rng_key(k))) is not None},
        )
        for r, st in enumerate(man.rng)
    )
    for r in range(len(man.rng), man.world_size):  # torch RNG tensors of ranks without JSON state
        for k in L.RNG_KEYS:
            files.optional(r, L.rng_key(k))
    c = man.counters
    return TrainingState(
        stage=man.stage,
        precision=man.precision,
        optimizer=optimizer,
        scheduler=man.scheduler,
        loss_scaler=man.loss_scaler if isinstance(man.loss_scaler, Mapping) else None,
        counters=Counters(
            c.get("global_steps"), c.get("global_samples"), c.get("skipped_steps"), c.get("micro_steps")
        ),
        client_state=_client(man.client_state, files) if isinstance(man.client_state, dict) else {},
        rng=rng,
        config=man.config if isinstance(man.config, Mapping) else None,
    )


def read(path: Location, *, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
    save_dir, td = resolve(location(path), tag)
    if not ((td / L.MANIFEST).is_symlink() or (td / L.MANIFEST).exists()):
        raise CorruptCheckpoint(
            f"{td}: no {L.MANIFEST} (an unfinished save, or not a tag folder)", path=str(td)
        )
    man = load_manifest(td)
    files = _Files(td, man)
    record.check(man, files.headers[0].metadata, str(td / L.MANIFEST), str(td / man.rank_file(0)))
    entries = _entries(files)
    state = _state(files)
    files.check_all_used()
    meta = CheckpointMeta(
        format="native",
        path=str(td),
        world_size=man.world_size,
        tag=man.tag,
        save_dir=str(save_dir) if save_dir is not None else None,
        tied=dict(man.tied),
        tied_files=dict.fromkeys(man.tied, str(td / L.MANIFEST)),
        files=tuple(str(td / man.rank_file(r)) for r in range(man.world_size)),
        state=state,
        extra={"version": man.version, "partition_world": man.partition_world},
    )
    return Checkpoint(meta, entries)
