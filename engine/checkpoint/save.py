"""Saving an ``Engine`` in the native format (docs/native-format.md), synchronously or in the background.

Protocol (both modes; every rank calls ``save``):

1. rank 0 empties the staging folder ``.<tag>.staging`` (a killed save's leftovers) and a barrier on the
   training group follows, so no rank writes into it before (an ``s3://`` save dir: a local stand-in whose
   rank files stream to the bucket; a rank on another node makes its node's own stand-in after the barrier,
   reports the object it uploaded with its result, and removes that stand-in once the save is over);
2. each rank captures its part (``engine.checkpoint.content``) and writes its rank file into the staging
   folder through the native format's one writer (``zckpt.formats.native.write``): ``write_rank`` straight
   from the live tensors (synchronous), or ``write_rank_views`` from the snapshot (asynchronous,
   ``engine.checkpoint.async_save``); the file is fsynced when it closes;
3. ``write_and_publish``: every rank's (record, RNG, error) is all-gathered; rank 0 -- only when every rank
   succeeded -- writes ``manifest.json``, fsyncs the folder, publishes it as ``<tag>`` (an atomic swap when
   the tag exists) and then moves ``latest``; rank 0 broadcasts the outcome, which keeps every rank in the
   save until ``latest`` moved and makes a failure on any rank fail the save on every rank (the failing rank
   raises its own error, the others ``CheckpointSaveError``); a failed save's staging folder is removed and
   ``latest`` still names the previous checkpoint.

Synchronous saves run step 3 on the training group. Asynchronous ones run steps 2 (the write) and 3 on a
background thread, over a separate gloo group (``SideGroup``): collectives issued from a second thread on
the training group could interleave with the training loop's own collectives, and NCCL requires every
rank to issue them in one order.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from engine.checkpoint.content import RankSave, capture, staging_dir
from engine.config import WriterConfig
from zckpt.errors import WriteFailed
from zckpt.formats._latest import write_latest
from zckpt.formats.native import write as W
from zckpt.io import objstore, remote_staging
from zckpt.io.direct_io import ALIGN, WriteOptions
from zckpt.io.objstore import as_path
from zckpt.io.safetensors import FileRecord
from zckpt.io.staging import fsync_path, publish_folder

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.engine import Engine


class CheckpointSaveError(WriteFailed):
    """A save failed on some rank (or in the background); its tag was not published, ``latest`` unchanged."""


class Group(Protocol):
    """The collectives step 3 needs (``engine.zero.collectives.Comm`` or ``SideGroup``)."""

    rank: int

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...


@dataclass(frozen=True)
class RankResult:
    """What one rank reports after writing its file."""

    record: FileRecord | None
    rng: dict[str, Any]
    error: str | None
    uploaded: tuple[str, ...] = ()
    """``s3://`` save dir: the object this rank's file was streamed to (part of the published tag, or
    deleted by rank 0 if the save fails)."""


def write_options(cfg: WriterConfig) -> WriteOptions:
    """``checkpoint.writer`` as the file writer's options."""
    size = -(-cfg.io_buffer_size // ALIGN) * ALIGN
    return WriteOptions(
        direct=cfg.type == "fast",
        buf_bytes=size,
        buffers=(2 if cfg.io_buffer_double else 1) * cfg.io_multiplier,
    )


def save(
    eng: Engine,
    save_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen: bool = False,
) -> Path:
    """Write a native checkpoint of ``eng`` into ``save_dir/<tag>`` (collective: every rank calls it). With
    ``checkpoint.writer.decoupled`` it returns once the state is snapshotted (see the module doc).
    ``exclude_frozen``: leave frozen params out (a load then needs ``strict=False``)."""
    t0 = time.perf_counter()
    saver = eng.checkpointer
    if saver is not None:
        saver.wait()  # one save at a time; the previous one's error surfaces here
    root = as_path(save_dir)
    tag = tag if tag is not None else f"global_step{eng.global_steps}"
    prepare(eng, root, tag)
    job = capture(eng, root, tag, client_state or {}, save_latest, exclude_frozen)
    if saver is not None:
        saver.submit(job, t0)
        return job.tag_dir
    stats: dict[str, Any] = {}
    opts = write_options(eng.config.checkpoint.writer)
    model = job.model_record
    write_and_publish(job, eng.comm, lambda: W.write_rank(job.rank_path, job.items, opts=opts,
                                                          on_stats=stats.update, model=model))  # fmt: skip
    took = time.perf_counter() - t0
    eng.checkpoint_stats = {"tag": tag, "mode": "sync", "blocked_s": took, "total_s": took, "write": stats}
    report(eng, eng.checkpoint_stats)
    return job.tag_dir


def prepare(eng: Engine, root: Path, tag: str) -> None:
    """Step 1: a fresh staging folder, created by rank 0 before any rank writes into it. For an ``s3://``
    save dir, a rank on another node than rank 0 (where that folder is not) then makes its host's own
    stand-in for the same tag folder (its rank file streams from there to the bucket)."""
    stage = staging_dir(root, tag)
    remote = objstore.is_url(root)
    if eng.comm.rank == 0:
        shutil.rmtree(stage, ignore_errors=True)  # left by a save that was killed
        stage.mkdir(parents=True)
        if remote:  # ranks stream their rank files from here to the bucket
            remote_staging.mark(stage, root / tag)
    eng.comm.barrier()
    if remote and not remote_staging.on_this_host(stage, str(as_path(root / tag))):
        stage.mkdir(parents=True, exist_ok=True)
        remote_staging.mark(stage, root / tag)


def write_and_publish(job: RankSave, group: Group, write: Callable[[], FileRecord]) -> None:
    """Steps 2 and 3 on this rank: ``write()`` its rank file, then agree and publish over ``group``."""
    own: Exception | None = None
    remote = objstore.is_url(job.root)
    try:
        rec = write()
        t = remote_staging.target(job.rank_path) if remote else None
        mine = RankResult(rec, job.rng, None, (t[1],) if t is not None else ())
    except Exception as e:  # reported to every rank, then raised here
        own = e
        mine = RankResult(None, job.rng, f"rank {job.rank}: {type(e).__name__}: {e}")
    results = group.all_gather_object(mine)
    err = next((r.error for r in results if r.error), None)
    if job.rank == 0:
        if err is None:
            try:
                _publish(job, results)
            except Exception as e:
                own = own or e
                err = f"rank 0, publishing: {type(e).__name__}: {e}"
        if err is not None:
            if remote:  # every rank's uploaded file, wherever its node
                remote_staging.discard_dir(job.stage_dir, [u for r in results for u in r.uploaded])
            else:
                shutil.rmtree(job.stage_dir, ignore_errors=True)
    err = group.broadcast_object(err)
    if remote and job.rank != 0 and remote_staging.on_this_host(job.stage_dir, str(as_path(job.tag_dir))):
        shutil.rmtree(job.stage_dir, ignore_errors=True)  # another node's stand-in (rank 0 removed its own)
    if own is not None:
        raise own
    if err is not None:
        raise CheckpointSaveError(f"{job.tag_dir}: not saved ({err}); `latest` is unchanged",
                                  path=str(job.tag_dir))  # fmt: skip


def _publish(job: RankSave, results: list[RankResult]) -> None:
    """Rank 0, every rank file written: manifest, fsync, publish the folder, then move ``latest``."""
    m = job.manifest
    assert m is not None
    records = [r.record for r in results if r.record is not None]
    man = W.build_manifest(
        tag=m.tag,
        world=m.world,
        stage=m.stage,
        tensors=m.tensors,
        optim_states=m.optim_states,
        tied=m.tied,
        state=m.state,
        client_state=m.client_state,
        rng=[r.rng for r in results],
        records=records,
    )
    W.write_manifest(job.stage_dir, man)
    for f in job.stage_dir.iterdir():
        fsync_path(f)
    fsync_path(job.stage_dir)
    publish_folder(
        job.stage_dir, job.tag_dir, overwrite=True, uploaded=[u for r in results for u in r.uploaded]
    )
    if job.save_latest:
        write_latest(job.root, job.tag)


def report(eng: Engine, stats: dict[str, Any]) -> None:
    """``checkpoint.writer.show_statistics``: one line per rank and save."""
    if not eng.config.checkpoint.writer.show_statistics:
        return
    w = stats.get("write", {})
    gbs = w.get("bytes", 0) / max(w.get("wall_s", 0) or 1e-9, 1e-9) / 1e9
    print(f"[engine checkpoint] rank {eng.comm.rank} {stats['mode']} {stats['tag']}: "
          f"{w.get('bytes', 0) / 1e9:.3f} GB written in {w.get('wall_s', 0):.2f} s ({gbs:.2f} GB/s; "
          f"hashing {w.get('hash_s', 0):.2f} s, device writes {w.get('device_write_s')} s, fsync "
          f"{w.get('fsync_s', 0):.2f} s, O_DIRECT {w.get('direct')}); training blocked "
          f"{stats['blocked_s']:.3f} s, save done after {stats['total_s']:.2f} s", flush=True)  # fmt: skip
