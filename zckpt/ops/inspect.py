"""``inspect``: what a checkpoint holds, from its metadata alone (no tensor bytes are read).

Builds an ``InspectReport``: format, stage, world size, precision, step/tag, tensor counts and bytes
by role, one row per logical tensor (name, state, shape, dtype, role, number of pieces), tied and
frozen lists, and the optimizer's kind and state names. Near-instant on a multi-GB checkpoint.
With ``stats=True`` it also streams every tensor through ``zckpt.ops.stats`` (min/max/mean/std/norm,
NaN/Inf counts), which reads all tensor bytes in bounded chunks. ``InspectReport.plot(path)`` draws the
report (``zckpt.ops.plots``): stored bytes by rank x kind (``rank_bytes``) and parameters per layer.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zckpt.checkpoint import Checkpoint
from zckpt.formats import open_checkpoint
from zckpt.model import Role, TensorEntry, dtype_name
from zckpt.ops.scope import storage_scoped
from zckpt.storage.session import Storage

if TYPE_CHECKING:  # ``--stats`` reads tensors (torch); the rest is metadata
    from zckpt.ops.stats import TensorStats


@dataclass(frozen=True)
class TensorRow:
    """One logical tensor as ``inspect`` lists it."""

    key: str
    name: str
    state: str | None
    shape: tuple[int, ...]
    dtype: str
    role: str
    pieces: int
    numel: int
    nbytes: int


@dataclass(frozen=True)
class RoleTotal:
    count: int = 0
    numel: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class RankBytes:
    """Stored bytes of one kind and dtype on one rank: the pieces' elements plus their padding."""

    rank: int | None
    """``None``: bytes no rank owns (an unsharded file's, or values kept in a pickle)."""
    kind: str
    """``param`` (trainable: the fp32 masters where the format keeps them), ``frozen``, ``buffer``, or an
    optimizer state's name (``exp_avg``, ``exp_avg_sq``, ``step``)."""
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class InspectReport:
    """Everything ``zckpt inspect`` shows. ``to_json()`` is the ``--json`` output."""

    path: str
    format: str
    world_size: int
    stage: int | None
    precision: str | None
    tag: str | None
    step: int | None
    files: int
    by_role: dict[str, RoleTotal]
    tensors: list[TensorRow]
    tied: dict[str, str]
    frozen: list[str]
    optimizer: str | None = None
    optimizer_states: list[str] = field(default_factory=list)
    param_groups: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)
    """Model tensors per dtype (optimizer states excluded)."""
    stats: list[TensorStats] | None = None
    """Per-tensor statistics (owners only, optimizer states included) when asked for."""
    values: dict[str, str] = field(default_factory=dict)
    """Non-tensor values the checkpoint stores beside its tensors, described (``meta.extra["values"]``: DCP's
    bytes items; pickled objects among them are described, not loaded)."""
    rank_bytes: list[RankBytes] = field(default_factory=list)
    """Stored bytes by (rank, kind, stored dtype), from the pieces' metadata."""

    @property
    def params(self) -> int:
        """Number of model parameters (trainable + frozen elements)."""
        return sum(self.by_role[r].numel for r in (Role.PARAM.value, Role.FROZEN.value) if r in self.by_role)

    def to_json(self) -> dict[str, Any]:
        """This report as JSON values (what ``zckpt inspect --json`` prints)."""
        d = asdict(self)
        d["tensors"] = [{**asdict(t), "shape": list(t.shape)} for t in self.tensors]
        d["params"] = self.params
        return d

    def plot(self, path: str | Path) -> Path:
        """Draw the report to ``path`` (``.png``, ``.svg`` or a self-contained ``.html``): bytes by rank x
        kind as stacked bars, parameters per layer, bytes per dtype. Needs matplotlib (``zckpt[plot]``)."""
        from zckpt.ops.plots.files import plot_inspect

        return plot_inspect(self, path)


def _rank_bytes(entries: Iterable[TensorEntry]) -> list[RankBytes]:
    sums: dict[tuple[int | None, str, str], int] = {}
    for e in entries:
        kind = e.state if e.role is Role.OPTIM and e.state else e.role.value
        for p in e.pieces:
            k = (p.rank, kind, dtype_name(p.dtype))
            sums[k] = sums.get(k, 0) + (p.numel + p.padding) * p.dtype.itemsize
    return [RankBytes(*k, n) for k, n in sums.items()]


def report(ckpt: Checkpoint, *, stats: bool = False) -> InspectReport:
    """The report for an open checkpoint (metadata only, unless ``stats``)."""
    m = ckpt.meta
    rows: list[TensorRow] = []
    totals: dict[str, list[int]] = {}
    dtypes: dict[str, int] = {}
    for e in ckpt.entries.values():
        rows.append(TensorRow(e.key, e.name, e.state, e.shape, dtype_name(e.dtype), e.role.value,
                              len(e.pieces), e.numel, e.nbytes))  # fmt: skip
        t = totals.setdefault(e.role.value, [0, 0, 0])
        t[0] += 1
        t[1] += e.numel
        t[2] += e.nbytes
        if e.role.is_model:
            dtypes[dtype_name(e.dtype)] = dtypes.get(dtype_name(e.dtype), 0) + 1
    order = [r.value for r in Role]
    by_role = {r: RoleTotal(*totals[r]) for r in order if r in totals}
    opt = m.optimizer
    return InspectReport(
        path=m.path,
        format=m.format,
        world_size=m.world_size,
        stage=m.stage,
        precision=m.precision,
        tag=m.tag,
        step=m.step,
        files=len(m.files),
        by_role=by_role,
        tensors=rows,
        tied=dict(m.tied),
        frozen=[e.name for e in ckpt.entries.values() if e.role is Role.FROZEN],
        optimizer=opt.kind if opt else None,
        optimizer_states=list(opt.state_names) if opt else sorted({e.state for e in ckpt.entries.values()
                                                                    if e.state is not None}),
        param_groups=len(opt.groups) if opt else 0,
        dtypes=dtypes,
        rank_bytes=_rank_bytes(ckpt.entries.values()),
        stats=_stats(ckpt) if stats else None,
        values={str(k): str(v) for k, v in (m.extra.get("values") or {}).items()},
    )  # fmt: skip


@storage_scoped
def inspect(
    path: str | Path | Checkpoint,
    *,
    tag: str | None = None,
    trust_pickle: bool = False,
    stats: bool = False,
    storage_options: Mapping[str, str] | None = None,
    storage: Storage | None = None,
) -> InspectReport:
    """Describe a checkpoint without reading tensor data.

    Args:
        path: anything ``zckpt.open`` reads (or an open ``Checkpoint``).
        tag: the DeepSpeed tag to read instead of ``latest``.
        trust_pickle: resolve pickled globals outside the allowlist (only for files you trust).
        stats: also compute per-tensor statistics (reads every tensor, streamed; ``zckpt.ops.stats``).

    Example:
        >>> r = zckpt.inspect("out/checkpoint-100"); r.world_size, r.params
    """
    if isinstance(path, Checkpoint):
        return report(path, stats=stats)
    with open_checkpoint(path, tag=tag, trust_pickle=trust_pickle) as ckpt:
        return report(ckpt, stats=stats)


def _stats(ckpt: Checkpoint) -> list[TensorStats]:
    from zckpt.ops.stats import checkpoint_stats

    return checkpoint_stats(ckpt, include_optimizer=True, progress=sys.stderr.isatty())
