"""The group of processes an operation runs on, and how they agree on success or failure.

``consolidate`` and ``reshard`` run one code path whatever the number of processes: a single process is
the ``SOLO`` group (rank 0 of 1, collectives are local). A conversion split over ranks needs three things
from ``torch.distributed`` and nothing else: each rank's place (``Group.rank`` / ``Group.world``), one value
sent from rank 0 to all (``Group.broadcast``), and a vote after each step (``Group.step``): every rank
reports whether its part succeeded, and if any failed, every rank raises — the failing ones their own
error, the others a ``WriteFailed`` naming the failed ranks — so no rank goes on to publish output that
another rank did not finish. Collectives carry small Python objects only (paths, plan digests, error
texts), never tensor bytes: those go straight to the shared output folder.

``group(distributed)`` resolves the mode: ``False`` (the library's default) is single-process, whatever
process group exists: a call made on one rank only (``if rank == 0: zckpt.consolidate(...)`` after training)
never waits for the others. ``True`` splits the work over the default process group, and initialises one
(gloo, ``env://``, as ``torchrun`` sets up) when ``WORLD_SIZE`` > 1 and none exists; then every rank must
make the call. A default group on another backend (NCCL) gets a gloo sub-group for these CPU-side messages.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from zckpt.errors import KeyMappingError, WriteFailed

T = TypeVar("T")


@dataclass(frozen=True)
class Group:
    """A gloo process group of ``world`` ranks, seen from ``rank``."""

    rank: int
    world: int
    pg: Any = None
    """The ``torch.distributed`` group to use (None: the default group)."""

    def broadcast(self, obj: Any) -> Any:
        """``obj`` as given on rank 0, on every rank."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def agree(self, error: BaseException | None, what: str) -> None:
        """Collective vote after a step: re-raise ``error`` on its rank, raise ``WriteFailed`` on the others
        when any rank failed; return on every rank when all succeeded."""
        if self.world == 1:
            if error is not None:
                raise error
            return
        votes = self.gather(None if error is None else f"{type(error).__name__}: {error}")
        failed = [(r, v) for r, v in enumerate(votes) if v is not None]
        if not failed:
            return
        if error is not None:
            raise error
        first_rank, first_msg = failed[0]
        ranks = ", ".join(str(r) for r, _ in failed)
        raise WriteFailed(
            f"{what} failed on rank {ranks} ({first_msg}); nothing was written",
            hint=f"see rank {first_rank}'s error for the cause",
        )

    def check_same(self, what: str, mine: str, rank0: str) -> None:
        """Vote that this rank's ``mine`` (a plan digest) equals rank 0's ``rank0``."""

        def same() -> None:
            if mine != rank0:
                raise KeyMappingError(
                    f"rank {self.rank}: {what} differs from rank 0's (another checkpoint, tag or options on "
                    "this rank?)",
                    hint="give every rank the same checkpoint and options",
                )

        self.step(f"agreeing on {what}", same)

    def step(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on this rank, then vote (``agree``): its result on every rank when all succeeded."""
        err: BaseException | None = None
        out: Any = None
        try:
            out = fn()
        except BaseException as e:  # noqa: BLE001 - voted on, then re-raised on this rank
            err = e
        self.agree(err, what)
        return out


SOLO = Group(0, 1)
"""A single process: every collective is local."""


def env_world() -> int:
    """``WORLD_SIZE`` from the environment (1 when unset), as ``torchrun`` sets it."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def group(distributed: bool) -> Group:
    """The group to split work over (``SOLO`` for a single process; see the module doc)."""
    if not distributed:
        return SOLO
    import torch.distributed as dist

    if not dist.is_available():
        raise KeyMappingError("distributed mode needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        if env_world() <= 1:
            raise KeyMappingError(
                "distributed mode: no process group is initialised and WORLD_SIZE is not > 1",
                hint="launch with torchrun --nproc_per_node N (or init torch.distributed first)",
            )
        dist.init_process_group("gloo", init_method="env://")
    world = dist.get_world_size()
    if world <= 1:
        return SOLO
    pg = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return Group(dist.get_rank(), world, pg)
