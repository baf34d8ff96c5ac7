"""The ZeRO-3 layout: every param cut on its own into ``ceil(n / world)`` chunks, each rank's chunks
concatenated per sub-group into one flat fp32 tensor (``fp32_flat_groups``); frozen params are chunked the
same way into each rank's ``frozen_param_fragments`` (../shared/docs/deepspeed-format.md §4).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from zckpt import dtypes, partition
from zckpt.errors import ShardMismatch
from zckpt.formats._schema import Node
from zckpt.formats.deepspeed.common import Layout, Run, fp32_flats, ref
from zckpt.formats.deepspeed.zero12 import Partitioned
from zckpt.model import Piece, Role, TensorEntry


def zero3(osds: list[Node], param_shapes: list[Node], ws: int) -> Partitioned:
    lay = Layout()
    flats = fp32_flats(osds, "fp32_flat_groups", param_shapes, "fp32 sub-group")
    subs: list[dict[str, Any]] = []
    for s, shapes in enumerate(param_shapes):
        off = 0
        for name, shp in shapes.items():
            shape = shp.as_shape()
            n = math.prod(shape)
            c = partition.chunk_size(n, ws)
            lay.shapes[name], lay.slot_of[name] = shape, s
            lay.runs[name] = []
            for r in range(ws):
                start, valid = partition.chunk_range(n, ws, r)
                if valid:
                    lay.runs[name].append(Run(r, s, off, start, valid, c - valid))
            off += c
        for r in range(ws):
            held = flats[r][s].numel
            if held != off:
                hint = (
                    "ZeRO-3 NVMe offload keeps the masters in offloaded_tensors/"
                    if held == 0
                    else "model and optimizer files come from different runs"
                )
                raise ShardMismatch(
                    f"{osds[r].file}: sub-group {s} holds {held} fp32 elements but param_shapes of "
                    f"{Path(param_shapes[s].file).name} need {off} per rank (world size {ws})",
                    hint=hint,
                    path=osds[r].file,
                )
        subs.append({"params": [name for name, _ in shapes.items()], "partition_numel": off})
    sizes = [[int(sub["partition_numel"]) for sub in subs] for _ in range(ws)]
    return Partitioned(lay, flats, sizes, subs)


def frozen3(models: list[Node], ws: int) -> list[TensorEntry]:
    """Frozen params: each rank's ``frozen_param_fragments`` chunk, in the 16-bit training dtype."""
    out: list[TensorEntry] = []
    shapes = models[0].get("frozen_param_shapes")
    if shapes is None:
        return out
    for name, shp in shapes.items():
        shape = shp.as_shape()
        n = math.prod(shape)
        c = partition.chunk_size(n, ws)
        pieces = []
        for r in range(ws):
            frag = ref(models[r]["frozen_param_fragments"][name])
            if frag.numel != c:
                raise ShardMismatch(
                    f"{models[r].file}: frozen fragment {name} has {frag.numel} elements, "
                    f"expected {c} (numel {n} over {ws} ranks)",
                    path=models[r].file,
                )
            start, valid = partition.chunk_range(n, ws, r)
            if valid:
                pieces.append(
                    Piece(
                        frag.file, frag.byte_offset, frag.dtype, start, valid, r, c - valid, check=frag.check
                    )
                )
        dtype = pieces[0].dtype if pieces else dtypes.float16
        out.append(TensorEntry(name, shape, dtype, Role.FROZEN, tuple(pieces)))
    return out
