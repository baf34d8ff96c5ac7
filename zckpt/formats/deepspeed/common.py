"""What the DeepSpeed readers of every ZeRO layout share: loading a rank file (through the schema, with its
archive name checked against its file name), tensor references, and the flat-partition ``Layout`` that
places each trainable parameter in the per-rank flat fp32 vectors, with the entries built from it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zckpt import dtypes
from zckpt.codecs.pickle_safe import TensorRef
from zckpt.codecs.torchzip import load_archive
from zckpt.errors import CorruptCheckpoint, ShardMismatch, Unsupported
from zckpt.formats._schema import Node
from zckpt.model import Piece, Role, TensorEntry
from zckpt.storage import fileio
from zckpt.storage.location import Location
from zckpt.storage.threads import Pool

MAX_WORLD = 1 << 20
"""Largest partition count a file may claim (a bound for hostile input)."""
DS_KEYS = frozenset(
    [
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "csr_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "universal_checkpoint_info",
        "ds_config",
        "ds_version",
        "ds_autoep_layers",
        "autoep_layers",
    ]
)
"""Model-states keys DeepSpeed writes itself; anything else at the top level is client_state."""
_RANK_NAME = re.compile(r"^(?:bf16_|fp16_)?(?:zero_pp_rank_\d+_)?mp_rank_\d+_(?:model|optim)_?states$")


def load(path: Location, trust: bool) -> Node:
    """A rank file's top-level dict. ``torch.save`` names the archive after the file it saved to: an archive
    named like another rank file means the file was renamed or swapped."""
    name, obj = load_archive(str(path), trust_pickle=trust)
    if _RANK_NAME.match(name) and name != path.stem:
        raise ShardMismatch(
            f"{path}: was saved as {name}.pt (renamed, or swapped with another rank's file)",
            hint="put each rank's file back under its own name",
            path=str(path),
        )
    node = Node(obj, str(path))
    node.as_dict()
    return node


def load_all(paths: list[Location], trust: bool) -> list[Callable[[], Node]]:
    """``load`` of each file, as a call that returns it (or raises its error) when the caller asks, in any
    order: the caller asks only for the files it needs. Local files load on that call; files in an object
    store start loading side by side now (their zip directories, pickles and record headers are round trips
    to the store)."""
    if not paths or not fileio.is_remote(str(paths[0])):
        return [functools.partial(load, p, trust) for p in paths]
    fileio.will_open([str(p) for p in paths])
    pool = Pool(min(len(paths), 8), thread_name_prefix="zckpt-open")
    futures = [pool.submit(load, p, trust) for p in paths]
    pool.shutdown(wait=False)
    return [f.result for f in futures]


def ref(node: Node) -> TensorRef:
    """The tensor at ``node`` (contiguous, as DeepSpeed stores every partition)."""
    r: TensorRef = node.of_type(TensorRef, "a tensor")
    if not r.is_contiguous:
        raise Unsupported(f"{node.file}: {node.where} is stored non-contiguous", path=node.file)
    return r


def whole(name: str, r: TensorRef, role: Role, shape: tuple[int, ...] | None = None) -> TensorEntry:
    """An entry of all of ``r``'s elements in ``shape`` (default: its own)."""
    shape = tuple(r.shape) if shape is None else shape
    n = 1
    for d in shape:
        n *= d
    if n != r.numel:
        raise ShardMismatch(
            f"{r.file}: {name} holds {r.numel} elements but its recorded shape {list(shape)} needs {n}",
            hint="files from different runs are mixed",
            path=r.file,
        )
    return TensorEntry(
        name, shape, r.dtype, role, (Piece(r.file, r.byte_offset, r.dtype, 0, r.numel, 0, check=r.check),)
    )


def is_scalar(v: Any) -> bool:
    if isinstance(v, TensorRef):
        return len(v.shape) == 0
    if isinstance(v, int) and not isinstance(v, bool):
        return -(1 << 63) <= v < (1 << 63)  # a tensor can hold it
    return isinstance(v, float)


def scalar_entry(name: str, state: str, v: Any, rank: int) -> TensorEntry:
    """A 0-d optimizer state (``step``): a 0-d tensor in the file, or a Python number in the pickle."""
    if isinstance(v, TensorRef):
        p = Piece(v.file, v.byte_offset, v.dtype, 0, 1, rank, check=v.check)
        return TensorEntry(name, (), v.dtype, Role.OPTIM, (p,), state)
    dtype = dtypes.bool_ if isinstance(v, bool) else dtypes.int64 if isinstance(v, int) else dtypes.float32
    p = Piece("", 0, dtype, 0, 1, rank, value=v)  # torch.tensor(v)'s dtype, built when read
    return TensorEntry(name, (), dtype, Role.OPTIM, (p,), state, pytype=type(v).__name__)


@dataclass(frozen=True)
class Run:
    """Part of a param in one rank's flat tensor ``slot``: ``numel`` elements at ``offset`` there, which are
    the param's flattened elements ``[start, start + numel)``, followed by ``padding`` unused ones."""

    rank: int
    slot: int
    offset: int
    start: int
    numel: int
    padding: int = 0


@dataclass
class Layout:
    """Where each trainable param lives in the per-rank flat vectors; ``slot`` is the flat tensor index
    (ZeRO-1/2 param group or ZeRO-3 sub-group) in each rank's list."""

    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    slot_of: dict[str, int] = field(default_factory=dict)
    runs: dict[str, list[Run]] = field(default_factory=dict)

    def entries(
        self, flats: list[list[TensorRef]], role: Role, state: str | None, names: list[str] | None = None
    ) -> list[TensorEntry]:
        """One entry per param (``names``: these only), its pieces pointing into ``flats[rank][slot]``."""
        out = []
        for name in self.shapes if names is None else names:
            pieces = []
            dtype = dtypes.float32
            for run in self.runs[name]:
                r = flats[run.rank][run.slot]
                dtype = r.dtype
                pieces.append(
                    Piece(
                        r.file,
                        r.byte_offset + run.offset * r.dtype.itemsize,
                        r.dtype,
                        run.start,
                        run.numel,
                        run.rank,
                        run.padding,
                        check=r.check,
                    )
                )
            out.append(TensorEntry(name, self.shapes[name], dtype, role, tuple(pieces), state))
        return out


def fp32_flats(osds: list[Node], key: str, param_shapes: list[Node], what: str) -> list[list[TensorRef]]:
    """Each rank's list of flat fp32 tensors under ``key`` (one per group or sub-group of ``param_shapes``,
    the model file's), counts checked."""
    flats: list[list[TensorRef]] = []
    groups = len(param_shapes)
    model = Path(param_shapes[0].file).name if param_shapes else "the model file"
    for osd in osds:
        parts = list(osd[key])
        if len(parts) != groups:  # either file may be the odd one: both named
            raise ShardMismatch(
                f"{osd.file}: {len(parts)} flat fp32 tensors in {key} but param_shapes of {model} lists "
                f"{groups} groups",
                hint="model and optimizer files come from different runs, or one of them was altered",
                path=osd.file,
            )
        flats.append([ref(t) for t in parts])
        for g, t in enumerate(flats[-1]):
            if t.dtype != dtypes.float32 or len(t.shape) != 1:
                raise ShardMismatch(
                    f"{osd.file}: {what} {g} is {list(t.shape)} {t.dtype}, expected flat fp32", path=osd.file
                )
    return flats


def optim_entries(
    lay: Layout, states: list[dict[int, Node]], sizes: list[list[int]]
) -> tuple[list[TensorEntry], list[str]]:
    """Per-param OPTIM entries from per-rank ``{slot: state node}``. A flat state (1-D, the rank's padded
    slot length ``sizes[r][slot]``) is cut like the fp32 partition; a scalar (``step``: 0-d tensor or Python
    number) becomes a shape-() entry per param pointing at it."""
    names: list[str] = []
    for per in states:
        for st in per.values():
            names += [k for k, _ in st.items() if k not in names]
    out: list[TensorEntry] = []
    for s in names:
        flats: list[list[Any]] = [[None] * len(sz) for sz in sizes]
        scalars: dict[tuple[int, int], Any] = {}
        for r, per in enumerate(states):
            for slot, st in per.items():
                v = st.get(s)
                if v is None:
                    continue
                val = v.value
                if (
                    isinstance(val, TensorRef)
                    and len(val.shape) == 1
                    and slot < len(sizes[r])
                    and val.numel == sizes[r][slot]
                ):
                    flats[r][slot] = ref(v)
                elif is_scalar(val):
                    scalars[(r, slot)] = val
                else:
                    raise ShardMismatch(
                        f"{v.file}: {v.where} is neither a flat partition of group {slot} "
                        f"({sizes[r][slot] if slot < len(sizes[r]) else '?'} elements) nor a scalar",
                        hint="model and optimizer files come from different runs, or the file was altered",
                        path=v.file,
                    )
        _same_kind_everywhere(s, states, flats, scalars)
        for name in lay.shapes:
            runs, slot = lay.runs[name], lay.slot_of[name]
            r0 = runs[0].rank if runs else 0
            if any(f[slot] is not None for f in flats):
                _held_by_all(s, slot, [run.rank for run in runs], flats, states)
                out += lay.entries(flats, Role.OPTIM, s, [name])
            elif (r0, slot) in scalars:
                out.append(scalar_entry(name, s, scalars[(r0, slot)], r0))
    return out, names


def _held_by_all(
    s: str, slot: int, ranks: list[int], flats: list[list[Any]], states: list[dict[int, Node]]
) -> None:
    """Every rank of ``ranks`` (those holding a param of group ``slot``) keeps state ``s`` as a flat
    partition, or the file at odds is named: the ranks without it when they are fewer, the ranks with it
    when those are (a renamed state), and one of each on a tie (two ranks: either may be the altered one)."""
    ranks = list(dict.fromkeys(ranks))
    lost = [r for r in ranks if flats[r][slot] is None]
    if not lost:
        return
    kept = [r for r in ranks if r not in lost]
    if len(kept) < len(lost):
        f = _file_of(states, kept[0])
        msg = f"{f}: holds optimizer state {s!r:.40} for group {slot}, which the other ranks do not keep"
    else:
        f = _file_of(states, lost[0])
        beside = _file_of(states, kept[0]).rsplit("/", 1)[-1]  # in the same folder
        others = "the other ranks keep" if len(kept) > len(lost) else f"{beside} keeps"
        msg = f"{f}: holds no optimizer state {s!r:.40} for group {slot}, which {others} as a flat partition"
    raise ShardMismatch(msg, hint="files of different runs are mixed, or the file was altered", path=f)


def _file_of(states: list[dict[int, Node]], rank: int) -> str:
    return next((st.file for st in states[rank].values()), f"rank {rank}'s optimizer file")


def _same_kind_everywhere(
    s: str, states: list[dict[int, Node]], flats: list[list[Any]], scalars: dict[tuple[int, int], Any]
) -> None:
    """One state of one group is a flat partition on every rank or a scalar on every rank: a scalar where
    the other ranks hold elements (a partition replaced by a number) would drop or misplace them."""
    for r, slot in scalars:
        other = next((q for q, f in enumerate(flats) if slot < len(f) and f[slot] is not None), None)
        if other is not None:
            raise ShardMismatch(
                f"{_file_of(states, r)}: optimizer state {s!r:.40} of group {slot} is a scalar here but "
                f"a flat partition in {Path(_file_of(states, other)).name}",
                hint="files of different runs are mixed, or the file was altered",
                path=_file_of(states, r),
            )


def tied_from_module(module: Node, skip: set[str]) -> dict[str, str]:
    """Old files / ZeRO-0 have no ``shared_params``: aliases share storage, offset, shape and stride."""
    seen: dict[tuple[Any, ...], str] = {}
    tied = {}
    for name, t in module.items():
        v = t.value
        if not isinstance(v, TensorRef) or name in skip or v.numel == 0:
            continue
        k = (v.storage.key, v.offset, v.shape, v.stride)
        if k in seen:
            tied[name] = seen[k]
        else:
            seen[k] = name
    return tied


def check_ties_declared(m0: Node, module: Node, tied: dict[str, str], buffers: list[str]) -> None:
    """Module tensors that share one storage (same offset, shape and stride) are one tied weight, and a file
    that has ``shared_params`` must tie them there (DeepSpeed lists every param sharing another's data): else
    the alias would be written as a weight of its own, its tie lost. Buffers are not params: left alone."""

    def root(name: str) -> str:
        for _ in range(len(tied) + 1):  # a chain of aliases ends at the param holding the data
            if name not in tied:
                return name
            name = tied[name]
        return name

    for alias, source in tied_from_module(module, set(buffers)).items():
        if root(alias) != root(source):
            raise CorruptCheckpoint(
                f"{m0.file}: module tensors {source!r:.80} and {alias!r:.80} share one storage, but "
                "`shared_params` does not tie them",
                hint="the file was altered or is damaged",
                path=m0.file,
            )
