"""``zckpt diff``: compare two checkpoints of any supported formats, tensor by tensor, streamed.

What is compared
    Model tensors (params, frozen params, buffers) of both sides, matched by key after the
    ``map`` renames; with ``include_optimizer`` also optimizer states (``"<param>:<state>"``) when
    *both* sides have some. ``keys`` globs restrict the comparison. A pair of tensors is compared once:
    when a key resolves to the same (owner in A, owner in B) pair as an earlier key it is skipped and
    counted in ``tied_skipped``.

Tied aliases
    A recorded alias (``meta.tied``: ``lm_head.weight`` -> ``transformer.wte.weight``) that the other
    side lacks is matched via its owner when the other side holds the owner (HF's and safetensors'
    convention: a tied weight is stored once, ``save_model`` drops the alias): A's alias is compared
    with B's owner, which is then usually a repeat of the owners' own pair (skipped). Those keys are
    not "only in" a side; ``aliases_matched`` lists them. An alias whose owner the other side lacks
    stays one-sided; an alias name the other side stores as a tensor of its own is compared with it.
    The pairing is ``zckpt.ops.diff_keys``.

Selecting options
    A ``keys`` glob that matches no key of either side, a ``map`` entry that renames no key of A, and
    ``include_optimizer`` when neither side holds optimizer states are errors (``KeyMappingError``),
    never an empty comparison that reads as equal (``zckpt.ops.select``). ``include_optimizer`` with
    optimizer states on one side only compares the model tensors and says so in ``notes``.

Key mapping
    ``map`` entries ``OLD=NEW`` rename **A's** keys into B's namespace: a key of A that starts with
    ``OLD`` has that prefix replaced by ``NEW`` (first matching entry wins), so ``module.=`` strips
    DeepSpeed/DDP's ``module.`` and ``=model.`` adds a prefix. ``keys`` globs (fnmatch) match the
    mapped key or, for optimizer states, its parameter name. Reported ``key`` is A's original key;
    ``key_b`` is B's key when it differs; the text report shows a renamed key that is only in A as
    ``A's key -> its name in B's namespace``, as its table does.

Precision
    Values are read exactly as ``Checkpoint.read`` returns them (each side in its logical dtype), then
    compared in float64 (``zckpt.ops.diff_values``; in numpy, without importing torch, where every pair's
    bytes can be read so: ``zckpt.ops.diff_numpy``), chunk by chunk, so memory stays bounded for any
    tensor size; padding is never read. ``compare_dtype`` picks the dtype a pair is compared at first:
    ``auto`` (default) compares a pair stored in two float dtypes at the narrower one, or at B's when
    neither holds the other (A's fp32 masters cast to bf16 against a bf16 export: what ``consolidate``'s
    default writes, so a checkpoint and its export are equal); ``full`` compares every pair as stored
    (every rounding difference shows); ``fp32``/``bf16``/``fp16`` cast every floating side to that dtype.
    Each cast is reported (``TensorDiff.compared_as``, the summary's "A cast to bfloat16 as stored in B").

Metrics (per tensor, over the elements finite on both sides unless stated)
    ``max_abs_diff = max|a-b|``; ``max_rel_diff = max |a-b|/|b|`` (0/0 counts as 0, x/0 as +inf);
    ``rel_l2 = ||a-b|| / ||b||`` (0 when both are 0, +inf when only ||b|| is 0): **the** relative change,
    B the reference as for ``rtol`` and ``max_rel_diff``; tables, JSON, ``--plot`` and ``--series`` all
    show this one;
    ``cosine = <a,b> / (||a|| ||b||)`` (``None`` when either norm is 0);
    ``changed``: elements with ``|a-b| > atol + rtol*|b|`` — over *all* elements, where NaN equals
    NaN and an infinity equals the same infinity, anything else non-finite vs finite is a change;
    ``nan_a/nan_b/inf_a/inf_b``: counts on each side; ``norm_a/norm_b/norm_diff`` from the same
    accumulators.

Pictures
    ``DiffResult.plot(path)`` draws the result (``zckpt.ops.plots``): layer x role heatmaps of
    ``rel_l2`` and cosine, from these statistics alone (no second pass over the tensors).

Equality
    The result is equal when no key is only on one side, no shapes differ and no compared element
    changed. A dtype mismatch (a tensor stored in bf16 on one side and fp32 on the other) is reported
    (``dtype_mismatches``: of them ``dtype_only`` hold exactly the same values as compared, ``dtype_within``
    differ within the tolerance, ``dtype_differ`` beyond it) but is not a difference of its own unless
    ``strict_dtype``. The summary never calls values the same unless every element is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zckpt.checkpoint import Checkpoint
from zckpt.dtypes import DType
from zckpt.errors import KeyMappingError, ZckptError
from zckpt.formats import open_checkpoint, registry
from zckpt.model import Role
from zckpt.ops.diff_keys import match_keys, rename
from zckpt.ops.diff_report import CHUNK, Pair, TensorDiff, parse_compare_dtype
from zckpt.ops.progress import bar as progress_bar
from zckpt.ops.scope import storage_scoped
from zckpt.storage import checks
from zckpt.storage.session import Storage

SCHEMA_VERSION = 1
PRECISION = "float64"


@dataclass(frozen=True)
class Side:
    """Which checkpoint one side of the diff is."""

    path: str
    format: str
    tag: str | None
    step: int | None

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "tag": self.tag, "step": self.step}


@dataclass(frozen=True)
class DiffResult:
    """Everything ``diff`` found. ``tensors`` is sorted most-changed first (and cut to ``top``)."""

    a: Side
    b: Side
    atol: float
    rtol: float
    strict_dtype: bool
    include_optimizer: bool
    optimizer_compared: bool
    only_in_a: tuple[str, ...]
    only_in_b: tuple[str, ...]
    compared: int
    differing: int
    shape_mismatches: int
    dtype_mismatches: int
    tied_skipped: int
    tensors: tuple[TensorDiff, ...]
    top: int | None = None
    maps: tuple[tuple[str, str], ...] = field(default=())
    dtype_only: int = 0
    """Dtype mismatches whose values (as compared: after the cast ``compare_dtype`` makes) are exactly the
    same."""
    dtype_within: int = 0
    """Dtype mismatches whose values differ, but nowhere beyond the tolerance."""
    dtype_differ: int = 0
    """Dtype mismatches (same shape) whose values differ beyond the tolerance."""
    compare_dtype: str = "full"
    """``auto``, ``full``, ``fp32``, ``bf16`` or ``fp16`` (module doc)."""
    casts: tuple[tuple[str, int, int], ...] = field(default=())
    """``(how, pairs, of them dtype mismatches)`` for each cast made before comparing
    (``"A cast to bfloat16 as stored in B"``), most pairs first."""
    aliases_matched: tuple[tuple[str, str, str], ...] = field(default=())
    """``(side, alias, owner)``: a tied alias of ``side`` ("A" or "B") the other side lacks, matched via
    the owner it holds (names in each side's own namespace)."""
    notes: tuple[str, ...] = field(default=())
    """What explains a difference, when zckpt can tell (e.g. the only missing tensors are frozen params)."""

    @property
    def equal(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.differing)

    def summary(self) -> str:
        verdict = "EQUAL" if self.equal else "DIFFERENT"
        parts = [f"{self.compared} tensor{'s' * (self.compared != 1)} compared, {self.differing} differ"]
        if self.shape_mismatches:
            parts.append(f"{self.shape_mismatches} shape mismatch{'es' * (self.shape_mismatches != 1)}")
        if self.dtype_mismatches:
            n = self.dtype_mismatches
            parts.append(f"{n} dtype mismatch{'es' * (n != 1)} ({self._dtype_note()})")
        for how, k, mism in self.casts:
            if k > mism:  # pairs stored in one dtype, cast by an explicit compare dtype
                parts.append(f"{k - mism} of one dtype compared as {how}")
        if self.aliases_matched:
            n = len(self.aliases_matched)
            parts.append(f"{n} tied alias{'es' * (n != 1)} matched via {'their' if n != 1 else 'its'} owner")
        parts.append(f"{len(self.only_in_a)} only in A, {len(self.only_in_b)} only in B")
        tol = f"atol={self.atol:g}, rtol={self.rtol:g}"
        return f"{', '.join(parts)}: {verdict} ({tol}, compared in {PRECISION})"

    def _dtype_note(self) -> str:
        """How the dtype mismatches were compared (the cast, when one was made) and what came out: exactly
        the same values, values within tolerance, or values that differ."""
        n = self.dtype_mismatches
        hows = [(how, mism) for how, _, mism in self.casts if mism]
        said = [f"compared as {h}" if m == n else f"{m} compared as {h}" for h, m in hows]
        if said and sum(m for _, m in hows) < n:
            said.append(f"{n - sum(m for _, m in hows)} as stored")
        same, within, differ = self.dtype_only, self.dtype_within, self.dtype_differ
        got = [f"{same} equal"] if same else []
        got += [f"{within} within tolerance"] if within else []
        got += [f"{differ} differ in value"] if differ else []
        got += [f"{n - same - within - differ} reshaped"] if n - same - within - differ else []
        head = ", ".join(said) + ": " if said else ""
        if self.strict_dtype:
            tail = "; each a difference with --strict-dtype"
        else:
            tail = "; not a difference without --strict-dtype" if not differ else ""
        return head + ", ".join(got) + tail

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "equal": self.equal,
            "a": self.a.to_json(),
            "b": self.b.to_json(),
            "options": {
                "atol": self.atol,
                "rtol": self.rtol,
                "strict_dtype": self.strict_dtype,
                "ignore_dtype": not self.strict_dtype,
                "compare_dtype": self.compare_dtype,
                "include_optimizer": self.include_optimizer,
                "map": [f"{o}={n}" for o, n in self.maps],
                "top": self.top,
                "precision": PRECISION,
            },
            "summary": {
                "compared": self.compared,
                "differing": self.differing,
                "shape_mismatches": self.shape_mismatches,
                "dtype_mismatches": self.dtype_mismatches,
                "dtype_only": self.dtype_only,
                "dtype_within": self.dtype_within,
                "dtype_differ": self.dtype_differ,
                "casts": [{"how": h, "pairs": k, "dtype_mismatches": m} for h, k, m in self.casts],
                "aliases_matched": len(self.aliases_matched),
                "only_in_a": len(self.only_in_a),
                "only_in_b": len(self.only_in_b),
                "tied_skipped": self.tied_skipped,
                "optimizer_compared": self.optimizer_compared,
            },
            "only_in_a": list(self.only_in_a),
            "only_in_b": list(self.only_in_b),
            "aliases_matched": [{"side": s, "alias": a, "owner": o} for s, a, o in self.aliases_matched],
            "notes": list(self.notes),
            "tensors": [t.to_json() for t in self.tensors],
        }

    def to_text(self, top: int | None = None, max_keys: int = 20) -> str:
        """Human report: the summary line, keys on one side only, and the most-changed table
        (``top`` rows; by default the differing tensors, at most 20)."""
        lines = [self.summary()]
        only_a = tuple(k if (m := rename(k, self.maps)) == k else f"{k} -> {m}" for k in self.only_in_a)
        for label, ks in (("only in A", only_a), ("only in B", self.only_in_b)):
            if ks:
                extra = f" ... (+{len(ks) - max_keys} more)" if len(ks) > max_keys else ""
                lines.append(f"{label}: {', '.join(ks[:max_keys])}{extra}")
        lines.extend(f"note: {n}" for n in self.notes)
        rows = list(self.tensors) if top is not None else [t for t in self.tensors if t.differs]
        shown = rows[: top if top is not None else 20]
        if shown:
            lines.append(_table(shown))
        more = self.differing - sum(t.differs for t in shown)  # differing tensors the table leaves out
        if more > 0:
            lines.append(f"... {more} more differ (use --top K or --json)")
        return "\n".join(lines)

    def plot(self, path: str | Path, *, top: int = 20) -> Path:
        """Draw the result to ``path`` (``.png``, ``.svg`` or a self-contained ``.html``): layer x role
        heatmaps of ``||A-B||/||B||`` (``rel_l2``) and cosine, non-layer tensors in a strip, the ``top``
        most-changed tensors as bars; one-sided, reshaped and retyped tensors marked. Needs matplotlib
        (``zckpt[plot]``). Draws the tensors this result holds: all unless ``diff`` was given ``top``."""
        from zckpt.ops.plots.files import plot_diff

        return plot_diff(self, path, top=top)


@storage_scoped
def diff(
    a: str | Path | Checkpoint,
    b: str | Path | Checkpoint,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    include_optimizer: bool = False,
    keys: Sequence[str] | None = None,
    map: Sequence[str | tuple[str, str]] = (),
    top: int | None = None,
    strict_dtype: bool = False,
    compare_dtype: str | DType | Any = "auto",  # Any: a torch.dtype too, without importing torch here
    tag_a: str | None = None,
    tag_b: str | None = None,
    progress: bool = True,
    trust_pickle: bool = False,
    chunk: int = CHUNK,
    verify_data: bool = True,
    storage_options: Mapping[str, str] | None = None,
    storage: Storage | None = None,
) -> DiffResult:
    """Compare checkpoints ``a`` and ``b`` (paths or opened ``Checkpoint`` objects) tensor by tensor.

    Args:
        atol, rtol: an element is unchanged when ``|a-b| <= atol + rtol*|b|`` (B is the reference).
        include_optimizer: also compare optimizer states when both sides have them (neither side:
            ``KeyMappingError``; one side: the model is compared and ``notes`` says so).
        keys: fnmatch globs; only matching keys are compared or listed. A glob matching no key of A or B
            is a ``KeyMappingError``.
        map: ``"OLD=NEW"`` (or ``(OLD, NEW)``) prefix renames applied to A's keys; an entry that renames
            no key of A is a ``KeyMappingError``.
        top: keep only the ``top`` most-changed tensors in ``tensors`` (counts cover all).
        strict_dtype: count a dtype mismatch as a difference even when the values agree.
        compare_dtype: ``auto`` (a pair stored in two float dtypes is compared at the narrower, or at B's
            when neither holds the other, cast as ``consolidate`` casts: a checkpoint and its 16-bit export
            are equal),
            ``full`` (every pair as stored: every rounding shows), or ``fp32``/``bf16``/``fp16`` (every
            floating side cast to it first). Every cast is reported.
        progress: tqdm bar on stderr (only when stderr is a terminal).
        verify_data: compare the checksums the inputs record over the bytes read (a damaged file is an
            error, not a difference).

    Returns:
        A ``DiffResult``; ``result.equal`` says whether the checkpoints match within tolerance.
    """
    if atol < 0 or rtol < 0 or math.isnan(atol) or math.isnan(rtol):
        raise ValueError(f"atol and rtol must be >= 0, got atol={atol}, rtol={rtol}")
    if top is not None and top < 0:
        raise ValueError(f"top must be >= 0, got {top}")
    maps = tuple(_parse_map(m) for m in map)
    mode = parse_compare_dtype(compare_dtype)
    ca, close_a = _open(a, tag_a, trust_pickle, include_optimizer)
    try:
        cb, close_b = _open(b, tag_b, trust_pickle, include_optimizer)
        try:
            with checks.verifying(verify_data):
                xa, xb = _hf_names(ca, cb, include_optimizer)
                return _diff(xa, xb, atol, rtol, include_optimizer, keys, maps, top, strict_dtype, progress,
                             chunk, mode)  # fmt: skip
        finally:
            if close_b:
                cb.close()
    finally:
        if close_a:
            ca.close()


def _open(
    x: str | Path | Checkpoint, tag: str | None, trust_pickle: bool, optim: bool
) -> tuple[Checkpoint, bool]:
    """``x`` opened (model tensors and step only, unless optimizer states are compared: a DCP checkpoint
    then opens a third of its archives); whether to close it after."""
    if isinstance(x, Checkpoint):
        return x, False
    return open_checkpoint(x, tag=tag, trust_pickle=trust_pickle, model_only=not optim), True


def _hf_names(a: Checkpoint, b: Checkpoint, optim: bool) -> tuple[Checkpoint, Checkpoint]:
    """A checkpoint under its format's own names (Megatron) beside its Hugging Face export: that side under
    HF names (``Format.hf_model``), when the two share no name and the HF names are the other side's."""
    if optim or not set(a).isdisjoint(b):
        return a, b
    for x, y in ((a, b), (b, a)):
        fmt = registry().get(x.meta.format)
        try:
            got = fmt.hf_model(x) if fmt is not None else None
        except ZckptError:
            got = None
        if got is not None and not set(got[0]).isdisjoint(y):
            return (got[0], b) if x is a else (a, got[0])
    return a, b


def _parse_map(m: str | tuple[str, str]) -> tuple[str, str]:
    if isinstance(m, tuple):
        return m
    if "=" not in m:
        raise KeyMappingError(
            f"--map {m!r}: expected OLD=NEW",
            hint="e.g. --map module.= strips a `module.` prefix from A's keys",
        )
    old, new = m.split("=", 1)
    return old, new


def _diff(
    ca: Checkpoint,
    cb: Checkpoint,
    atol: float,
    rtol: float,
    include_optimizer: bool,
    globs: Sequence[str] | None,
    maps: tuple[tuple[str, str], ...],
    top: int | None,
    strict_dtype: bool,
    progress: bool,
    chunk: int,
    mode: str,
) -> DiffResult:
    m = match_keys(ca, cb, globs, maps, include_optimizer)
    pairs = list(m.pairs)
    total = sum(ea.numel for _, _, ea, eb in pairs if ea.shape == eb.shape)
    bar = progress_bar(total, "diff", enabled=progress, unit="el")
    with bar:
        results = _compare(pairs, atol, rtol, strict_dtype, chunk, bar, mode)
    results.sort(key=TensorDiff.sort_key)
    mism = [t for t in results if t.dtype_a != t.dtype_b and t.shape_a == t.shape_b]
    casts: dict[str, list[int]] = {}
    for t in results:
        if t.cast is not None:
            c = casts.setdefault(t.cast, [0, 0])
            c[0] += 1
            c[1] += t.dtype_a != t.dtype_b
    return DiffResult(
        notes=_notes(ca, cb, m.only_a, m.only_b, results) + m.notes,
        a=_side(ca),
        b=_side(cb),
        atol=atol,
        rtol=rtol,
        strict_dtype=strict_dtype,
        include_optimizer=include_optimizer,
        optimizer_compared=m.with_optim,
        only_in_a=m.only_a,
        only_in_b=m.only_b,
        compared=len(results),
        differing=sum(t.differs for t in results),
        shape_mismatches=sum("shape" in t.reasons for t in results),
        dtype_mismatches=sum(t.dtype_a != t.dtype_b for t in results),
        dtype_only=sum(t.identical for t in mism),
        dtype_within=sum(not t.identical and not t.changed for t in mism),
        dtype_differ=sum(bool(t.changed) for t in mism),
        compare_dtype=mode,
        casts=tuple(sorted(((h, k, m) for h, (k, m) in casts.items()), key=lambda c: (-c[1], c[0]))),
        aliases_matched=m.aliases,
        tied_skipped=m.tied_skipped,
        tensors=tuple(results if top is None else results[:top]),
        top=top,
        maps=maps,
    )


def _compare(
    pairs: list[Pair], atol: float, rtol: float, strict_dtype: bool, chunk: int, bar: Any, mode: str
) -> list[TensorDiff]:
    """The pairs' values compared in numpy where every pair's bytes can be read so (``diff_numpy.usable``:
    no torch imported), else with torch (``diff_values``); the same figures either way."""
    from zckpt.ops import diff_numpy

    if diff_numpy.usable(pairs, mode):
        return diff_numpy.compare_all(pairs, atol, rtol, strict_dtype, chunk, bar, mode)
    from zckpt.ops.diff_values import compare_all

    return compare_all(pairs, atol, rtol, strict_dtype, chunk, bar, mode)


def _notes(
    ca: Checkpoint, cb: Checkpoint, only_a: tuple[str, ...], only_b: tuple[str, ...], res: list[TensorDiff]
) -> tuple[str, ...]:
    """Explain a one-sided difference that has a known innocent cause: every tensor missing on one side is a
    frozen parameter of the other and everything both sides hold is equal (DeepSpeed's ``zero_to_fp32.py``
    leaves frozen params of ZeRO-0/1 checkpoints out of its output). The verdict stays DIFFERENT."""
    if any(t.differs for t in res):
        return ()
    for here, missing, there, other in (("A", only_a, ca, only_b), ("B", only_b, cb, only_a)):
        if missing and not other and all(there.entry(k).role is Role.FROZEN for k in missing):
            side = "B" if here == "A" else "A"
            return (
                f"every tensor missing from {side} is a frozen parameter of {here}, and every tensor both "
                f"hold is equal: {side} looks like an export that leaves frozen params out (DeepSpeed's "
                f"zero_to_fp32.py does for ZeRO-0/1 checkpoints); compare the rest with --keys",
            )
    return ()


def _side(c: Checkpoint) -> Side:
    return Side(path=c.meta.path, format=c.meta.format, tag=c.meta.tag, step=c.meta.step)


def _fmt(x: float | None, pct: bool = False) -> str:
    if x is None:
        return "-"
    if pct:
        return f"{100 * x:.3g}%"
    return f"{x:.3g}"


def _table(rows: list[TensorDiff]) -> str:
    head = ("key", "shape", "dtype", "max_abs", "max_rel", "rel_l2", "cosine", "changed", "nan a/b", "why")
    body = []
    for t in rows:
        shape = (
            "x".join(map(str, t.shape_a))
            if t.shape_a == t.shape_b
            else f"{list(t.shape_a)}!={list(t.shape_b)}"
        )
        dtype = t.dtype_a if t.dtype_a == t.dtype_b else f"{t.dtype_a}!={t.dtype_b}"
        if t.compared_as is not None:
            dtype += f" (as {t.compared_as})"
        key = t.key if t.key_b is None else f"{t.key} -> {t.key_b}"
        nans = "-" if t.nan_a is None else f"{t.nan_a}/{t.nan_b}"
        body.append((
            key, shape or "scalar", dtype, _fmt(t.max_abs_diff), _fmt(t.max_rel_diff), _fmt(t.rel_l2),
            _fmt(t.cosine), _fmt(t.fraction_changed, pct=True), nans, ",".join(t.reasons) or "-",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i < 3 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*r).rstrip() for r in [head, *body])
