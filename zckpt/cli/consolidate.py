"""``zckpt consolidate CKPT OUT``: write one loadable model (safetensors or .bin) from a checkpoint.

Under ``torchrun`` (``WORLD_SIZE`` > 1) the ranks split the output shards between them (gloo group from
``env://``; see ``zckpt.ops.consolidate``); only rank 0 prints the result.
"""

from __future__ import annotations

import enum
import os
from typing import Annotated, Any

import typer

from zckpt.cli._options import (
    INPUTS,
    PICKLES,
    CkptArg,
    JsonOpt,
    OutArg,
    OverwriteOpt,
    ProgressOpt,
    StorageOpt,
    TagOpt,
    TrustPickleOpt,
    VerifyDataOpt,
)
from zckpt.cli._output import Output, human_bytes

NAME = "consolidate"
EPILOG = f"""--dtype auto writes floating parameters in the run's training precision (DeepSpeed bf16/fp16 ->
that dtype), else in their own dtype; buffers keep their stored dtype (as DeepSpeed's save_16bit_model).
An explicit --dtype casts every floating tensor, buffers included (torch's module.to(dtype)); torch's and
HF's names work too (bfloat16, float32, torch.float16). --keep-fp32 keeps matching tensors in fp32
whatever --dtype says.

Without --format, OUT's suffix decides; a folder gets safetensors in the HF layout (shards and an
index with --max-shard-size, plus the model's config files). --workers reader threads overlap reads
and casts with writes. Under torchrun the ranks split the output shards between them.

{INPUTS}

{PICKLES}

Examples:

\b
  zckpt consolidate out/ model.safetensors
  zckpt consolidate out/ hf-model/ --dtype bf16 --max-shard-size 5GB
  zckpt consolidate out/ model.bin --keep-fp32 '*norm*' --exclude-frozen
"""


class Format(str, enum.Enum):
    safetensors = "safetensors"
    bin = "bin"


DtypeOpt = Annotated[  # a string: zckpt.model.parse_output_dtype reads torch's and HF's names too
    str,
    typer.Option("--dtype", metavar="[auto|fp32|bf16|fp16]", help="Dtype of floating tensors (see below)."),
]
KeepFp32Opt = Annotated[
    list[str] | None,
    typer.Option("--keep-fp32", metavar="GLOB", help="Keep tensors matching GLOB in fp32 (repeatable).",
                 show_default=False),
]  # fmt: skip
MaxShardOpt = Annotated[
    str | None,
    typer.Option("--max-shard-size", metavar="SIZE", help="Split into shards of at most SIZE (e.g. 5GB)."),
]
FormatOpt = Annotated[
    Format | None,
    typer.Option("--format", metavar="[safetensors|bin]", help="Output format (default: from OUT)."),
]
WorkersOpt = Annotated[
    int | None,
    typer.Option("--workers", min=1, show_default=False, metavar="N",
                 help="Reader threads (default: the usable cores, at most 8; one for an s3:// input)."),
]  # fmt: skip
ExcludeFrozenOpt = Annotated[
    bool, typer.Option("--exclude-frozen", help="Leave out frozen (requires_grad=False) params.")
]


def command(
    ckpt: CkptArg,
    out: OutArg,
    dtype: DtypeOpt = "auto",
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
    """Consolidate a checkpoint into one loadable model.

    Writes safetensors or .bin, as one file or an HF folder. Streams tensor by tensor: trainable
    parameters come from the fp32 masters; tied weights are stored once in safetensors and recorded
    as aliases.
    """
    from zckpt.ops import group as dist
    from zckpt.ops.consolidate import consolidate

    distributed = dist.env_world() > 1
    res = consolidate(
        ckpt,
        out,
        dtype=dtype,
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
        distributed=distributed,
    )
    if distributed and int(os.environ.get("RANK", "0")) != 0:
        return
    o = Output(json=json)
    o.result(res.to_json())
    dts = ", ".join(f"{n} {d}" for d, n in res.dtypes.items())
    n = f"{res.tensors} tensor{'s' * (res.tensors != 1)}"
    o.text(f"wrote {n} ({human_bytes(res.bytes)}; {dts}) to {res.out}")
    for f in res.files:
        o.text(f"  {f}")
    if res.tied:
        o.text("tied: " + ", ".join(f"{a} -> {w}" for a, w in res.tied.items()))
    if res.kept:
        o.text("kept (not written by zckpt): " + ", ".join(res.kept))


def needs_torch(options: dict[str, Any]) -> bool:
    """Only where the job builds torch objects: a torch file output (``.bin``, ``--format bin``), pickled
    globals built as they are (``--trust-pickle``), ranks under torchrun (a ``torch.distributed`` group).
    Otherwise tensors are read, cast (``zckpt.stream.cast``) and written as bytes; an input that needs torch
    after all (ZeRO-0's value matching) imports it where it does."""
    fmt, out = options.get("format"), str(options.get("out") or "")
    to_bin = fmt is not None and getattr(fmt, "value", fmt) == "bin"
    from zckpt.formats.torch_file import SUFFIXES  # the outputs written in torch's pickle format
    from zckpt.ops.group import env_world

    return to_bin or out.endswith(SUFFIXES) or bool(options.get("trust_pickle")) or env_world() > 1
