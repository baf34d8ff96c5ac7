"""``zckpt reshard``: rewrite a sharded training checkpoint for another data-parallel world size.

Reads any training checkpoint zckpt opens and writes a complete checkpoint folder that the target trainer
loads at the new world size with nothing else to do, through the target format's ``CheckpointWriter``
(``--to native``: the engine's format; ``--to deepspeed``: ZeRO-1/2/3 files DeepSpeed's own
``load_checkpoint`` accepts without universal conversion). Everything moves: fp32 masters, every
optimizer state whatever its name, frozen params, buffers, tied aliases, and the ``TrainingState``
(scheduler, loss scaler, step counters, client state, per-rank RNG where the target keeps it: see the
writers for the RNG rule). Tensors are streamed: each destination file is written one storage at a time,
each storage read in bounded chunks from only the source bytes it needs (``zckpt.stream.flat``).

An HF Trainer ``checkpoint-N`` folder (``trainer_state.json`` beside ``latest``) comes out as a complete
``checkpoint-N`` for the new world: ``zckpt.ops.trainer_files`` plans its other files (copied byte for byte,
RNG files mapped to the new ranks, the per-device batch in ``trainer_state.json``) and rank 0 copies them
into the staging folder before ``finish``.

Output goes to a hidden staging folder beside DST (rank files first, what names them all and ``latest``
last) that is published whole at the end; the source is never written to. One code path for one process
and for several (``zckpt.ops.group``): under ``torchrun`` process ``i`` writes units ``i::n`` of the plan
into rank 0's staging folder, and rank 0 finishes and publishes once every process has written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from zckpt.checkpoint import Checkpoint
from zckpt.codecs.safetensors import FileRecord
from zckpt.errors import InvalidArgument, Unsupported
from zckpt.formats import detect, get
from zckpt.formats._names import PUBLISH_ORDER
from zckpt.formats.base import CheckpointWriter, WritePlan
from zckpt.formats.deepspeed.layout import is_batch_note
from zckpt.ops import group as zgroup
from zckpt.ops import trainer_files
from zckpt.ops.paths import check_overlap, input_kind, input_root
from zckpt.ops.progress import bar as progress_bar
from zckpt.ops.progress import sized
from zckpt.ops.scope import storage_scoped
from zckpt.storage import checks
from zckpt.storage.digest import SIDECAR_PATTERN
from zckpt.storage.location import Location, location, resolved
from zckpt.storage.remote_staging import RemoteStaging, Ticket
from zckpt.storage.session import Storage
from zckpt.storage.staging import Staging, open_staging, share
from zckpt.stream.pipeline import each_file

__all__ = ["ReshardResult", "default_dst", "reshard"]


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
    tag: str | None
    """The output's tag folder; None for a DCP output (a flat folder, no tag)."""
    files: list[str] = field(default_factory=list)
    bytes_written: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


_CHECKPOINT_FILE = re.compile(
    r"^(?:latest|\.metadata|__\d+_\d+(?:\.g[0-9a-f]{16})?\.distcp"  # the tag pointer; a DCP folder's files
    r"|[^/]+/(?:manifest\.json|rank_\d{5}(?:\.g[0-9a-f]{16})?\.safetensors"  # a tag folder: native, DeepSpeed
    r"|(?:bf16_)?zero_pp_rank_\d+_mp_rank_\d+_(?:optim|model)_states\.pt|mp_rank_\d+_model_states\.pt)"
    rf"){SIDECAR_PATTERN}?$"
)
"""The files reshard writes into a checkpoint folder, in every format it writes (any world size, any tag,
any generation: ``WritePlan.generation``)."""


def _owns(side: trainer_files.TrainerFiles | None) -> Callable[[str], bool]:
    """What ``--overwrite`` may replace in an existing DST: the files of a checkpoint reshard writes
    (``_CHECKPOINT_FILE``: rank files of any world size, so no stale rank file survives to pass for part
    of the new set), and for an HF Trainer output the files it copies in and the RNG files of any rank.
    Anything else in DST refuses the run before any work, naming the files (never delete a file zckpt did
    not write; ``zckpt.storage.staging``)."""
    trainer = side is not None and side.trainer_state is not None
    copied = set(side.copies) if side is not None else set()
    copied |= {trainer_files.TRAINER_STATE} if trainer else set()
    rng = re.compile(r"^rng_state(?:_\d+)?\.pth$")

    def owns(rel: str) -> bool:
        return bool(_CHECKPOINT_FILE.match(rel)) or rel in copied or (trainer and bool(rng.match(rel)))

    return owns


def default_dst(src: Location, world: int) -> Location:
    """Bare ``zckpt reshard --world N`` inside a run's checkpoint folder writes a *sibling* folder
    ``<src>-world<N>`` (never inside the source); ``src`` is the save folder when there is one."""
    s = resolved(src)
    return s.with_name(f"{s.name}-world{world}")


@dataclass(frozen=True)
class _Job:
    ckpt: Checkpoint
    writer: CheckpointWriter
    plan: WritePlan
    dst: Location
    result: ReshardResult
    side: trainer_files.TrainerFiles | None = None
    """Files beside the state (an HF Trainer folder's), copied by rank 0 before ``finish``."""

    @property
    def digest(self) -> str:
        m, p = self.ckpt.meta, self.plan
        doc = [
            m.format,
            m.world_size,
            m.tag,
            m.stage,
            str(self.dst),
            self.result.dst_format,
            p.world,
            p.stage,
            p.units,
            list(p.digest),
            sorted((k, list(e.shape), str(e.dtype)) for k, e in self.ckpt.entries.items()),
            self.side.digest if self.side is not None else None,
        ]
        return hashlib.sha256(json.dumps(doc, default=str).encode()).hexdigest()


def _job(
    src: Location,
    dst: Location | None,
    world: int,
    tag: str | None,
    to: str | None,
    stage: int | None,
    trust_pickle: bool,
) -> _Job:
    """Open and check the source, resolve the destination, plan the output."""
    fmt = detect(src)
    ckpt = fmt.read(src, tag=tag, trust_pickle=trust_pickle)  # a damaged input is reported as such first
    try:
        if not fmt.training:
            raise Unsupported(
                f"{src}: a {input_kind(fmt.name, src)} is not sharded; nothing to reshard",
                hint="reshard reads sharded training checkpoints (native, DeepSpeed)",
            )
        target = get(to or fmt.name)
        if target.writer is None:
            raise InvalidArgument(
                f"cannot write format {target.name!r}; reshard writes 'native', 'deepspeed' or 'dcp'"
            )
        root = input_root(ckpt.meta)
        opt = ckpt.meta.state.optimizer
        tensor = opt.tensor_option() if opt is not None else None
        if tensor is not None:
            raise Unsupported(
                f"{root}: {tensor}; reshard cannot carry a tensor-valued optimizer option yet",
                hint="inspect, consolidate, verify and diff read this checkpoint",
            )
        _check_masters_named(ckpt)
        out = default_dst(root, world) if dst is None else dst
        check_overlap(ckpt.meta, out)
        out_tag = _out_tag(ckpt)
        plan = target.writer.plan(ckpt, world=world, stage=stage, tag=out_tag)
        side = trainer_files.plan(ckpt.meta, world) or trainer_files.helper_scripts(ckpt.meta, target.name)
    except BaseException:
        ckpt.close()
        raise
    res = ReshardResult(
        str(root),
        str(out),
        fmt.name,
        target.name,
        ckpt.meta.world_size,
        world,
        ckpt.meta.stage,
        plan.stage,
        None if target.name == "dcp" else out_tag,
        notes=[n for n in plan.notes if not (side is not None and side.batch_noted and is_batch_note(n))]
        + list(side.notes if side is not None else ()),  # the Trainer's batch note covers the writer's
    )
    return _Job(ckpt, target.writer, plan, out, res, side)


def _refuse_fixed_names(st: Staging | RemoteStaging, job: _Job) -> None:
    """An output replacing one in a store whose writer cannot name its files by generation (DeepSpeed's
    fixed names) is refused: neither version would be whole while it uploads."""
    if isinstance(st, RemoteStaging) and st.generation is not None and not job.writer.generations:
        raise Unsupported(
            f"{job.dst}: replacing a {job.result.dst_format} checkpoint in an object store in place would "
            "leave neither version whole while it uploads (its files have fixed names)",
            hint="write to a new prefix, then delete the old one",
            path=str(job.dst),
        )


def _with_generation(job: _Job, staging: Ticket | str) -> _Job:
    """``job`` writing its data files under the generation of an output that replaces another in a store
    (``RemoteStaging.generation``, sent to every rank in the ticket)."""
    if isinstance(staging, Ticket) and staging.generation is not None:
        return replace(job, plan=replace(job.plan, generation=staging.generation))
    return job


def _check_masters_named(ckpt: Checkpoint) -> None:
    """A ZeRO-0 file whose fp32 masters the reader could not name by value (``meta.extra["zero0_unmapped"]``)
    is read as its 16-bit module weights with no optimizer: a reshard of it would write a run that resumes
    with fresh optimizer moments and 16-bit masters, so it is refused when the file records an optimizer."""
    why = ckpt.meta.extra.get("zero0_unmapped")
    if not isinstance(why, str) or ckpt.meta.state.optimizer is None:
        return
    where = str(ckpt.meta.files[0]) if ckpt.meta.files else str(ckpt.meta.path)
    raise Unsupported(
        f"{where}: fp32 masters not mapped to names ({why}), so reshard cannot carry the optimizer state",
        hint="consolidate writes the module weights; a file whose masters match no module param was altered",
        path=where,
    )


@storage_scoped
def reshard(
    src: str | Location,
    dst: str | Location | None = None,
    *,
    world: int,
    tag: str | None = None,
    to: str | None = None,
    stage: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    trust_pickle: bool = False,
    distributed: bool = False,
    verify_data: bool = True,
    storage_options: Mapping[str, str] | None = None,
    storage: Storage | None = None,
) -> ReshardResult:
    """Reshard ``src`` for ``world`` ranks into the checkpoint folder ``dst`` (see the module docstring).

    ``to``: ``"native"`` or ``"deepspeed"`` (default: the source's format). ``stage``: ZeRO stage of the
    output (default: the source's; native sources default to 3). ``distributed``: ``False`` (default): this
    process alone, whatever process group exists; ``True``: split the rank files over the processes of the
    default ``torch.distributed`` group (started from ``env://`` under ``torchrun``), as ``consolidate``
    does; then call it on every rank.
    ``verify_data``: compare the checksums the source records over every byte read; publish nothing if one
    fails."""
    if world < 1:
        raise InvalidArgument(f"world size must be >= 1, got {world}")
    t0 = time.perf_counter()
    g = zgroup.group(distributed)
    dst_p = None if dst is None else location(dst)
    with contextlib.ExitStack() as stack:
        job = g.step(
            "reshard: opening the checkpoint",
            lambda: _job(location(src), dst_p, world, tag, to, stage, trust_pickle),
        )
        stack.callback(job.ckpt.close)

        def make_staging() -> Staging | RemoteStaging | None:
            if g.rank != 0:
                return None
            owns = _owns(job.side)
            st = open_staging(
                job.dst, is_dir=True, overwrite=overwrite, owns=owns, foreign="refuse", order=PUBLISH_ORDER
            )
            stack.enter_context(st)
            _refuse_fixed_names(st, job)
            return st

        st = g.step("reshard: staging the output", make_staging)
        staging, digest0 = g.broadcast((st.ticket(), job.digest) if st is not None else None)
        g.check_same("the reshard plan", job.digest, digest0)
        job = _with_generation(job, staging)

        def write() -> tuple[list[FileRecord], list[tuple[str, int]], list[str]]:
            with share(staging, is_dir=True) as (folder, done):
                recs, names = _write_units(g, job, folder, progress, verify_data)
                return recs, names, done()

        shares: list[Any] = g.gather(g.step("reshard: writing rank files", write))
        records = [r for recs, _, _ in shares for r in recs]

        last: list[tuple[str, int]] = []

        def publish() -> None:
            if st is not None:
                if isinstance(st, RemoteStaging):  # what ranks on other nodes uploaded
                    st.adopt([u for _, _, urls in shares for u in urls])
                if job.side is not None:
                    job.side.write(st.dir, lambda n, b: last.append((n, b)))
                with checks.verifying(verify_data):
                    job.writer.finish(job.ckpt, job.plan, st.dir, records, lambda n, b: last.append((n, b)))
                st.commit()

        g.step("reshard: publishing the output", publish)
    written = [w for _, names, _ in shares for w in names] + g.broadcast(last)
    res = job.result
    res.files = sorted(f for f, _ in written)
    res.bytes_written = sum(n for _, n in written)
    res.seconds = time.perf_counter() - t0
    return res


def _out_tag(ckpt: Checkpoint) -> str:
    """The output's tag: the source's (DeepSpeed and native tag folders), else named after the step the
    source records as DeepSpeed and the engine name theirs (a DCP folder has no tag: ``global_step3``), else
    ``reshard``."""
    if ckpt.meta.tag:
        return ckpt.meta.tag
    step = ckpt.meta.step
    return f"global_step{step}" if step is not None else "reshard"


def _write_units(
    g: zgroup.Group, job: _Job, staging: Path, progress: bool, verify_data: bool
) -> tuple[list[FileRecord], list[tuple[str, int]]]:
    """This process's units ``rank::world`` of the plan; (their records, (file, bytes) written).

    The bar counts rank units, whose number is known before writing (the bytes a unit writes are not: a
    DeepSpeed rank file is a torch zip whose size its pickle decides), so it ends at exactly 100 %; the
    bytes written so far are shown beside it, counted from the files as they are closed."""
    units = range(g.rank, job.plan.units, g.world)
    written: list[tuple[str, int]] = []
    records: list[FileRecord] = []
    lock = threading.Lock()
    with progress_bar(
        len(units), f"reshard -> world {job.plan.world}", enabled=progress and g.rank == 0, unit="rank"
    ) as bar:

        def on_file(name: str, nbytes: int) -> None:
            with lock:
                written.append((name, nbytes))

        with checks.verifying(verify_data):  # several ranks' files at once on many cores
            for recs in each_file(
                lambda u: job.writer.write_unit(job.ckpt, job.plan, staging, u, on_file), units
            ):
                records += recs
                with lock:
                    done = sum(n for _, n in written)
                bar.set_postfix_str(f"{sized(done)} written", refresh=False)
                bar.update(1)
    return records, written
