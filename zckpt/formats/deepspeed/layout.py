"""Pure layout math of the DeepSpeed writer: ZeRO-1/2 group slices, ZeRO-3 sub-groups (DeepSpeed's
rules, ../shared/docs/deepspeed-format.md §2–§4), and the batch-size arithmetic of a new world size."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from zckpt import partition


@dataclass(frozen=True)
class Zero12Rank:
    """One rank's slice of one ZeRO-1/2 flat group."""

    partition_size: int  # padded slice length (same on every rank)
    valid: int  # slice length without the trailing group padding
    runs: tuple[tuple[int, int, int, int], ...]  # (param index, offset in param, offset in slice, length)

    @property
    def padding(self) -> int:
        return self.partition_size - self.valid


def zero12_layout(numels: list[int], world: int) -> list[Zero12Rank]:
    """Per-rank slices of a flat group of params with ``numels`` at ``world`` (alignment ``2*world``)."""
    total = sum(numels)
    part = partition.group_partition_size(total, world)
    runs: list[list[tuple[int, int, int, int]]] = [[] for _ in range(world)]
    off = 0
    for k, n in enumerate(numels):
        for o in partition.overlaps(off, n, part, world):
            runs[o.rank].append((k, o.offset_in_segment, o.offset_in_partition, o.length))
        off += n
    return [Zero12Rank(part, max(0, min(part, total - r * part)), tuple(runs[r])) for r in range(world)]


def zero3_sub_groups(numels: list[int], world: int, sub_group_size: int | None) -> list[list[int]]:
    """DeepSpeed's ``_create_fp16_sub_groups``: indices of each sub-group of one param group."""
    sizes = [partition.chunk_size(n, world) for n in numels]
    if not numels:
        return []
    if sub_group_size is None or sub_group_size >= sum(sizes):
        return [list(range(len(numels)))]
    out: list[list[int]] = []
    cur: list[int] = []
    acc = 0
    for k, s in enumerate(sizes):
        cur.append(k)
        acc += s
        if acc >= sub_group_size or k == len(sizes) - 1:
            out.append(cur)
            cur, acc = [], 0
    return out


_BATCH_NOTES = ("ds_config: train_micro_batch_size_per_gpu ", "global batch ")


def is_batch_note(note: str) -> bool:
    """``note`` is one of ``adjust_batch``'s (an HF Trainer output says the same in its own note)."""
    return note.startswith(_BATCH_NOTES)


def adjust_batch(cfg: dict[str, Any], old_world: int, new_world: int) -> tuple[dict[str, Any], str | None]:
    """``ds_config`` for the new world: keep the global batch (``train_batch_size``) and
    ``gradient_accumulation_steps``, recompute the micro batch when it divides; otherwise keep the micro
    batch and let the global batch change. The returned note says what changed (None: nothing)."""
    cfg = copy.deepcopy(cfg)
    micro = cfg.get("train_micro_batch_size_per_gpu")
    gas = int(cfg.get("gradient_accumulation_steps") or 1)
    tbs = cfg.get("train_batch_size")
    if tbs is None and micro is not None:
        tbs = int(micro) * gas * old_world
    if tbs is None:
        return cfg, None
    note = None
    if int(tbs) % (gas * new_world) == 0:
        new_micro = int(tbs) // (gas * new_world)
        if micro is not None and not (isinstance(micro, (int, float)) and micro == new_micro):
            note = (
                f"ds_config: train_micro_batch_size_per_gpu {micro} -> {new_micro} keeps the global batch "
                f"{tbs} ({new_micro} x gradient_accumulation_steps {gas} x world {new_world})"
            )
    else:
        new_micro = int(micro) if micro is not None else max(1, int(tbs) // (gas * old_world))
        new_tbs = new_micro * gas * new_world
        note = (
            f"global batch {tbs} is not divisible by gradient_accumulation_steps {gas} x world {new_world}; "
            f"kept micro batch {new_micro}, global batch becomes {new_tbs}"
        )
        tbs = new_tbs
    if "train_micro_batch_size_per_gpu" in cfg or "train_batch_size" not in cfg:
        cfg["train_micro_batch_size_per_gpu"] = new_micro
    if "train_batch_size" in cfg:
        cfg["train_batch_size"] = int(tbs)
    return cfg, note
