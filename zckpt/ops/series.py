"""``zckpt diff --series RUN_DIR``: a run's consecutive checkpoints diffed pair by pair, summarised per layer.

Tags: the folders directly inside ``RUN_DIR`` that a registered format detects as one checkpoint (DeepSpeed
and native tag folders ``global_stepN``, HF Trainer ``checkpoint-N``, torchtitan ``step-N`` once a format
reads them) and whose name carries a step (``STEP_PATTERNS``), sorted by that number, not by name.

Each consecutive pair goes through the streaming ``zckpt.ops.diff.diff`` (bounded memory, one pair open at
a time: the newer side is kept open as the next pair's older side, metadata only). Of each pair only the
per-row sums are kept (``RowUpdate``: ``sum ||a-b||^2`` and ``sum ||b||^2`` over the tensors of one layer,
or of one non-layer module, rows from ``zckpt.ops.plots.names``), so a long run costs what one diff costs.
A row's update size is ``sqrt(sum ||a-b||^2 / sum ||b||^2)``: the layer's relative change in L2, relative to
the newer side B as every relative figure of ``diff`` is (its ``rel_l2``). Buffers
(``position_ids``, running statistics, masks) get rows of their own, one per buffer module, and stay out of
the layers' and the whole model's sums: an integer ``arange`` would otherwise outweigh every weight's norm.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zckpt.errors import ZckptError
from zckpt.formats import open_checkpoint, registry
from zckpt.model import STATE_SEP
from zckpt.ops.diff import DiffResult, diff
from zckpt.ops.plots.names import module_of, place
from zckpt.storage.location import location, ordered

STEP_PATTERNS: tuple[re.Pattern[str], ...] = (
    re.compile(r"^global_step(\d+)$"),  # DeepSpeed, the engine's native tags
    re.compile(r"^checkpoint-(\d+)$"),  # HF Trainer
    re.compile(r"^step[-_]?(\d+)$"),  # torchtitan step-N
    re.compile(r"^iter_(\d+)$"),  # Megatron iter_0000100
    re.compile(r"(\d+)$"),  # any other name ending in a number
)
"""Tag folder names and where their step is; the first match wins."""


@dataclass(frozen=True)
class RunTag:
    name: str
    step: int
    path: str


@dataclass(frozen=True)
class RowUpdate:
    """One row's sums for one pair: a layer (``stack`` + ``layer``) or a non-layer ``module``."""

    stack: str | None
    layer: int | None
    module: str | None
    d2: float
    """``sum ||a-b||^2`` over the row's compared tensors."""
    b2: float
    """``sum ||b||^2`` over those whose norm the diff summed (a bit-identical 16-bit tensor's is unknown)."""
    tensors: int
    marks: str = ""
    """``A``/``B``: a tensor only in the older/newer side; ``S``: a shape changed (as the diff figure)."""
    buffer: bool = False
    """A buffer module's row (not counted in the whole model's update)."""

    @property
    def rel(self) -> float:
        if self.d2 == 0:
            return 0.0
        return math.sqrt(self.d2 / self.b2) if self.b2 > 0 else math.inf


@dataclass(frozen=True)
class SeriesPair:
    """One consecutive pair of a run: ``a`` (older) against ``b`` (newer)."""

    a: RunTag
    b: RunTag
    rows: tuple[RowUpdate, ...]
    compared: int
    differing: int
    only_in_a: int
    only_in_b: int
    shape_mismatches: int

    @property
    def total(self) -> float:
        """The whole model's relative change ``sqrt(sum ||a-b||^2 / sum ||b||^2)``."""
        d2 = sum(r.d2 for r in self.rows if not r.buffer)
        b2 = sum(r.b2 for r in self.rows if not r.buffer)
        return 0.0 if d2 == 0 else (math.sqrt(d2 / b2) if b2 > 0 else math.inf)


@dataclass(frozen=True)
class SeriesResult:
    """A run's drift: one ``SeriesPair`` per consecutive pair of tags, oldest first."""

    run: str
    tags: tuple[RunTag, ...]
    pairs: tuple[SeriesPair, ...]

    def to_json(self) -> dict[str, Any]:
        """This result as JSON values (what ``zckpt diff --series --json`` prints)."""
        return {
            "run": self.run,
            "tags": [{"name": t.name, "step": t.step} for t in self.tags],
            "pairs": [_pair_json(p) for p in self.pairs],
        }

    def to_text(self) -> str:
        """This result as the text ``zckpt diff --series`` prints."""
        lines = [f"{self.run}: {len(self.tags)} checkpoints, {len(self.pairs)} consecutive pairs"]
        for p in self.pairs:
            top = max(p.rows, key=lambda r: r.rel, default=None)
            where = "-" if top is None or top.rel == 0 else f"{_row_name(top)} {top.rel:.3g}"
            extra = [f"{n} {what}" for n, what in ((p.only_in_a, "only in A"), (p.only_in_b, "only in B"),
                                                   (p.shape_mismatches, "reshaped")) if n]  # fmt: skip
            head = f"{p.a.name} -> {p.b.name}: ||A-B||/||B|| {p.total:.3g}, most moved {where}"
            lines.append(
                f"{head}, {p.differing}/{p.compared} tensors differ" + "".join(f", {e}" for e in extra)
            )
        return "\n".join(lines)

    def plot(self, path: str | Path) -> Path:
        """Draw the layer x step heatmap of update sizes to ``path`` (``.png``, ``.svg``, ``.html``)."""
        from zckpt.ops.plots.files import plot_series

        return plot_series(self, path)


def _row_name(r: RowUpdate) -> str:
    if r.stack is not None:
        return f"{r.stack}.{r.layer}"
    return f"{r.module} (buffer)" if r.buffer else str(r.module)


def _pair_json(p: SeriesPair) -> dict[str, Any]:
    return {
        "a": p.a.name,
        "b": p.b.name,
        "step_a": p.a.step,
        "step_b": p.b.step,
        "rel_change": _real(p.total),
        "compared": p.compared,
        "differing": p.differing,
        "only_in_a": p.only_in_a,
        "only_in_b": p.only_in_b,
        "shape_mismatches": p.shape_mismatches,
        "rows": [
            {
                "row": _row_name(r),
                "layer": r.layer,
                "rel_change": _real(r.rel),
                "tensors": r.tensors,
                "marks": r.marks,
            }
            for r in p.rows
        ],  # fmt: skip
    }


def _real(x: float) -> float | str:
    return x if math.isfinite(x) else "inf"


def step_of(name: str) -> int | None:
    """The step a tag folder's name carries (``global_step20`` -> 20), or ``None``."""
    for rx in STEP_PATTERNS:
        m = rx.search(name)
        if m:
            return int(m.group(1))
    return None


def run_tags(run: str | Path) -> list[RunTag]:
    """The checkpoints directly inside ``run`` whose names carry a step, sorted by step."""
    root = location(run)
    if not root.is_dir():
        raise ZckptError(f"--series {root}: not a folder", hint="give the folder holding a run's tag folders")
    formats = list(registry().values())
    tags = []
    for d in ordered(root.iterdir()):
        step = step_of(d.name)
        if step is not None and d.is_dir() and any(f.detect(d) for f in formats):
            tags.append(RunTag(d.name, step, str(d)))
    tags.sort(key=lambda t: (t.step, t.name))
    if len(tags) < 2:
        found = ", ".join(t.name for t in tags) or "none"
        raise ZckptError(
            f"--series {root}: a series needs 2 or more checkpoints with a step in their name, found {found}",
            hint="give the folder that holds global_stepN / checkpoint-N / step-N folders",
        )
    return tags


def diff_series(
    run: str | Path,
    *,
    keys: Sequence[str] | None = None,
    progress: bool = True,
    trust_pickle: bool = False,
    verify_data: bool = True,
) -> SeriesResult:
    """Diff every consecutive pair of ``run``'s checkpoints (``run_tags``), model tensors only, one pair
    open at a time; keep per-row sums (see the module doc)."""
    tags = run_tags(run)
    pairs: list[SeriesPair] = []
    older = open_checkpoint(tags[0].path, trust_pickle=trust_pickle)
    try:
        for prev, tag in zip(tags, tags[1:], strict=False):
            newer = open_checkpoint(tag.path, trust_pickle=trust_pickle)
            try:
                r = diff(older, newer, keys=keys, progress=progress, verify_data=verify_data)
            except BaseException:
                newer.close()
                raise
            pairs.append(summarise(prev, tag, r))
            older.close()
            older = newer
    finally:
        older.close()
    return SeriesResult(str(location(run)), tuple(tags), tuple(pairs))


def summarise(a: RunTag, b: RunTag, r: DiffResult) -> SeriesPair:
    """Fold one pair's per-tensor results into per-row sums."""
    sums: dict[tuple[str | None, int | None, str | None, bool], list[Any]] = {}

    def row(key: str, buffer: bool) -> list[Any]:
        p = place(key)
        if p.layer is not None and not buffer:
            return sums.setdefault((p.stack, p.layer, None, False), [0.0, 0.0, 0, set()])
        return sums.setdefault((None, None, module_of(key.split(STATE_SEP)[0]), buffer), [0.0, 0.0, 0, set()])

    for t in r.tensors:
        s = row(t.key, t.role == "buffer")
        s[2] += 1
        if t.norm_diff is None:
            s[3].add("S")
            continue
        s[0] += t.norm_diff**2
        s[1] += (t.norm_b or 0.0) ** 2
    for keys, mark in ((r.only_in_a, "A"), (r.only_in_b, "B")):
        for k in keys:
            row(k, False)[3].add(mark)
    rows = tuple(RowUpdate(st, ly, mod, d2, b2, n, "".join(m for m in "ABS" if m in marks), buf)
                 for (st, ly, mod, buf), (d2, b2, n, marks) in sums.items())  # fmt: skip
    return SeriesPair(
        a, b, rows, r.compared, r.differing, len(r.only_in_a), len(r.only_in_b), r.shape_mismatches
    )
