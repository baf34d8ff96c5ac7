"""``zckpt diff A B``: compare two checkpoints tensor by tensor; exit 0 equal, 1 different, 2 error.
``--plot FILE`` also draws the result; ``zckpt diff --series RUN_DIR`` diffs a run's consecutive checkpoints
(exit 0: a series is a report, not a verdict)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer

from zckpt.cli._options import (
    INPUTS,
    PICKLES,
    JsonOpt,
    PlotOpt,
    ProgressOpt,
    StorageOpt,
    TrustPickleOpt,
    VerifyDataOpt,
    check_plot,
)
from zckpt.cli._output import Output
from zckpt.errors import ZckptError

NAME = "diff"
EXIT_DIFFERENT = 1
EPILOG = f"""Reports keys only in A or B, shape and dtype mismatches, and per tensor the max abs and max
rel difference, relative L2 ||A-B||/||B||, cosine similarity, fraction changed and NaN/Inf counts.
Values are compared in float64 (integers exactly). A tensor differs when |a-b| > atol + rtol*|b|
anywhere; B is the reference of every relative figure.

--dtype picks the dtype values are compared at. auto (default): a tensor stored in two float dtypes
is compared at the narrower one (bf16 against fp16: at B's), the other side cast to it as
consolidate casts, so a checkpoint and its 16-bit export are EQUAL (said as "A cast to bfloat16 as
stored in B"); full: every tensor as stored, every rounding difference shows; fp32, bf16, fp16:
every float tensor cast to it first.
A dtype mismatch is not a difference of its own unless --strict-dtype.

--plot FILE draws layer x role heatmaps of ||A-B||/||B|| and cosine, with the most-changed tensors.
--series RUN_DIR diffs each consecutive pair of the checkpoints in RUN_DIR instead (global_stepN,
checkpoint-N, step-N; by step; one pair open at a time); --plot then draws layer x step.

Exit status: 0 equal within tolerance, 1 different, 2 error; with --series, 0 (a report, not a
verdict).

{INPUTS.replace("CKPT is", "A and B are each")}

{PICKLES}

Examples:

\b
  zckpt diff out/ model.safetensors
  zckpt diff out/ model.safetensors --dtype full --atol 1e-6
  zckpt diff A B --keys 'layers.0.*' --map module.= --top 10
  zckpt diff --series out/ --plot series.png
"""

SideAArg = Annotated[
    Path | None,
    typer.Argument(readable=False, metavar="A", help="Checkpoint A (folder or file).", show_default=False),
]
SideBArg = Annotated[
    Path | None,
    typer.Argument(
        readable=False, metavar="B", help="Checkpoint B, the reference for --rtol.", show_default=False
    ),
]
SeriesOpt = Annotated[
    Path | None,
    typer.Option("--series", metavar="RUN_DIR", show_default=False, readable=False,
                 help="Instead of A B: diff a run's consecutive checkpoints."),
]  # fmt: skip
PLOT_TOP = 20
AtolOpt = Annotated[float, typer.Option("--atol", min=0.0, metavar="ATOL", help="Absolute tolerance.")]
RtolOpt = Annotated[
    float, typer.Option("--rtol", min=0.0, metavar="RTOL", help="Relative tolerance (B is the reference).")
]
OptimOpt = Annotated[
    bool,
    typer.Option("--include-optimizer", help="Also compare optimizer states (if both have them)."),
]
KeysOpt = Annotated[
    list[str] | None,
    typer.Option("--keys", metavar="GLOB", help="Only compare keys matching GLOB (repeatable).",
                 show_default=False),
]  # fmt: skip
MapOpt = Annotated[
    list[str] | None,
    typer.Option("--map", help="Rename A's key prefix OLD to NEW (repeatable; 'module.=' strips it).",
                 show_default=False, metavar="OLD=NEW"),
]  # fmt: skip
TopOpt = Annotated[
    int | None,
    typer.Option(
        "--top", min=0, metavar="K", help="Show the K most-changed tensors (default: differing, max 20)."
    ),
]
StrictDtypeOpt = Annotated[
    bool,
    typer.Option("--strict-dtype", help="Count a dtype mismatch as a difference, even where values agree."),
]
CompareDtypeOpt = Annotated[
    str,
    typer.Option("--dtype", metavar="auto|full|fp32|bf16|fp16",
                 help="Dtype to compare at: auto (two dtypes: the narrower), full (as stored), or one."),
]  # fmt: skip
IgnoreDtypeOpt = Annotated[
    bool,
    typer.Option("--ignore-dtype", hidden=True, help="The default now (kept for old scripts); no effect."),
]
TagAOpt = Annotated[
    str | None, typer.Option("--tag-a", metavar="TAG", help="Tag of A to read instead of `latest`.")
]
TagBOpt = Annotated[
    str | None, typer.Option("--tag-b", metavar="TAG", help="Tag of B to read instead of `latest`.")
]


def command(
    a: SideAArg = None,
    b: SideBArg = None,
    atol: AtolOpt = 0.0,
    rtol: RtolOpt = 0.0,
    include_optimizer: OptimOpt = False,
    keys: KeysOpt = None,
    map: MapOpt = None,
    top: TopOpt = None,
    strict_dtype: StrictDtypeOpt = False,
    dtype: CompareDtypeOpt = "auto",
    ignore_dtype: IgnoreDtypeOpt = False,
    tag_a: TagAOpt = None,
    tag_b: TagBOpt = None,
    json: JsonOpt = False,
    trust_pickle: TrustPickleOpt = False,
    progress: ProgressOpt = True,
    verify_data: VerifyDataOpt = True,
    plot: PlotOpt = None,
    series: SeriesOpt = None,
    storage_option: StorageOpt = None,
) -> None:
    """Compare two checkpoints of any formats, tensor by tensor.

    Streamed chunk by chunk, in bounded memory for any tensor size.
    """
    from zckpt.ops.diff import diff

    check_plot(plot, preload=series is not None)  # the series figure is matplotlib's; diff's is not
    if series is not None:
        if a is not None or b is not None:
            raise ZckptError("--series RUN_DIR compares the run's own checkpoints: give no A B with it")
        _series(series, plot, keys, json, progress, trust_pickle, verify_data)
        return
    if a is None or b is None:
        raise ZckptError("diff needs two checkpoints A B", hint="or --series RUN_DIR for a run's checkpoints")
    r = diff(
        a,
        b,
        atol=atol,
        rtol=rtol,
        include_optimizer=include_optimizer,
        keys=keys or None,
        map=tuple(map or ()),
        top=top if json and plot is None else None,
        strict_dtype=strict_dtype and not ignore_dtype,
        compare_dtype=dtype,
        tag_a=tag_a,
        tag_b=tag_b,
        progress=progress and not json,
        trust_pickle=trust_pickle,
        verify_data=verify_data,
    )
    if plot is not None:
        r.plot(plot, top=PLOT_TOP if top is None else top)
    out = Output(json=json)
    cut = r if top is None or not json else dataclasses.replace(r, tensors=r.tensors[:top], top=top)
    out.result(cut.to_json())
    out.text(r.to_text(top=top))
    if plot is not None:
        out.text(f"plot: {plot}")
    if not r.equal:
        raise typer.Exit(EXIT_DIFFERENT)


def _series(
    run: Path,
    plot: Path | None,
    keys: list[str] | None,
    json: bool,
    progress: bool,
    trust: bool,
    verify: bool,
) -> None:
    from zckpt.ops.series import diff_series

    s = diff_series(run, keys=keys or None, progress=progress and not json, trust_pickle=trust,
                    verify_data=verify)  # fmt: skip
    if plot is not None:
        s.plot(plot)
    out = Output(json=json)
    out.result(s.to_json())
    out.text(s.to_text())
    if plot is not None:
        out.text(f"plot: {plot}")


def needs_torch(options: dict[str, Any]) -> bool:
    """Only for ``--series`` and ``--trust-pickle`` (they build tensors): ``zckpt.ops.diff`` compares pairs
    whose bytes lie in files as stored in numpy (``zckpt.ops.diff_numpy``: safetensors, DeepSpeed, DCP,
    Trainer and native inputs), and imports torch mid-command for any other pair."""
    return options.get("series") is not None or bool(options.get("trust_pickle"))
