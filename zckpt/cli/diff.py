"""``zckpt diff A B``: compare two checkpoints tensor by tensor; exit 0 equal, 1 different, 2 error."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from zckpt.cli._options import JsonOpt, ProgressOpt, TrustPickleOpt, VerifyDataOpt
from zckpt.cli._output import Output

NAME = "diff"
EXIT_DIFFERENT = 1

SideArg = Annotated[
    Path,
    typer.Argument(
        readable=False, help="A checkpoint of any supported format (folder or file).", show_default=False
    ),
]
AtolOpt = Annotated[
    float, typer.Option("--atol", min=0.0, help="Absolute tolerance: |a-b| <= atol + rtol*|b|.")
]
RtolOpt = Annotated[float, typer.Option("--rtol", min=0.0, help="Relative tolerance (B is the reference).")]
OptimOpt = Annotated[
    bool,
    typer.Option("--include-optimizer", help="Also compare optimizer states when both sides have them."),
]
KeysOpt = Annotated[
    list[str] | None,
    typer.Option("--keys", help="Only compare keys matching this glob (repeatable), e.g. 'layers.0.*'.",
                 show_default=False),
]  # fmt: skip
MapOpt = Annotated[
    list[str] | None,
    typer.Option("--map", help="Rename A's key prefix OLD to NEW before matching (repeatable); "
                 "'module.=' strips `module.`.", show_default=False, metavar="OLD=NEW"),
]  # fmt: skip
TopOpt = Annotated[
    int | None,
    typer.Option(
        "--top", min=0, help="Show the K most-changed tensors (default: the differing ones, max 20)."
    ),
]
StrictDtypeOpt = Annotated[
    bool,
    typer.Option("--strict-dtype", help="Count dtype-only differences (same values stored in another dtype, "
                 "e.g. bf16 vs fp32) as differences; by default they are reported but values decide."),
]  # fmt: skip
IgnoreDtypeOpt = Annotated[
    bool,
    typer.Option("--ignore-dtype", hidden=True, help="The default now (kept for old scripts); no effect."),
]
TagAOpt = Annotated[str | None, typer.Option("--tag-a", help="Tag of checkpoint A (instead of `latest`).")]
TagBOpt = Annotated[str | None, typer.Option("--tag-b", help="Tag of checkpoint B (instead of `latest`).")]


def command(
    a: SideArg,
    b: SideArg,
    atol: AtolOpt = 0.0,
    rtol: RtolOpt = 0.0,
    include_optimizer: OptimOpt = False,
    keys: KeysOpt = None,
    map: MapOpt = None,
    top: TopOpt = None,
    strict_dtype: StrictDtypeOpt = False,
    ignore_dtype: IgnoreDtypeOpt = False,
    tag_a: TagAOpt = None,
    tag_b: TagBOpt = None,
    json: JsonOpt = False,
    trust_pickle: TrustPickleOpt = False,
    progress: ProgressOpt = True,
    verify_data: VerifyDataOpt = True,
) -> None:
    """Compare two checkpoints of any formats, tensor by tensor (streamed, bounded memory).

    Reports keys only in A or B, shape and dtype mismatches, and per tensor max abs / max rel
    difference, relative L2, cosine similarity, fraction changed and NaN/Inf counts, compared in
    float64 after exact upcasting (integers exactly), so the same values stored in bf16 and in fp32 are
    equal unless --strict-dtype. Exit status: 0 equal within tolerance, 1 different, 2 error.
    """
    from zckpt.ops.diff import diff

    r = diff(
        a,
        b,
        atol=atol,
        rtol=rtol,
        include_optimizer=include_optimizer,
        keys=keys or None,
        map=tuple(map or ()),
        top=top if json else None,
        strict_dtype=strict_dtype and not ignore_dtype,
        tag_a=tag_a,
        tag_b=tag_b,
        progress=progress and not json,
        trust_pickle=trust_pickle,
        verify_data=verify_data,
    )
    out = Output(json=json)
    out.result(r.to_json())
    out.text(r.to_text(top=top))
    if not r.equal:
        raise typer.Exit(EXIT_DIFFERENT)
