"""Sharded outputs: HF-style shard planning and names (``model-00001-of-00003.safetensors``), the index
file, and size parsing (``5GB``)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zckpt.errors import InvalidArgument
from zckpt.storage.digest import SIDECAR_PATTERN

if TYPE_CHECKING:  # only annotations: sharding plans by sizes, torch is not needed
    from zckpt.stream.items import WriteItem

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(size: int | str) -> int:
    """A shard size in bytes, as transformers' ``max_shard_size`` reads it: an ``int`` is bytes; a string
    needs a unit, decimal (``5GB`` = 5e9, ``500MB``, ``300B``) or binary (``2GiB``).

    A string without a unit is refused (transformers' ``convert_file_size_to_int`` refuses ``"5"`` too):
    ``--max-shard-size 5`` is surely ``5GB`` mistyped, and taken as 5 bytes it would put every tensor in a
    shard of its own. Raises ``InvalidArgument`` (a ``ValueError``)."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise InvalidArgument(f"size must be an int (bytes) or a string like '5GB', got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size)
        if not m or m.group(2).upper() not in _UNITS:
            raise InvalidArgument(f"cannot read size {size!r}", hint="write it like 5GB, 500MB or 2GiB")
        if not m.group(2):
            raise InvalidArgument(
                f"size {size!r} has no unit",
                hint=f"write {m.group(1)}GB, {m.group(1)}MB, or {m.group(1)}B for bytes",
            )
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise InvalidArgument(f"size must be positive, got {size!r}")
    return value


def oversized(items: Sequence[WriteItem], max_shard_size: int | None) -> list[WriteItem]:
    """The tensors larger than ``max_shard_size``: each gets a shard of its own, over the limit."""
    return [] if max_shard_size is None else [it for it in items if it.nbytes > max_shard_size]


def plan_shards(items: Sequence[WriteItem], max_shard_size: int | None) -> list[list[WriteItem]]:
    """Greedy in-order split (as transformers does): a new shard starts when the next tensor would
    overflow the current one; a tensor larger than the limit gets a shard of its own."""
    if max_shard_size is None:
        return [list(items)]
    shards: list[list[WriteItem]] = [[]]
    size = 0
    for it in items:
        if shards[-1] and size + it.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    return shards


def planned_names(base: str, items: Sequence[WriteItem], max_shard_size: int | None) -> list[str]:
    """The tensor files (and index) a sharded write of ``items`` under ``base`` produces."""
    n = len(plan_shards(items, max_shard_size))
    return shard_names(base, n) + ([f"{base}.index.json"] if n > 1 else [])


def family(bases: Sequence[str]) -> Callable[[str], bool]:
    """Whether a file name belongs to the model files written under one of ``bases``: the base itself, its
    shards ``stem-0000k-of-0000n.suffix`` (any count), ``<base>.index.json``, and the sidecars of these
    (``zckpt.storage.digest.SIDECARS``). What ``--overwrite`` of an HF folder replaces, and nothing else
    (transformers' ``save_pretrained`` removes only stale shards of its own weights name the same way)."""
    alts = []
    for b in bases:
        stem, dot, suffix = b.partition(".")
        alts.append(rf"{re.escape(stem)}(?:-\d{{5}}-of-\d{{5}})?{re.escape(dot + suffix)}(?:\.index\.json)?")
    rx = re.compile(rf"^(?:{'|'.join(alts)}){SIDECAR_PATTERN}?$")
    return lambda name: rx.match(name) is not None


def shard_names(base: str, n: int) -> list[str]:
    """``model.safetensors`` -> ``model-00001-of-00003.safetensors`` ... (just ``base`` when n == 1)."""
    if n == 1:
        return [base]
    stem, dot, suffix = base.partition(".")
    return [f"{stem}-{k:05d}-of-{n:05d}{dot}{suffix}" for k in range(1, n + 1)]


def write_sharded(
    folder: Path,
    base: str,
    items: Sequence[WriteItem],
    max_shard_size: int | None,
    write_one: Callable[[Path, list[WriteItem]], object],
    *,
    index_metadata: Mapping[str, Any] | None = None,
    aliases: Mapping[str, str] | None = None,
    part: tuple[int, int] = (0, 1),
) -> list[str]:
    """Write ``base`` into ``folder``: one file, or HF-style shards plus ``<base>.index.json``; returns names.

    ``write_one(path, items)`` writes one file (format-specific); ``aliases`` are tied names listed in the
    index's ``weight_map`` beside their owner (the ``.bin`` convention; safetensors keeps them in metadata).
    ``part=(rank, world)`` writes only shards ``rank::world`` of the (deterministic) plan, and the index
    only on rank 0: ``world`` processes given the same items write the same files between them.
    """
    rank, world = part
    shards = plan_shards(items, max_shard_size)
    names = shard_names(base, len(shards))
    mine = [
        (name, shard) for k, (name, shard) in enumerate(zip(names, shards, strict=True)) if k % world == rank
    ]
    from zckpt.stream.pipeline import each_file  # the writing pipeline (torch): not needed to plan shards

    each_file(lambda job: write_one(folder / job[0], job[1]), mine)  # several shards at once on many cores
    written = [name for name, _ in mine]
    if len(shards) > 1 and rank == 0:
        where = {it.name: name for name, shard in zip(names, shards, strict=True) for it in shard}
        where.update({a: where[o] for a, o in (aliases or {}).items() if o in where})
        meta = {"total_size": sum(it.nbytes for it in items), **(index_metadata or {})}
        with open(folder / f"{base}.index.json", "x") as f:
            json.dump({"metadata": meta, "weight_map": where}, f, indent=2, sort_keys=True)
            f.write("\n")
        written.append(f"{base}.index.json")
    return written
