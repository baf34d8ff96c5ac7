"""``zckpt consolidate CKPT OUT``: write one loadable model (safetensors or .bin) from a checkpoint.

Under ``torchrun`` (``WORLD_SIZE`` > 1) the ranks split the output shards between them (gloo group from
``env://``; see ``zckpt.ops.consolidate``); only rank 0 prints the result.
"""

from __future__ import annotations

import enum
import os
from typing import Annotated

import typer

from zckpt.cli._options import (
    CkptArg,
    JsonOpt,
    OutArg,
    OverwriteOpt,
    ProgressOpt,
    StorageOpt,
    TagOpt,
    TrustPickleOpt,
    VerifyDataOpt,
    use_storage_options,
)
from zckpt.cli._output import Output, human_bytes

NAME = "consolidate"


class Dtype(str, enum.Enum):
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Format(str, enum.Enum):
    safetensors = "safetensors"
    bin = "bin"


DtypeOpt = Annotated[
    Dtype,
    typer.Option("--dtype", help="Output dtype of floating tensors; auto = the run's training precision "
                 "(DeepSpeed bf16/fp16 -> that dtype), else each tensor's own."),
]  # fmt: skip
KeepFp32Opt = Annotated[
    list[str] | None,
    typer.Option("--keep-fp32", help="Glob of tensor names kept in fp32 (repeatable), e.g. '*norm*'.",
                 show_default=False),
]  # fmt: skip
MaxShardOpt = Annotated[
    str | None,
    typer.Option("--max-shard-size", help="Split into shards of at most this size (e.g. 5GB) with an index."),
]
FormatOpt = Annotated[
    Format | None,
    typer.Option("--format", help="Output format; default from OUT's suffix (a folder gets safetensors)."),
]
WorkersOpt = Annotated[
    int | None,
    typer.Option("--workers", min=1, show_default=False,
                 help="Reader threads overlapping reads/casts with writes (default: cores - 1, 1 to 4)."),
]  # fmt: skip
ExcludeFrozenOpt = Annotated[
    bool, typer.Option("--exclude-frozen", help="Leave out frozen (requires_grad=False) parameters.")
]


def command(
    ckpt: CkptArg,
    out: OutArg,
    dtype: DtypeOpt = Dtype.auto,
    keep_fp32: KeepFp32Opt = None,
    max_shard_size: MaxShardOpt = None,
    tag: TagOpt = None,
    exclude_frozen: ExcludeFrozenOpt = False,
    format: FormatOpt = None,
    overwrite: OverwriteOpt = False,
    trust_pickle: TrustPickleOpt = False,
    progress: ProgressOpt = True,
    verify_data: VerifyDataOpt = True,
    json: JsonOpt = False,
    workers: WorkersOpt = None,
    storage_option: StorageOpt = None,
) -> None:
    """Write one loadable model (safetensors or .bin, file or HF folder) from a checkpoint.

    Streams tensor by tensor; trainable params come from the fp32 masters; tied weights are stored
    once in safetensors and recorded as aliases.
    """
    use_storage_options(storage_option)
    from zckpt.ops import group as dist
    from zckpt.ops.consolidate import consolidate

    distributed = dist.env_world() > 1
    res = consolidate(
        ckpt,
        out,
        dtype=dtype.value,
        keep_fp32=tuple(keep_fp32 or ()),
        max_shard_size=max_shard_size,
        tag=tag,
        exclude_frozen=exclude_frozen,
        format=format.value if format else None,
        overwrite=overwrite,
        progress=progress and not json,
        trust_pickle=trust_pickle,
        workers=workers,
        verify_data=verify_data,
        distributed=distributed or None,
    )
    if distributed and int(os.environ.get("RANK", "0")) != 0:
        return
    o = Output(json=json)
    o.result(res.to_json())
    dts = ", ".join(f"{n} {d}" for d, n in res.dtypes.items())
    o.text(f"wrote {res.tensors} tensors ({human_bytes(res.bytes)}; {dts}) to {res.out}")
    for f in res.files:
        o.text(f"  {f}")
    if res.tied:
        o.text("tied: " + ", ".join(f"{a} -> {w}" for a, w in res.tied.items()))
