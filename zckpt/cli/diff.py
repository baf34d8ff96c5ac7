"""``zckpt diff A B``: compare two checkpoints tensor by tensor; exit 0 equal, 1 different, 2 error.
``--plot FILE`` also draws the result; ``zckpt diff --series RUN_DIR`` diffs a run's consecutive checkpoints
(exit 0: a series is a report, not a verdict)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from zckpt.cli._options import (
    JsonOpt,
    PlotOpt,
    ProgressOpt,
    StorageOpt,
    TrustPickleOpt,
    VerifyDataOpt,
    check_plot,
    use_storage_options,
)
from zckpt.cli._output import Output
from zckpt.errors import ZckptError

NAME = "diff"
EXIT_DIFFERENT = 1

SideArg = Annotated[
    Path | None,
    typer.Argument(
        readable=False, help="A checkpoint of any supported format (folder or file).", show_default=False
    ),
]
SeriesOpt = Annotated[
    Path | None,
    typer.Option("--series", metavar="RUN_DIR", show_default=False, readable=False,
                 help="Instead of A B: diff each consecutive pair of the checkpoints in RUN_DIR "
                 "(global_stepN, checkpoint-N, step-N; by step), one pair open at a time; --plot draws "
                 "layer x step."),
]  # fmt: skip
PLOT_TOP = 20
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
    a: SideArg = None,
    b: SideArg = None,
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
    plot: PlotOpt = None,
    series: SeriesOpt = None,
    storage_option: StorageOpt = None,
) -> None:
    """Compare two checkpoints of any formats, tensor by tensor (streamed, bounded memory).

    Reports keys only in A or B, shape and dtype mismatches, and per tensor max abs / max rel
    difference, relative L2, cosine similarity, fraction changed and NaN/Inf counts, compared in
    float64 after exact upcasting (integers exactly), so the same values stored in bf16 and in fp32 are
    equal unless --strict-dtype. Exit status: 0 equal within tolerance, 1 different, 2 error.
    --plot FILE draws layer x role heatmaps of ||B-A||/||A|| and cosine with the top changed tensors.
    --series RUN_DIR diffs a run's consecutive checkpoints instead (exit 0).
    """
    use_storage_options(storage_option)
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
