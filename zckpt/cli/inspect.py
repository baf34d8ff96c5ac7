"""``zckpt inspect CKPT``: what a checkpoint holds, without reading tensor data."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from zckpt.cli._options import (
    INPUTS,
    PICKLES,
    CkptArg,
    JsonOpt,
    PlotOpt,
    StorageOpt,
    TagOpt,
    TrustPickleOpt,
    check_plot,
)
from zckpt.cli._output import Output, human_bytes

NAME = "inspect"
EPILOG = f"""Prints the format, ZeRO stage, world size, precision, tensors by role, one row per tensor,
tied and frozen parameters and the optimizer's states. --stats reads every tensor (min, max, mean,
std, norm, NaN and Inf counts); --plot FILE draws stored bytes by rank x kind and parameters per
layer.

{INPUTS}

{PICKLES}
"""
StatsOpt = Annotated[bool, typer.Option("--stats", help="Also read every tensor for value statistics.")]


def command(
    ckpt: CkptArg,
    tag: TagOpt = None,
    json: JsonOpt = False,
    trust_pickle: TrustPickleOpt = False,
    stats: StatsOpt = False,
    all_: Annotated[
        bool, typer.Option("--all", help="List optimizer-state tensors too, one row each.")
    ] = False,
    plot: PlotOpt = None,
    storage_option: StorageOpt = None,
) -> None:
    """Show what a checkpoint holds.

    Reads its metadata only: no tensor data unless --stats.
    """
    from zckpt.ops.inspect import inspect

    check_plot(plot)
    r = inspect(ckpt, tag=tag, trust_pickle=trust_pickle, stats=stats)
    if plot is not None:
        r.plot(plot)
    out = Output(json=json)
    out.result(r.to_json())
    opt = None
    if r.optimizer:
        groups = f", {r.param_groups} param groups" if r.param_groups else ""
        opt = f"{r.optimizer}{groups}: {', '.join(r.optimizer_states) or '-'}"
    out.fields([
        ("path", r.path),
        ("format", r.format),
        ("stage", r.stage),
        ("world size", r.world_size),
        ("precision", r.precision),
        ("tag", r.tag),
        ("step", r.step),
        ("files", r.files),
        ("params", f"{r.params:,}"),
        ("optimizer", opt),
    ])  # fmt: skip
    out.text()
    out.table(
        ["role", "tensors", "elements", "bytes"],
        [(role, t.count, f"{t.numel:,}", human_bytes(t.nbytes)) for role, t in r.by_role.items()],
        right=(1, 2, 3),
    )
    out.text()
    rows = [t for t in r.tensors if all_ or t.role != "optim"]
    out.table(
        ["name", "shape", "dtype", "role", "pieces"],
        [(t.key, "x".join(map(str, t.shape)) or "scalar", t.dtype, t.role, t.pieces) for t in rows],
        right=(4,),
    )
    if len(rows) < len(r.tensors):
        out.text(f"({len(r.tensors) - len(rows)} optimizer-state tensors not listed: --all lists them)")
    if r.tied:
        out.text()
        out.text("tied: " + ", ".join(f"{a} -> {o}" for a, o in r.tied.items()))
    if r.frozen:
        out.text("frozen: " + ", ".join(r.frozen))
    if r.values:
        out.text()
        out.table(["value", "content"], sorted(r.values.items()))
    if r.stats is not None:
        out.text()
        out.table(
            ["name", "min", "max", "mean", "std", "norm", "nan", "inf"],
            [(s.key, *(_g(v) for v in (s.min, s.max, s.mean, s.std, s.norm)), s.nan, s.inf) for s in r.stats],
            right=(1, 2, 3, 4, 5, 6, 7),
        )
    if plot is not None:
        out.text()
        out.text(f"plot: {plot}")


def _g(v: float | int | None) -> str:
    return "-" if v is None else (str(v) if isinstance(v, int) else f"{v:.4g}")


def needs_torch(options: dict[str, Any]) -> bool:
    """Only for ``--stats --trust-pickle`` (tensors built from pickles): what a checkpoint holds is in its
    metadata, and ``--stats`` reads tensors stored as file bytes in numpy (``zckpt.ops.stats``; torch is
    imported mid-command for any other tensor)."""
    return bool(options.get("stats")) and bool(options.get("trust_pickle"))
