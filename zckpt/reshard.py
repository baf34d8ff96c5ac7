"""``zckpt reshard``: rewrite a sharded checkpoint for another data-parallel world size.

Reads any checkpoint zckpt opens (native engine format, DeepSpeed ZeRO-1/2/3) through the checkpoint
model and writes a complete checkpoint folder (``latest`` + the tag folder) that the target trainer
loads at the new world size with nothing else to do:

- native -> native, DeepSpeed -> native: ``zckpt.formats.native`` writer (per-rank padded chunks).
- DeepSpeed -> DeepSpeed, native -> DeepSpeed: ``zckpt.formats.deepspeed_write`` (ZeRO-1/2/3 layouts
  DeepSpeed's own ``load_checkpoint`` accepts without universal conversion; ``stage`` may change).

Everything moves: fp32 masters, every optimizer state whatever its name (per-element states are
re-cut like the params, scalar states such as ``step`` are copied), frozen params, buffers, tied
aliases, scheduler / loss scaler / step counters / client_state (verbatim). Per-rank RNG states (native
format): new rank ``r`` takes old rank ``r``'s state when it exists; new ranks beyond the old world take
old rank ``r % old_world``'s state (so data-parallel ranks that share a stream stay deterministic);
DeepSpeed files hold no RNG state.

Tensors are streamed: each destination file is written one storage at a time, each storage read in
bounded chunks from only the source bytes it needs (``zckpt.flat``). Output goes to a hidden staging
folder beside DST (tag folder first, ``latest`` last) that is renamed into place at the end; the
source is never written to. ``read_partition`` is the pure helper for load-time reshard.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from zckpt.errors import OutputExists, Unsupported
from zckpt.flat import read_partition, read_range
from zckpt.formats import open_checkpoint
from zckpt.model import Checkpoint
from zckpt.outputs import Staging
from zckpt.progress import bar as progress_bar

OnFile = Callable[[str, int], None]

__all__ = ["ReshardResult", "default_dst", "read_partition", "read_range", "reshard"]


@dataclass
class ReshardResult:
    src: str
    dst: str
    src_format: str
    dst_format: str
    src_world: int
    world: int
    src_stage: int | None
    stage: int | None
    tag: str
    files: list[str] = field(default_factory=list)
    bytes_written: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def default_dst(src: Path, world: int) -> Path:
    """Bare ``zckpt reshard --world N`` inside a run's checkpoint folder writes a *sibling* folder
    ``<src>-world<N>`` (never inside the source)."""
    s = src.resolve()
    return s.with_name(f"{s.name}-world{world}")


def _save_dir(src: Path, ckpt: Checkpoint) -> Path:
    """The folder holding ``latest`` (what users call the checkpoint folder), from SRC as given."""
    p = src.resolve()
    if (p / "latest").is_file() or not ckpt.meta.tag or p.name != ckpt.meta.tag:
        return p
    return p.parent


def _inside(child: Path, parent: Path) -> bool:
    try:
        child.resolve().relative_to(parent.resolve())
        return True
    except ValueError:
        return False


def reshard(
    src: str | Path,
    dst: str | Path | None = None,
    *,
    world: int,
    tag: str | None = None,
    to: str | None = None,
    stage: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    trust_pickle: bool = False,
) -> ReshardResult:
    """Reshard ``src`` for ``world`` ranks into the checkpoint folder ``dst`` (see module docstring).

    ``to``: ``"native"`` or ``"deepspeed"`` (default: the source's format). ``stage``: DeepSpeed ZeRO stage
    of the output (default: the source's; native sources default to 3)."""
    if world < 1:
        raise Unsupported(f"world size must be >= 1, got {world}")
    t0 = time.perf_counter()
    src_p = Path(src)
    ckpt = open_checkpoint(src_p, tag=tag, trust_pickle=trust_pickle)
    fmt = ckpt.meta.format
    to = to or fmt
    if to not in ("native", "deepspeed"):
        raise Unsupported(f"cannot write format {to!r}; reshard writes 'native' or 'deepspeed'")
    if fmt not in ("native", "deepspeed"):
        raise Unsupported(
            f"{src_p}: a {fmt} checkpoint is not sharded; nothing to reshard",
            hint="reshard reads native and DeepSpeed checkpoints",
        )
    save_dir = _save_dir(src_p, ckpt)
    dst_p = default_dst(save_dir, world) if dst is None else Path(dst)
    if _inside(save_dir, dst_p) or _inside(dst_p, save_dir):
        raise OutputExists(
            f"{dst_p}: refusing to write over or around the source {save_dir}",
            hint="choose a new folder, e.g. the default <src>-world<N>",
        )
    out_tag = ckpt.meta.tag or "reshard"
    res = ReshardResult(
        str(save_dir), str(dst_p), fmt, to, ckpt.meta.world_size, world, ckpt.meta.stage, stage, out_tag
    )
    with Staging(dst_p, is_dir=True, overwrite=overwrite) as st:
        bar = progress_bar(
            sum(e.stored_nbytes for e in ckpt.entries.values()), f"reshard -> world {world}", enabled=progress
        )

        def on_file(name: str, nbytes: int) -> None:
            res.files.append(f"{out_tag}/{name}")
            res.bytes_written += nbytes
            bar.update(nbytes)

        try:
            if to == "deepspeed":
                res.stage, notes = _to_deepspeed(ckpt, st.dir / out_tag, world, stage, trust_pickle, on_file)
            else:
                res.stage, notes = _to_native(ckpt, st.dir, out_tag, world, stage, trust_pickle, on_file)
        finally:
            bar.close()
        res.notes += notes
        (st.dir / "latest").write_text(out_tag)
        st.commit()
    ckpt.close()
    res.seconds = time.perf_counter() - t0
    return res


def _to_deepspeed(
    ckpt: Checkpoint, tag_dir: Path, world: int, stage: int | None, trust_pickle: bool, on_file: OnFile
) -> tuple[int, list[str]]:
    from zckpt.formats import deepspeed_write as dw

    if ckpt.meta.format == "deepspeed":
        tmpl = dw.template_from_deepspeed(ckpt, trust_pickle=trust_pickle)
    else:
        tmpl = dw.template_from_native(ckpt)
    src_stage = ckpt.meta.stage if ckpt.meta.format == "deepspeed" else 3
    out_stage = src_stage if stage is None else stage
    if out_stage not in (1, 2, 3):
        raise Unsupported(f"cannot write DeepSpeed ZeRO stage {out_stage}", hint="pass --stage 1, 2 or 3")
    notes = dw.write_deepspeed(
        ckpt, tag_dir, world=world, stage=int(out_stage or 3), tmpl=tmpl, on_file=on_file
    )
    return int(out_stage or 3), notes


def _to_native(
    ckpt: Checkpoint,
    out_dir: Path,
    tag: str,
    world: int,
    stage: int | None,
    trust_pickle: bool,
    on_file: OnFile,
) -> tuple[int, list[str]]:
    from zckpt.formats import native_write as nw

    if ckpt.meta.format == "native":
        tmpl = nw.template_from_native(ckpt, stage)
    else:
        tmpl = nw.template_from_deepspeed(ckpt, stage, trust_pickle=trust_pickle)
    if tmpl.stage not in (0, 1, 2, 3):
        raise Unsupported(f"the engine has no ZeRO stage {tmpl.stage}", hint="pass --stage 0, 1, 2 or 3")
    notes = nw.write_native(ckpt, out_dir / tag, world=world, tag=tag, tmpl=tmpl, on_file=on_file)
    return tmpl.stage, notes
