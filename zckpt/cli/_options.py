"""Command-line parameters shared by several commands, defined once as ``Annotated`` aliases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

CkptArg = Annotated[
    Path,
    typer.Argument(
        readable=False, metavar="CKPT", help="Checkpoint folder or file (see below).", show_default=False
    ),
]
OutArg = Annotated[
    Path,
    typer.Argument(
        readable=False,
        metavar="OUT",
        help="NAME.safetensors, NAME.bin, or a folder (HF layout).",
        show_default=False,
    ),
]
TagOpt = Annotated[
    str | None,
    typer.Option("--tag", metavar="TAG", help="Tag to read (e.g. global_step100) instead of `latest`."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
TrustPickleOpt = Annotated[
    bool,
    typer.Option("--trust-pickle", help="Unpickle any class (runs code: only files you made)."),
]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace the output if it exists.")]
ProgressOpt = Annotated[
    bool, typer.Option("--progress/--no-progress", help="Show a progress bar (on a terminal).")
]
VerifyDataOpt = Annotated[
    bool,
    typer.Option(
        "--verify-data/--no-verify-data",
        help="Check the input's zip CRC-32s as it is read; damaged data is an error.",
    ),
]
PlotOpt = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        help="Also draw it: FILE.png, .svg or .html. Needs pip install 'zckpt[plot]'.",
        metavar="FILE",
        show_default=False,
        readable=False,
    ),
]

INPUTS = (
    "CKPT is a DeepSpeed folder (holding `latest`) or tag folder, a torch DCP folder (holding .metadata; "
    "torchtitan's step-N parent, accelerate's pair), a .safetensors, .bin or .pt file, or an HF model "
    "folder."
)
"""The epilog paragraph naming what a ``CKPT`` argument may be (shared by the commands that take one)."""
PICKLES = (
    "Pickles load only allowlisted classes; --trust-pickle lets them load any class, which runs code from "
    "the file."
)
"""The epilog paragraph saying what --trust-pickle allows."""


def check_plot(path: Path | None, *, preload: bool = False) -> None:
    """Refuse a bad ``--plot`` before any work (suffix, folder, matplotlib installed); with ``preload``
    import matplotlib on a thread while the command works."""
    if path is None:
        return
    from zckpt.ops.plots.files import check
    from zckpt.ops.plots.files import preload as start

    check(path)
    if preload:
        start()


StorageOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--storage-option",
        help="Option of the s3:// client (repeatable), e.g. endpoint=URL, region=NAME, in_flight=16; "
        "the AWS_* environment is read without it.",
        metavar="KEY=VALUE",
        show_default=False,
    ),
]
