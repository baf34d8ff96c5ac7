"""ZeRO-1/2 (and BF16_Optimizer) layouts: each param group is one flat fp32 vector, padded to a multiple
of ``2 * world`` and cut into ``world`` equal slices, so a param may straddle ranks
(../shared/docs/deepspeed-format.md §4). Our placement is cross-checked against DeepSpeed's own
``param_slice_mappings`` of every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zckpt import partition
from zckpt.codecs.pickle_safe import TensorRef
from zckpt.errors import ShardMismatch
from zckpt.formats._schema import Node
from zckpt.formats.deepspeed.common import Layout, Run, fp32_flats


@dataclass(frozen=True)
class Partitioned:
    """Where every trainable param's fp32 master sits in the per-rank flat tensors."""

    layout: Layout
    flats: list[list[TensorRef]]
    sizes: list[list[int]]
    """Padded length of each rank's flat tensor per slot (what a flat optimizer state must match)."""
    groups: list[dict[str, Any]]
    """Per group (or ZeRO-3 sub-group): its params and partition sizes, for ``inspect``."""


def _placed(
    shapes: Node, apad: list[int], max_numel: int
) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int]:
    """(name, shape, numel, offset in the flat group) of each param, alignment padding skipped; and the
    group's length. A shape of more than ``max_numel`` elements (all the group holds) is refused naming the
    model file that records it."""
    out, offset = [], 0
    for k, (name, shp) in enumerate(shapes.items()):
        shape = shp.as_shape(max_numel)
        n = math.prod(shape)
        out.append((name, shape, n, offset))
        offset += n + (apad[k] if k < len(apad) else 0)
    return out, offset


def _alignment(osd: Node, g: int) -> list[int]:
    align = osd.get("param_alignment_paddings")
    groups = list(align) if align is not None else []
    if g >= len(groups) or groups[g].value is None:
        return []
    return [n.as_int(lo=0) for n in groups[g]]


def zero12(osds: list[Node], param_shapes: list[Node], ws: int, padded: bool) -> Partitioned:
    """``padded``: BF16_Optimizer keeps the group padding inside each rank's fp32 slice."""
    lay = Layout()
    flats = fp32_flats(osds, "single_partition_of_fp32_groups", param_shapes, "fp32 partition of group")
    groups: list[dict[str, Any]] = []
    sizes: list[list[int]] = [[0] * len(param_shapes) for _ in range(ws)]
    for g, shapes in enumerate(param_shapes):
        apad = _alignment(osds[0], g)
        gpads = [_group_padding(osd, g) for osd in osds]
        lens = [flats[r][g].numel for r in range(ws)]
        psizes = {lens[r] + (0 if padded else gpads[r]) for r in range(ws)}
        if len(psizes) != 1:
            raise ShardMismatch(
                f"{osds[-1].file}: param group {g}: rank partitions disagree in size (fp32 "
                f"lengths {lens}, paddings {gpads})",
                hint="a rank file is stale from another run",
                path=osds[-1].file,
            )
        part = psizes.pop()
        available = sum(lens) - (sum(gpads) if padded else 0)
        placed, n_g = _placed(shapes, apad, max(available, 0))
        if n_g != available or ws * part - n_g != sum(gpads):
            raise ShardMismatch(  # either file may be the odd one: both named, as ZeRO-3 does
                f"{osds[0].file}: param group {g} holds {available} fp32 elements across {ws} ranks "
                f"(padding {gpads}) but param_shapes of {Path(shapes.file).name} need {n_g}",
                hint="model and optimizer files come from different runs, or one of them was altered",
                path=osds[0].file,
            )
        for name, shape, n, off in placed:
            lay.shapes[name], lay.slot_of[name] = shape, g
            lay.runs[name] = [
                Run(o.rank, g, o.offset_in_partition, o.offset_in_segment, o.length)
                for o in partition.overlaps(off, n, part, ws)
            ]
        names = [p[0] for p in placed]
        for r in range(ws):
            sizes[r][g] = part
            _check_runs(osds[r], g, lay, names, r, lens[r])
            _check_slices(osds[r], g, lay, names, r, param_shapes[g].file)
        groups.append(
            {
                "params": names,
                "numel": n_g,
                "partition_size": part,
                "group_paddings": gpads,
                "param_alignment_paddings": apad,
            }
        )
    return Partitioned(lay, flats, sizes, groups)


def _group_padding(osd: Node, g: int) -> int:
    pads = osd.get("group_paddings")
    if pads is None:
        return 0
    items = list(pads)
    if g >= len(items):
        raise pads.fail(f"a padding for param group {g}")
    return items[g].as_int(lo=0)


def _check_runs(osd: Node, g: int, lay: Layout, names: list[str], r: int, held: int) -> None:
    for name in names:
        for run in lay.runs[name]:
            if run.rank == r and run.offset + run.numel > held:
                raise ShardMismatch(
                    f"{osd.file}: {name} needs elements up to {run.offset + run.numel} of group "
                    f"{g} but the partition holds {held}",
                    path=osd.file,
                )


def _check_slices(osd: Node, g: int, lay: Layout, names: list[str], r: int, shapes_file: str) -> None:
    """Cross-check our math against DeepSpeed's own ``param_slice_mappings`` of rank ``r``, group ``g``:
    they are different on every rank, so a file in another rank's place is caught here too."""
    maps = osd.get("param_slice_mappings")
    if maps is None or g >= len(maps.as_list()):
        return
    ours = {n: (run.offset, run.numel) for n in names for run in lay.runs[n] if run.rank == r}
    theirs = {}
    for n, a in list(maps)[g].items():
        start, numel = getattr(a.value, "start", None), getattr(a.value, "numel", None)
        if not isinstance(start, int) or not isinstance(numel, int):
            raise a.fail("a fragment_address with int start and numel")
        if numel:
            theirs[n] = (start, numel)
    if ours != theirs:
        bad = sorted(set(ours.items()) ^ set(theirs.items()))[:2]
        raise ShardMismatch(
            f"{osd.file}: group {g}: param_slice_mappings disagree with param_shapes of "
            f"{Path(shapes_file).name} ({bad}) for rank {r}",
            hint="model and optimizer files come from different runs, or rank files were swapped",
            path=osd.file,
        )
