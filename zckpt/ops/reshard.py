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
bounded chunks from only the source bytes it needs (``zckpt.io.flat``). Output goes to a hidden staging
folder beside DST (tag folder first, ``latest`` last) that is renamed into place at the end; the
source is never written to. ``read_partition`` is the pure helper for load-time reshard.

Distributed (``distributed=``, or the CLI under ``torchrun``): the processes of a group split the rank
files (process ``i`` writes ranks ``i::n``) into rank 0's staging folder, as ``consolidate`` splits its
shards; rank 0 writes the native manifest (every file's hash) and ``latest``, and publishes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zckpt.checkpoint import Checkpoint
from zckpt.errors import KeyMappingError, OutputExists, Unsupported
from zckpt.formats import open_checkpoint
from zckpt.io.flat import read_partition, read_range
from zckpt.io.outputs import Staging
from zckpt.ops import group as zdist
from zckpt.ops.progress import bar as progress_bar

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
    distributed: bool | None = None,
) -> ReshardResult:
    """Reshard ``src`` for ``world`` ranks into the checkpoint folder ``dst`` (see module docstring).

    ``to``: ``"native"`` or ``"deepspeed"`` (default: the source's format). ``stage``: DeepSpeed ZeRO stage
    of the output (default: the source's; native sources default to 3). ``distributed``: split the rank
    files over the processes of a ``torch.distributed`` group, as ``consolidate`` does (``None``: when a
    group of world > 1 is initialised; ``True``: also start one from ``env://``, as under ``torchrun``)."""
    if world < 1:
        raise Unsupported(f"world size must be >= 1, got {world}")
    g = zdist.group(distributed)
    if g is not None:
        return _reshard_group(g, src, dst, world, tag, to, stage, overwrite, progress, trust_pickle)
    t0 = time.perf_counter()
    ckpt, dst_p, res = _open(src, dst, world, tag, to, trust_pickle)
    with Staging(dst_p, is_dir=True, overwrite=overwrite) as st:
        bar = progress_bar(
            sum(e.stored_nbytes for e in ckpt.entries.values()), f"reshard -> world {world}", enabled=progress
        )
        try:
            out = _write(ckpt, st.dir, res, stage, trust_pickle, _counter(res, bar.update), (0, 1))
        finally:
            bar.close()
        out.finish(out.files)
        (st.dir / "latest").write_text(res.tag)
        st.commit()
    ckpt.close()
    res.seconds = time.perf_counter() - t0
    return res


def _open(
    src: str | Path, dst: str | Path | None, world: int, tag: str | None, to: str | None, trust_pickle: bool
) -> tuple[Checkpoint, Path, ReshardResult]:
    """Open and check the source, resolve the destination; the result to fill in."""
    src_p = Path(src)
    ckpt = open_checkpoint(src_p, tag=tag, trust_pickle=trust_pickle)
    try:
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
    except BaseException:
        ckpt.close()
        raise
    out_tag = ckpt.meta.tag or "reshard"
    res = ReshardResult(
        str(save_dir), str(dst_p), fmt, to, ckpt.meta.world_size, world, ckpt.meta.stage, None, out_tag
    )
    return ckpt, dst_p, res


def _counter(res: ReshardResult, update: Callable[[int], object]) -> OnFile:
    def on_file(name: str, nbytes: int) -> None:
        res.files.append(f"{res.tag}/{name}")
        res.bytes_written += nbytes
        update(nbytes)

    return on_file


@dataclass
class _Written:
    """What one process wrote, and how to complete the folder once every process has written."""

    files: dict[str, Any]
    """Native rank files' manifest entries (by name); empty for DeepSpeed output."""
    finish: Callable[[dict[str, Any]], None]
    """Given every process's ``files``: write what names them all (the native manifest); run once."""


def _write(
    ckpt: Checkpoint,
    out_dir: Path,
    res: ReshardResult,
    stage: int | None,
    trust_pickle: bool,
    on_file: OnFile,
    part: tuple[int, int],
) -> _Written:
    """Write rank files ``part[0]::part[1]`` of the output into ``out_dir / res.tag``; fills in ``res.stage``
    and ``res.notes``."""
    tag_dir = out_dir / res.tag
    if res.dst_format == "deepspeed":
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
            ckpt, tag_dir, world=res.world, stage=int(out_stage or 3), tmpl=tmpl, on_file=on_file, part=part
        )
        res.stage = int(out_stage or 3)
        res.notes += notes
        return _Written({}, lambda _files: None)
    from zckpt.formats import native_write as nw

    if ckpt.meta.format == "native":
        ntmpl = nw.template_from_native(ckpt, stage)
    else:
        ntmpl = nw.template_from_deepspeed(ckpt, stage, trust_pickle=trust_pickle)
    if ntmpl.stage not in (0, 1, 2, 3):
        raise Unsupported(f"the engine has no ZeRO stage {ntmpl.stage}", hint="pass --stage 0, 1, 2 or 3")
    notes, files = nw.write_native(
        ckpt, tag_dir, world=res.world, tag=res.tag, tmpl=ntmpl, on_file=on_file, part=part
    )
    res.stage = ntmpl.stage
    res.notes += notes

    def finish(every: dict[str, Any]) -> None:
        nw.write_manifest(ckpt, tag_dir, world=res.world, tag=res.tag, tmpl=ntmpl, files=every)

    return _Written(files, finish)


def _plan_digest(ckpt: Checkpoint, res: ReshardResult, stage: int | None) -> str:
    """What every process must agree on before writing: the same source, read the same way, same target."""
    m = ckpt.meta
    plan = [m.format, m.world_size, m.tag, m.stage, res.dst, res.dst_format, res.world, stage,
            sorted((k, list(e.shape), str(e.dtype)) for k, e in ckpt.entries.items())]  # fmt: skip
    return hashlib.sha256(json.dumps(plan).encode()).hexdigest()


def _reshard_group(
    g: zdist.Group,
    src: str | Path,
    dst: str | Path | None,
    world: int,
    tag: str | None,
    to: str | None,
    stage: int | None,
    overwrite: bool,
    progress: bool,
    trust_pickle: bool,
) -> ReshardResult:
    """``reshard`` split over the processes of ``g``: process ``i`` writes the rank files ``i::g.world``
    into rank 0's staging folder; rank 0 writes what names them all (native manifest), ``latest`` last,
    and publishes. Every step ends in a collective vote (``zckpt.ops.group``), so no process publishes output
    another did not finish."""
    t0 = time.perf_counter()
    ckpt: Checkpoint | None = None
    with contextlib.ExitStack() as stack:  # rank 0's Staging: removed on any exit before commit
        st: Staging | None = None
        err: BaseException | None = None
        digest = ""
        try:  # 1. every process opens and checks; rank 0 makes the staging folder
            ckpt, dst_p, res = _open(src, dst, world, tag, to, trust_pickle)
            digest = _plan_digest(ckpt, res, stage)
            if g.rank == 0:
                st = stack.enter_context(Staging(dst_p, is_dir=True, overwrite=overwrite))
        except BaseException as e:  # noqa: BLE001 - voted on, then re-raised on this rank
            err = e
        try:
            g.agree(err, "reshard: opening the checkpoint")
            assert ckpt is not None
            staging, digest0 = g.broadcast((str(st.dir), digest) if st is not None else None)
            g.agree(None if digest == digest0 else KeyMappingError(
                f"rank {g.rank}: the reshard plan differs from rank 0's (another checkpoint, tag or "
                "options on this rank?)", hint="give every rank the same checkpoint and options"),
                "reshard: agreeing on the output plan")  # fmt: skip
            err, out = None, None
            try:  # 2. every process writes its rank files
                mine = sum(e.stored_nbytes for e in ckpt.entries.values()) * len(
                    range(g.rank, world, g.world)
                )
                with progress_bar(
                    mine // world, f"reshard -> world {world}", enabled=progress and g.rank == 0
                ) as bar:
                    out = _write(ckpt, Path(staging), res, stage, trust_pickle, _counter(res, bar.update),
                                 (g.rank, g.world))  # fmt: skip
            except BaseException as e:  # noqa: BLE001
                err = e
            g.agree(err, "reshard: writing rank files")
            assert out is not None
            shares = g.gather((out.files, res.files, res.bytes_written))
            every = {k: v for files, _, _ in shares for k, v in files.items()}
            err = None
            if st is not None:  # 3. rank 0 completes and publishes
                try:
                    out.finish(every)
                    (st.dir / "latest").write_text(res.tag)
                    st.commit()
                except BaseException as e:  # noqa: BLE001
                    err = e
            g.agree(err, "reshard: publishing the output")
        finally:
            if ckpt is not None:
                ckpt.close()
    res.files = sorted(f for _, names, _ in shares for f in names)
    res.bytes_written = sum(n for _, _, n in shares)
    res.seconds = time.perf_counter() - t0
    return res
