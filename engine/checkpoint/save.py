"""Saving an ``Engine`` in the native format (docs/native-format.md), synchronously or in the background.

Protocol (both modes; every rank calls ``save``):

1. rank 0 empties the staging folder ``.<tag>.staging`` (a killed save's leftovers) and a barrier on the
   training group follows, so no rank writes into it before. An ``s3://`` save dir: rank 0 makes a fresh
   local stand-in (``zckpt.storage.remote_staging.stand_in``) whose rank files stream to the bucket under a
   fresh generation (``rank_00000.g<16 hex>.safetensors``: keys no earlier save used, so the previous save of
   the tag stays whole while they upload) and broadcasts it; a rank on another node makes its node's own
   stand-in, reports the object it uploaded with its result, and removes that stand-in once the save is over;
2. each rank captures its part (``engine.checkpoint.content``) and writes its rank file into the staging
   folder through the native format's one writer (``zckpt.formats.native.write``): ``write_rank`` straight
   from the live tensors (synchronous), or ``write_rank_views`` from the snapshot (asynchronous,
   ``engine.checkpoint.async_save``); the file is fsynced when it closes;
3. ``write_and_publish``: every rank's (record, RNG, error) is all-gathered; rank 0 -- only when every rank
   succeeded -- writes ``manifest.json``, fsyncs the folder, publishes it as ``<tag>`` (an atomic swap when
   the tag exists; in a bucket, the manifest naming the new generation replaces the old one in one PUT, and
   the previous generation's objects are deleted after it) and then moves ``latest``; rank 0 broadcasts the
   outcome, which keeps every rank in the
   save until ``latest`` moved and makes a failure on any rank fail the save on every rank (the failing rank
   raises its own error, the others ``CheckpointSaveError``); a failed save's staging folder (its uploaded
   objects) is removed and ``latest`` still names the previous checkpoint, whole. A failure after the new
   manifest landed (moving ``latest``) leaves the new tag whole and says so.

Every save runs with a ``zckpt.storage.session.Storage`` of its own (a background save keeps it until it
ends).

Synchronous saves run step 3 on the training group. Asynchronous ones run steps 2 (the write) and 3 on a
background thread, over a separate gloo group (``SideGroup``): collectives issued from a second thread on
the training group could interleave with the training loop's own collectives, and NCCL requires every
rank to issue them in one order.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from engine.checkpoint.content import RankSave, capture, staging_dir
from engine.config import WriterConfig
from zckpt.codecs.safetensors import FileRecord
from zckpt.errors import WriteFailed
from zckpt.formats._latest import write_latest
from zckpt.formats._names import PUBLISH_ORDER
from zckpt.formats.native import layout as L
from zckpt.formats.native import write as W
from zckpt.storage import objstore, remote_staging, session
from zckpt.storage.digest import SIDECARS
from zckpt.storage.direct_io import ALIGN, WriteOptions
from zckpt.storage.location import Location, location
from zckpt.storage.objstore import RemotePath
from zckpt.storage.staging import fsync_path, publish_folder

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
) -> Location:
    """Write a native checkpoint of ``eng`` into ``save_dir/<tag>`` (collective: every rank calls it). With
    ``checkpoint.writer.decoupled`` it returns once the state is snapshotted (see the module doc).
    ``exclude_frozen``: leave frozen params out (a load then needs ``strict=False``)."""
    t0 = time.perf_counter()
    saver = eng.checkpointer
    if saver is not None:
        saver.wait()  # one save at a time; the previous one's error surfaces here
    root = location(save_dir)
    tag = tag if tag is not None else f"global_step{eng.global_steps}"
    st = session.Storage()
    handed = False
    try:
        with st.bound():
            stage, gen = prepare(eng, root, tag)
            job = capture(eng, root, tag, client_state or {}, save_latest, exclude_frozen)
            job = replace(job, stage=stage, generation=gen)
            if saver is not None:
                saver.submit(job, t0, st)  # the background save closes the storage when it ends
                handed = True
                return job.tag_dir
            stats: dict[str, Any] = {}
            opts = write_options(eng.config.checkpoint.writer)
            model = job.model_record
            path, items = job.rank_path, job.items
            write_and_publish(
                job,
                eng.comm,
                lambda: W.write_rank(path, items, opts=opts, on_stats=stats.update, model=model),
            )
    finally:
        if not handed:
            st.close()
    took = time.perf_counter() - t0
    eng.checkpoint_stats = {"tag": tag, "mode": "sync", "blocked_s": took, "total_s": took, "write": stats}
    report(eng, eng.checkpoint_stats)
    return job.tag_dir


def prepare(eng: Engine, root: Location, tag: str) -> tuple[Path, str | None]:
    """Step 1: (the folder this rank writes its file into, the rank files' generation). A fresh staging
    folder, created by rank 0 before any rank writes into it. For an ``s3://`` save dir: rank 0's fresh
    stand-in and a fresh generation, broadcast; a rank on another node than rank 0 (where that folder is not)
    makes its host's own stand-in for the same tag folder (its rank file streams from there to the
    bucket)."""
    if not isinstance(root, RemotePath):
        stage = staging_dir(root, tag)
        if eng.comm.rank == 0:
            shutil.rmtree(stage, ignore_errors=True)  # left by a save that was killed
            stage.mkdir(parents=True)
        eng.comm.barrier()
        return stage, None
    mine = (
        (remote_staging.stand_in(root / tag, PUBLISH_ORDER), L.new_generation())
        if eng.comm.rank == 0
        else None
    )
    ticket, gen = eng.comm.broadcast_object(mine)
    return (Path(ticket.folder) if mine is not None else remote_staging.join(ticket)), gen


def write_and_publish(
    job: RankSave,
    group: Group,
    write: Callable[[], FileRecord],
    publish: Callable[[RankSave, list[RankResult], list[str]], None] | None = None,
) -> None:
    """Steps 2 and 3 on this rank: ``write()`` its rank file, then agree and publish over ``group``. Rank 0
    publishes with ``publish(job, results, phase)`` (default: the native manifest, ``_publish``), which sets
    ``phase[0] = "published"`` once the tag is in place."""
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
    phase = ["writing"]
    if job.rank == 0:
        if err is None:
            try:
                (publish or _publish)(job, results, phase)
            except Exception as e:
                own = own or e
                err = f"rank 0, publishing: {type(e).__name__}: {e}"
                if phase[0] == "published":
                    err = f"{_PUBLISHED} ({e}); `latest` still names the previous tag"
        if err is not None and phase[0] != "published":
            if remote:  # every rank's uploaded file, wherever its node (never the previous save's)
                remote_staging.discard_dir(job.stage_dir, [u for r in results for u in r.uploaded])
            else:
                shutil.rmtree(job.stage_dir, ignore_errors=True)
    err = group.broadcast_object(err)
    if remote and job.rank != 0 and job.stage_dir.is_dir():  # this node's share of rank 0's stand-in, or
        remote_staging.unregister(job.stage_dir)  # its own stand-in on another node: removed
        shutil.rmtree(job.stage_dir, ignore_errors=True)
    if err is not None and err.startswith(_PUBLISHED):  # the new tag is whole; only `latest` did not move
        raise CheckpointSaveError(f"{job.tag_dir}: {err}", path=str(job.tag_dir)) from own
    if own is not None:
        raise own
    if err is not None:
        raise CheckpointSaveError(f"{job.tag_dir}: not saved ({err}); `latest` is unchanged, the previous "
                                  "save is whole", path=str(job.tag_dir))  # fmt: skip


_PUBLISHED = "published whole, but moving `latest` failed"


def _publish(job: RankSave, results: list[RankResult], phase: list[str]) -> None:
    """Rank 0, every rank file written: manifest, fsync, publish the folder, then move ``latest``.
    ``phase[0]`` becomes ``"published"`` once the tag is in place (a later failure leaves it whole)."""
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
        generation=job.generation,
    )
    W.write_manifest(job.stage_dir, man)
    for f in job.stage_dir.iterdir():
        fsync_path(f)
    fsync_path(job.stage_dir)
    tag_dir = job.tag_dir
    if isinstance(tag_dir, RemotePath):
        before = _previous_files(tag_dir)
        done = remote_staging.publish_dir(
            job.stage_dir,
            tag_dir,
            PUBLISH_ORDER,
            _superseded,
            also=[u for r in results for u in r.uploaded],
        )
        dead = sorted(u.rsplit("/", 1)[1] for u in done.deleted if u.rsplit("/", 1)[1] not in before)
        if dead:
            warnings.warn(f"{job.tag_dir}: deleted {len(dead)} object(s) of an unfinished earlier save "
                          f"({dead[0]}{', ...' if len(dead) > 1 else ''})", stacklevel=4)  # fmt: skip
        if done.left:
            warnings.warn(f"{job.tag_dir}: the previous save's objects were not all deleted; the next save "
                          "of this tag deletes them", stacklevel=4)  # fmt: skip
    else:
        publish_folder(job.stage_dir, tag_dir, overwrite=True)
    phase[0] = "published"
    if job.save_latest:
        write_latest(job.root, job.tag)


def _previous_files(tag_dir: RemotePath) -> set[str]:
    """The files (and their sidecars) the tag's current manifest in the bucket names: the previous good
    save's, deleted after the new one lands without a word; none when there is no readable manifest."""
    from zckpt.formats.native import load_manifest

    try:
        man = load_manifest(tag_dir)
    except Exception:  # noqa: BLE001 - no previous save, or a damaged one: nothing of it to recognise
        return set()
    return {n + side for n in man.files for side in ("", *SIDECARS)}


def _superseded(rel: str) -> bool:
    """An object of a tag folder in a bucket that a new save replaces: a rank file of any generation and its
    sidecars (the new save's own are kept by ``publish_dir``); never a file zckpt did not write."""
    name, _, side = rel.partition(".safetensors")
    return (
        "/" not in rel
        and L.RANK_FILE.fullmatch(name + ".safetensors") is not None
        and side in ("", *SIDECARS)
    )


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
