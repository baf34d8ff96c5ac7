"""Asynchronous checkpoints (``"checkpoint": {"writer": {"decoupled": true}}``): ``AsyncSaver``, one per
``Engine``.

``submit`` snapshots this rank's rank file into ``HostStaging`` -- the header and every tensor's bytes at
their offsets in the file (``rank_plan``), device-to-host copies into pinned memory on GPU, a copy on CPU --
and returns; a background thread then writes the snapshot with ``write_rank_views`` (the same bytes
``write_rank`` writes in a synchronous save) and runs the publish protocol of ``engine.checkpoint.save``.
Training goes on meanwhile, for as many steps as the write takes.

Rules:

- one save at a time: ``save`` calls ``wait()`` first, so a new snapshot never overwrites one being written;
- ``latest`` moves only after every rank's file is complete and fsynced (rank 0 publishes once every rank
  reported success); a process killed mid-write leaves the previous checkpoint as ``latest``;
- the ranks agree over ``SideGroup``, a gloo group over the same ranks made once at start-up on the main
  thread: collectives from the background thread never touch the training group (NCCL requires every
  rank to issue a group's collectives in one order; the training loop issues its own concurrently);
- a failure in the background (on any rank) is raised by the next ``save_checkpoint``, by
  ``Engine.wait_for_checkpoint()``, ``Engine.destroy()`` and ``load_checkpoint`` of the same folder; at
  interpreter exit the save in flight is finished first -- by a hook that runs when the main thread ends,
  before ``concurrent.futures`` stops taking work (the writer's hash and I/O threads need it) -- and a
  failure not yet raised is printed to stderr and the process exits with status 1; likewise before
  ``torch.distributed.destroy_process_group()`` (every group, ``SideGroup`` included), which a script often
  calls last: once an ``AsyncSaver`` exists, that function first finishes the saves in flight
  (``_finish_before_destroy``; a failure is raised there), so the script's last checkpoint is not lost;
- host memory: ``HostStaging`` holds one rank file (rounded up to 256 MiB blocks), allocated at start-up
  from a size estimate and grown by a save that needs more, reused by every save, freed by ``destroy()``.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its exit hook first, so ours runs before it
import contextlib
import os
import sys
import threading
import time
import weakref
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from engine.checkpoint.content import RankSave, predict_bytes
from engine.checkpoint.host import HostStaging
from engine.checkpoint.save import CheckpointSaveError, RankResult, report, write_and_publish, write_options
from zckpt.codecs.safetensors import FilePlan, FileRecord
from zckpt.formats.native import write as W
from zckpt.storage.location import LocationLike, location, resolved
from zckpt.storage.session import Storage
from zckpt.storage.threads import start
from zckpt.stream.items import WriteItem

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.engine import Engine

    Task = tuple[Callable[[], FileRecord], Callable[[RankSave, list[RankResult], list[str]], None]]
    """A write and a publish run on the background thread instead of the native ones (``submit_task``)."""

_LIVE: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()


class SideGroup:
    """A gloo process group over every rank, for the background thread's collectives."""

    def __init__(self, timeout: timedelta = timedelta(minutes=30)) -> None:
        self.pg = dist.new_group(backend="gloo", timeout=timeout)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.pg)
        return box[0]

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group(self.pg)


class LocalGroup:
    """One process, no process group."""

    rank = 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def destroy(self) -> None:
        pass


class AsyncSaver:
    """The background writer of one engine (see the module doc)."""

    def __init__(self, eng: Engine) -> None:
        self.eng = weakref.proxy(eng)
        self.opts = write_options(eng.config.checkpoint.writer)
        self.group: SideGroup | LocalGroup = SideGroup() if eng.comm.distributed else LocalGroup()
        self.staging = HostStaging(pinned=eng.device.type == "cuda")
        self.staging.reserve(predict_bytes(eng))
        self._thread: threading.Thread | None = None
        self._job: RankSave | None = None
        self._error: BaseException | None = None
        _LIVE.add(self)
        _finish_before_destroy()

    def submit(self, job: RankSave, t0: float, st: Storage) -> None:
        """Snapshot ``job``'s items (blocking), then write and publish them on a background thread, through
        the save's ``st`` (closed when the thread ends). A failed snapshot is raised here, once the other
        ranks know of it (their save fails too)."""
        try:
            plan = self._snapshot(job.items, job.model_record)
        except Exception as e:
            self._start(replace(job, items=[]), None, e, t0, st)
            with contextlib.suppress(CheckpointSaveError):
                self.wait()  # the peers learn of it; the snapshot's own error is raised below
            raise
        self._start(replace(job, items=[]), plan, None, t0, st)  # the live tensors are free to change now

    def submit_task(
        self,
        job: RankSave,
        write: Callable[[], FileRecord],
        publish: Callable[[RankSave, list[RankResult], list[str]], None],
        t0: float,
        st: Storage,
    ) -> None:
        """Run ``write`` (over state the caller already copied to the host) and ``publish`` on the background
        thread, with the same protocol, error surfacing and storage handling as ``submit``
        (``engine.checkpoint.ds_layout``)."""
        self._start(job, None, None, t0, st, (write, publish))

    def _snapshot(self, items: list[WriteItem], model: dict[str, str] | None) -> FilePlan:
        """The rank file of ``items`` (and rank 0's ``model`` record) laid out in ``staging``; its layout."""
        plan = W.rank_plan([(it.name, it.dtype, it.shape) for it in items], model)
        self.staging.reserve(plan.size)
        self.staging.put_bytes(0, plan.header)
        for off, it in zip(plan.offsets, items, strict=True):
            self.staging.put(off, _flat(it))
        self.staging.settle()
        return plan

    def _start(
        self,
        job: RankSave,
        plan: FilePlan | None,
        failed: Exception | None,
        t0: float,
        st: Storage,
        task: Task | None = None,
    ) -> None:
        self._job = job
        blocked = time.perf_counter() - t0
        args = (job, plan, failed, t0, blocked, st, task)
        self._thread = start(self._run, args=args, name=f"engine-ckpt-{job.tag}", daemon=False)

    def _run(
        self,
        job: RankSave,
        plan: FilePlan | None,
        failed: Exception | None,
        t0: float,
        blocked: float,
        st: Storage,
        task: Task | None,
    ) -> None:
        try:
            with st.bound():
                self._write(job, plan, failed, t0, blocked, task)
        finally:
            st.close()

    def _write(
        self,
        job: RankSave,
        plan: FilePlan | None,
        failed: Exception | None,
        t0: float,
        blocked: float,
        task: Task | None,
    ) -> None:
        stats: dict[str, Any] = {}

        def write() -> FileRecord:
            if failed is not None or plan is None:
                raise failed or RuntimeError("no snapshot")
            return W.write_rank_views(job.rank_path, self.staging.views(plan.size), plan, opts=self.opts,
                                      on_stats=stats.update)  # fmt: skip

        try:
            if task is not None:
                write_and_publish(job, self.group, task[0], task[1])
            else:
                write_and_publish(job, self.group, write)
        except BaseException as e:  # noqa: BLE001 - kept for the next wait(), never dropped
            self._error = e
        done = {"tag": job.tag, "mode": "async", "blocked_s": blocked, "total_s": time.perf_counter() - t0,
                "write": stats, "staging_bytes": self.staging.nbytes,
                "staging_alloc_s": self.staging.alloc_s}  # fmt: skip
        try:
            eng: Engine = self.eng  # type: ignore[assignment]
            eng.checkpoint_stats = done
            report(eng, done)
        except ReferenceError:  # the engine is gone; the files are written all the same
            pass

    @property
    def busy(self) -> bool:
        """A save is being written."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Wait for the save in flight; raise its error (once) if it failed."""
        t = self._thread
        if t is not None:
            t.join()
        err, job = self._error, self._job
        self._thread, self._error = None, None
        if err is not None:
            where = job.tag_dir if job is not None else "?"
            raise CheckpointSaveError(f"the background save of {where} failed: {err}; `latest` is unchanged",
                                      path=str(where)) from err  # fmt: skip

    def wait_for(self, folder: LocationLike) -> None:
        """Wait when the save in flight (or a failed one not yet reported) writes into ``folder`` or
        ``folder`` is its tag folder."""
        job = self._job
        if job is None or (self._thread is None and self._error is None):
            return
        want = _place(folder)
        if want in (_place(job.root), _place(job.tag_dir)):
            self.wait()

    def close(self) -> None:
        """Wait (raising a failure), then free the snapshot memory and the side group."""
        try:
            self.wait()
        finally:
            self.staging.release()
            self.group.destroy()
            _LIVE.discard(self)


def _place(x: LocationLike) -> str:
    """Where ``x`` is, comparable across spellings: an object URL normalised (``s3://b/k``, whatever
    ``pathlib`` made of it), a local path resolved."""
    return str(resolved(location(x)))


def _flat(it: WriteItem) -> torch.Tensor:
    """The in-memory tensor behind a content item (see ``zckpt.formats.native.write.tensor_item``)."""
    (piece,) = it.entry.pieces
    v = piece.inline()
    assert v.dtype == it.dtype and v.numel() == it.numel, it.name
    return v.reshape(-1)


def _flush_at_exit() -> None:
    """Interpreter exit: finish the saves in flight; one that failed and was never reported is printed, and
    the process exits with status 1."""
    failed = False
    for s in list(_LIVE):
        try:
            s.wait()
        except CheckpointSaveError as e:
            print(f"engine: {e}", file=sys.stderr, flush=True)
            failed = True
    if failed:
        sys.stdout.flush()
        os._exit(1)


def _finish_before_destroy() -> None:
    """Make ``torch.distributed.destroy_process_group`` finish every live saver's save first when it is
    asked to destroy every group (``group=None``, the call scripts end with); installed once, by the first
    ``AsyncSaver`` (see the module doc)."""
    destroy = dist.destroy_process_group
    if getattr(destroy, "_engine_waits", False):
        return

    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is dist.group.WORLD:
            for s in list(_LIVE):
                s.wait()
        destroy(group)

    destroy_process_group._engine_waits = True  # type: ignore[attr-defined]
    destroy_process_group.__doc__ = destroy.__doc__
    dist.destroy_process_group = destroy_process_group


# ``threading._register_atexit`` hooks run (last registered first) when the main thread ends, before
# non-daemon threads are joined and before ``atexit``; ``concurrent.futures`` refuses new work from its own
# such hook on, which a writer still running would need.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_flush_at_exit)
else:  # pragma: no cover - every supported Python has it
    atexit.register(_flush_at_exit)
