"""``zckpt reshard SRC [DST] --world N``: the CLI face of ``zckpt.reshard``.

Run bare inside a run's checkpoint folder (``zckpt reshard --world 8``), SRC is ``.`` and DST the
sibling folder ``<folder>-world8``; the source is never written to.
"""

from __future__ import annotations

from pathlib import Path

import typer


def reshard_cmd(
    src: Path = typer.Argument(
        Path("."), help="checkpoint folder (holding `latest`) or tag folder; default ."
    ),
    dst: Path | None = typer.Argument(None, help="output checkpoint folder; default: sibling <src>-world<N>"),
    world: int = typer.Option(..., "--world", "-w", min=1, help="new data-parallel world size"),
    tag: str | None = typer.Option(None, "--tag", "-t", help="tag to read (default: `latest`)"),
    to: str | None = typer.Option(None, "--to", help="output format: native | deepspeed (default: source's)"),
    stage: int | None = typer.Option(None, "--stage", help="DeepSpeed ZeRO stage of the output (1, 2 or 3)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace DST if it exists"),
    trust_pickle: bool = typer.Option(
        False, "--trust-pickle", help="resolve unknown pickled globals for real"
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
) -> None:
    """Rewrite a sharded checkpoint for another world size (optimizer state, scheduler, RNG included)."""
    from zckpt.reshard import reshard

    res = reshard(src, dst, world=world, tag=tag, to=to, stage=stage, overwrite=overwrite,
                  progress=not quiet, trust_pickle=trust_pickle)  # fmt: skip
    stage_s = f" ZeRO-{res.stage}" if res.dst_format == "deepspeed" else ""
    typer.echo(f"{res.src} ({res.src_format}, world {res.src_world}) -> {res.dst} ({res.dst_format}{stage_s}, "
               f"world {res.world}, tag {res.tag}): {len(res.files)} files, {res.bytes_written / 1e6:.1f} MB "
               f"in {res.seconds:.1f}s")  # fmt: skip
    for n in res.notes:
        typer.echo(f"note: {n}")


def register(app: typer.Typer) -> None:
    app.command("reshard")(reshard_cmd)
