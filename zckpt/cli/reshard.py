"""``zckpt reshard [SRC [DST]] --world N``: rewrite a sharded checkpoint for another world size.

Run bare inside a run's checkpoint folder (``zckpt reshard --world 8``): SRC is ``.`` and DST the
sibling folder ``<folder>-world8`` (from inside a tag folder, the save folder's sibling); the source and
its save folder are never written to. Under ``torchrun`` (``WORLD_SIZE`` > 1)
the processes split the rank files between them (see ``zckpt.ops.reshard``); only rank 0 prints the result.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from zckpt.cli._options import (
    PICKLES,
    JsonOpt,
    OverwriteOpt,
    ProgressOpt,
    StorageOpt,
    TagOpt,
    TrustPickleOpt,
    VerifyDataOpt,
)
from zckpt.cli._output import Output, human_bytes

NAME = "reshard"
EPILOG = f"""Rewrites the masters, every optimizer state, frozen params, buffers, ties, scheduler, loss
scaler, counters, client state and RNG. The output is a complete folder (`latest` + tag) that the
trainer loads at the new world size as is: native (this package's engine) or DeepSpeed ZeRO-1/2/3
(DeepSpeed's own load_checkpoint, no universal conversion). --to dcp writes a torch DCP folder
(torchtitan layout) that dcp.load + set_state_dict load into FSDP2 at any world size.

SRC is a checkpoint folder (holding `latest`) or tag folder, native or DeepSpeed, or a torch DCP
folder (holding .metadata); default: the current folder. DST must not be inside SRC; default: the
sibling folder <SRC>-world<N> (from inside a tag folder, the save folder's sibling).

An HF Trainer checkpoint-N folder comes out complete: every other file copied, RNG files mapped to
the new ranks; the notes say what changed, e.g. the per-device batch to resume with. Streamed tensor
by tensor into a temporary folder, renamed at the end. Under torchrun the processes split the rank
files between them.

{PICKLES}

Examples:

\b
  zckpt reshard out/ out8/ --world 8
  zckpt reshard ds-run/ dcp-ckpt/ --world 8 --to dcp
  cd out && zckpt reshard --world 8
"""


class Target(str, enum.Enum):
    native = "native"
    deepspeed = "deepspeed"
    dcp = "dcp"


SrcArg = Annotated[
    Path,
    typer.Argument(readable=False, metavar="SRC", help="Checkpoint folder (see below)."),
]
DstArg = Annotated[
    Path | None,
    typer.Argument(
        readable=False, metavar="DST", help="Output folder (default: <SRC>-world<N>).", show_default=False
    ),
]
WorldOpt = Annotated[
    int, typer.Option("--world", "-w", min=1, metavar="N", help="New data-parallel world size.")
]
ToOpt = Annotated[
    Target | None,
    typer.Option("--to", metavar="[native|deepspeed|dcp]", help="Output format (default: the source's)."),
]
StageOpt = Annotated[
    int | None,
    typer.Option(
        "--stage", min=0, max=3, metavar="STAGE", help="ZeRO stage of the output (default: the source's)."
    ),
]


def command(
    world: WorldOpt,
    src: SrcArg = Path("."),
    dst: DstArg = None,
    tag: TagOpt = None,
    to: ToOpt = None,
    stage: StageOpt = None,
    overwrite: OverwriteOpt = False,
    trust_pickle: TrustPickleOpt = False,
    progress: ProgressOpt = True,
    verify_data: VerifyDataOpt = True,
    json: JsonOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Rewrite a sharded checkpoint for another world size.

    Optimizer states, scheduler, RNG and client state included; see below.
    """
    from zckpt.ops import group as dist
    from zckpt.ops.reshard import reshard

    distributed = dist.env_world() > 1
    res = reshard(
        src,
        dst,
        world=world,
        tag=tag,
        to=to.value if to else None,
        stage=stage,
        overwrite=overwrite,
        progress=progress and not json,
        trust_pickle=trust_pickle,
        distributed=distributed,
        verify_data=verify_data,
    )
    if distributed and int(os.environ.get("RANK", "0")) != 0:
        return
    o = Output(json=json)
    o.result(dataclasses.asdict(res))
    zero = f" ZeRO-{res.stage}" if res.stage is not None else ""
    tag = f", tag {res.tag}" if res.tag is not None else ""
    files = f"{len(res.files)} file{'s' * (len(res.files) != 1)}"
    o.text(
        f"{res.src} ({res.src_format}, world {res.src_world}) -> {res.dst} ({res.dst_format}{zero}, world "
        f"{res.world}{tag}): {files}, {human_bytes(res.bytes_written)} "
        f"in {res.seconds:.1f}s"
    )
    for n in res.notes:
        o.text(f"note: {n}")


def needs_torch(options: dict[str, Any]) -> bool:
    """Always: it builds tensors."""
    return True
