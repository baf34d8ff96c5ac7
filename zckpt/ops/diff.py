"""``zckpt diff``: compare two checkpoints of any supported formats, tensor by tensor, streamed.

What is compared
    Model tensors (params, frozen params, buffers) of both sides, matched by key after the
    ``map`` renames; with ``include_optimizer`` also optimizer states (``"<param>:<state>"``) when
    *both* sides have some. ``keys`` globs restrict the comparison. Tied aliases appear in the key
    lists (only-in-A / only-in-B) but a pair of tensors is compared once: when a key resolves to the
    same (owner in A, owner in B) pair as an earlier key it is skipped and counted in ``tied_skipped``.

Key mapping
    ``map`` entries ``OLD=NEW`` rename **A's** keys into B's namespace: a key of A that starts with
    ``OLD`` has that prefix replaced by ``NEW`` (first matching entry wins), so ``module.=`` strips
    DeepSpeed/DDP's ``module.`` and ``=model.`` adds a prefix. ``keys`` globs (fnmatch) match the
    mapped key or, for optimizer states, its parameter name. Reported ``key`` is A's original key;
    ``key_b`` is B's key when it differs.

Precision
    Values are read exactly as ``Checkpoint.read`` returns them (each side in its logical dtype),
    then upcast to **float64**, which represents every value of every float dtype up to 32 bits (and
    of every integer up to 2**53) exactly; all metrics and tolerance tests are computed there, and
    all accumulations are in float64. Integer/bool tensors on both sides are compared exactly
    (``a != b`` in int64; tolerances do not apply). Work is done in chunks of ``zckpt.ops.stats.CHUNK``
    elements, so memory stays bounded for any tensor size; padding is never read.

    Fast path (same results): a chunk pair with the same float dtype and the same bits (compared
    as integers) moves no difference metric, so no float64 pass is made over it; one dot product
    in its own dtype (or isnan/isinf when that is not finite or is zero) gives its NaN/Inf counts
    and whether it is nonzero. A tensor bit-identical in every chunk gets ``cosine = 1`` (``None``
    when no finite element is nonzero) without summing norms; when a later chunk differs, the
    earlier identical chunks are re-read and their float64 sums of squares added. Differing chunks
    take the float64 path above; a finite float64 sum of squares of each side stands in for the
    per-element finiteness test. The next chunk pair is read on a worker thread meanwhile.

Metrics (per tensor, over the elements finite on both sides unless stated)
    ``max_abs_diff = max|a-b|``; ``max_rel_diff = max |a-b|/|b|`` (0/0 counts as 0, x/0 as +inf);
    ``rel_l2 = ||a-b|| / ||b||`` (0 when both are 0, +inf when only ||b|| is 0);
    ``cosine = <a,b> / (||a|| ||b||)`` (``None`` when either norm is 0);
    ``changed``: elements with ``|a-b| > atol + rtol*|b|`` — over *all* elements, where NaN equals
    NaN and an infinity equals the same infinity, anything else non-finite vs finite is a change;
    ``nan_a/nan_b/inf_a/inf_b``: counts on each side.

Equality
    The result is equal when no key is only on one side, no shapes differ, no dtypes differ (unless
    ``ignore_dtype``, which still reports them) and no compared element changed.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from zckpt.checkpoint import Checkpoint
from zckpt.errors import KeyMappingError
from zckpt.formats import open_checkpoint
from zckpt.io.spans import aligned_views
from zckpt.model import STATE_SEP, TensorEntry, dtype_name
from zckpt.ops.progress import bar as progress_bar
from zckpt.ops.stats import CHUNK, is_exact, iter_chunks

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
class TensorDiff:
    """The comparison of one tensor pair. Value metrics are ``None`` when the shapes differ."""

    key: str
    key_b: str | None
    role: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    numel: int
    max_abs_diff: float | None
    max_rel_diff: float | None
    rel_l2: float | None
    cosine: float | None
    changed: int | None
    nan_a: int | None
    nan_b: int | None
    inf_a: int | None
    inf_b: int | None
    differs: bool
    reasons: tuple[str, ...]
    """Subset of ``("shape", "dtype", "values")``."""

    @property
    def fraction_changed(self) -> float | None:
        if self.changed is None:
            return None
        return self.changed / self.numel if self.numel else 0.0

    def sort_key(self) -> tuple[int, float, float, str]:
        """Most changed first: differing before equal, then rel L2, then fraction changed."""
        if "shape" in self.reasons:
            score = math.inf
        else:
            score = self.rel_l2 if self.rel_l2 is not None and not math.isnan(self.rel_l2) else math.inf
        return (0 if self.differs else 1, -score, -(self.fraction_changed or 0.0), self.key)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "key_b": self.key_b,
            "role": self.role,
            "shape_a": list(self.shape_a),
            "shape_b": list(self.shape_b),
            "dtype_a": self.dtype_a,
            "dtype_b": self.dtype_b,
            "numel": self.numel,
            "max_abs_diff": _real(self.max_abs_diff),
            "max_rel_diff": _real(self.max_rel_diff),
            "rel_l2": _real(self.rel_l2),
            "cosine": _real(self.cosine),
            "changed": self.changed,
            "fraction_changed": _real(self.fraction_changed),
            "nan_a": self.nan_a,
            "nan_b": self.nan_b,
            "inf_a": self.inf_a,
            "inf_b": self.inf_b,
            "differs": self.differs,
            "reasons": list(self.reasons),
        }


@dataclass(frozen=True)
class DiffResult:
    """Everything ``diff`` found. ``tensors`` is sorted most-changed first (and cut to ``top``)."""

    a: Side
    b: Side
    atol: float
    rtol: float
    ignore_dtype: bool
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

    @property
    def equal(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.differing)

    def summary(self) -> str:
        verdict = "EQUAL" if self.equal else "DIFFERENT"
        parts = [f"{self.compared} tensors compared, {self.differing} differ"]
        if self.shape_mismatches:
            parts.append(f"{self.shape_mismatches} shape mismatches")
        if self.dtype_mismatches:
            ign = " (ignored)" if self.ignore_dtype else ""
            parts.append(f"{self.dtype_mismatches} dtype mismatches{ign}")
        parts.append(f"{len(self.only_in_a)} only in A, {len(self.only_in_b)} only in B")
        tol = f"atol={self.atol:g}, rtol={self.rtol:g}"
        return f"{', '.join(parts)}: {verdict} ({tol}, compared in {PRECISION})"

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "equal": self.equal,
            "a": self.a.to_json(),
            "b": self.b.to_json(),
            "options": {
                "atol": self.atol,
                "rtol": self.rtol,
                "ignore_dtype": self.ignore_dtype,
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
                "only_in_a": len(self.only_in_a),
                "only_in_b": len(self.only_in_b),
                "tied_skipped": self.tied_skipped,
                "optimizer_compared": self.optimizer_compared,
            },
            "only_in_a": list(self.only_in_a),
            "only_in_b": list(self.only_in_b),
            "tensors": [t.to_json() for t in self.tensors],
        }

    def to_text(self, top: int | None = None, max_keys: int = 20) -> str:
        """Human report: the summary line, keys on one side only, and the most-changed table
        (``top`` rows; by default the differing tensors, at most 20)."""
        lines = [self.summary()]
        for label, ks in (("only in A", self.only_in_a), ("only in B", self.only_in_b)):
            if ks:
                shown = ", ".join(ks[:max_keys])
                more = f" ... (+{len(ks) - max_keys} more)" if len(ks) > max_keys else ""
                lines.append(f"{label}: {shown}{more}")
        rows = list(self.tensors) if top is not None else [t for t in self.tensors if t.differs]
        limit = top if top is not None else 20
        if rows[:limit]:
            lines.append(_table(rows[:limit]))
        if len(rows) > limit:
            lines.append(f"... {len(rows) - limit} more (use --top K or --json)")
        return "\n".join(lines)


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
    ignore_dtype: bool = False,
    tag_a: str | None = None,
    tag_b: str | None = None,
    progress: bool = True,
    trust_pickle: bool = False,
    chunk: int = CHUNK,
) -> DiffResult:
    """Compare checkpoints ``a`` and ``b`` (paths or opened ``Checkpoint`` objects) tensor by tensor.

    Args:
        atol, rtol: an element is unchanged when ``|a-b| <= atol + rtol*|b|`` (B is the reference).
        include_optimizer: also compare optimizer states when both sides have them.
        keys: fnmatch globs; only matching keys are compared or listed.
        map: ``"OLD=NEW"`` (or ``(OLD, NEW)``) prefix renames applied to A's keys.
        top: keep only the ``top`` most-changed tensors in ``tensors`` (counts cover all).
        ignore_dtype: dtype mismatches are still reported but do not make the result different.
        progress: tqdm bar on stderr (only when stderr is a terminal).

    Returns:
        A ``DiffResult``; ``result.equal`` says whether the checkpoints match within tolerance.
    """
    if atol < 0 or rtol < 0 or math.isnan(atol) or math.isnan(rtol):
        raise ValueError(f"atol and rtol must be >= 0, got atol={atol}, rtol={rtol}")
    if top is not None and top < 0:
        raise ValueError(f"top must be >= 0, got {top}")
    maps = tuple(_parse_map(m) for m in map)
    ca, close_a = _open(a, tag_a, trust_pickle)
    try:
        cb, close_b = _open(b, tag_b, trust_pickle)
        try:
            return _diff(
                ca, cb, atol, rtol, include_optimizer, keys, maps, top, ignore_dtype, progress, chunk
            )
        finally:
            if close_b:
                cb.close()
    finally:
        if close_a:
            ca.close()


def _open(x: str | Path | Checkpoint, tag: str | None, trust_pickle: bool) -> tuple[Checkpoint, bool]:
    if isinstance(x, Checkpoint):
        return x, False
    return open_checkpoint(x, tag=tag, trust_pickle=trust_pickle), True


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


def _rename(key: str, maps: tuple[tuple[str, str], ...]) -> str:
    for old, new in maps:
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def _selected(key: str, globs: Sequence[str] | None) -> bool:
    if not globs:
        return True
    name = key.split(STATE_SEP, 1)[0]
    return any(fnmatch.fnmatchcase(key, g) or fnmatch.fnmatchcase(name, g) for g in globs)


def _keys(c: Checkpoint, with_optim: bool) -> list[str]:
    return list(c) + (c.optim_keys() if with_optim else [])


def _diff(
    ca: Checkpoint,
    cb: Checkpoint,
    atol: float,
    rtol: float,
    include_optimizer: bool,
    globs: Sequence[str] | None,
    maps: tuple[tuple[str, str], ...],
    top: int | None,
    ignore_dtype: bool,
    progress: bool,
    chunk: int,
) -> DiffResult:
    with_optim = include_optimizer and bool(ca.optim_keys()) and bool(cb.optim_keys())
    a_of: dict[str, str] = {}  # key in B's namespace -> A's key
    for k in _keys(ca, with_optim):
        m = _rename(k, maps)
        if m in a_of:
            raise KeyMappingError(
                f"--map sends both {a_of[m]!r} and {k!r} to {m!r}", hint="use more specific OLD prefixes"
            )
        a_of[m] = k
    b_keys = [k for k in _keys(cb, with_optim) if _selected(k, globs)]
    b_set = set(b_keys)
    only_a = tuple(a_of[m] for m in a_of if m not in b_set and _selected(m, globs))
    only_b = tuple(k for k in b_keys if k not in a_of)
    pairs: list[_Pair] = []
    seen: set[tuple[str, str]] = set()
    tied_skipped = 0
    for kb in b_keys:
        if kb not in a_of:
            continue
        ea, eb = ca.entry(a_of[kb]), cb.entry(kb)
        if (ea.key, eb.key) in seen:
            tied_skipped += 1
            continue
        seen.add((ea.key, eb.key))
        pairs.append((a_of[kb], kb, ea, eb))

    total = sum(ea.numel for _, _, ea, eb in pairs if ea.shape == eb.shape)
    bar = progress_bar(total, "diff", enabled=progress, unit="el")
    results: list[TensorDiff] = []
    work = _Work()
    with bar:
        stream = _chunk_stream(pairs, chunk)
        pending = _Pending(stream)
        for i, (ka, kb, ea, eb) in enumerate(pairs):
            chunks = pending.of(i)
            results.append(_compare(ka, kb, ea, eb, atol, rtol, ignore_dtype, chunks, chunk, work, bar))
    results.sort(key=TensorDiff.sort_key)
    return DiffResult(
        a=_side(ca),
        b=_side(cb),
        atol=atol,
        rtol=rtol,
        ignore_dtype=ignore_dtype,
        include_optimizer=include_optimizer,
        optimizer_compared=with_optim,
        only_in_a=only_a,
        only_in_b=only_b,
        compared=len(results),
        differing=sum(t.differs for t in results),
        shape_mismatches=sum("shape" in t.reasons for t in results),
        dtype_mismatches=sum(t.dtype_a != t.dtype_b for t in results),
        tied_skipped=tied_skipped,
        tensors=tuple(results if top is None else results[:top]),
        top=top,
        maps=maps,
    )


def _side(c: Checkpoint) -> Side:
    return Side(path=c.meta.path, format=c.meta.format, tag=c.meta.tag, step=c.meta.step)


class _Acc:
    """float64 accumulators of one tensor pair."""

    __slots__ = ("max_abs", "max_rel", "d2", "a2", "b2", "ab", "changed", "nan_a", "nan_b", "inf_a", "inf_b")

    def __init__(self) -> None:
        self.max_abs = self.max_rel = 0.0
        self.d2 = self.a2 = self.b2 = self.ab = 0.0
        self.changed = self.nan_a = self.nan_b = self.inf_a = self.inf_b = 0


def _compare(
    ka: str,
    kb: str,
    ea: TensorEntry,
    eb: TensorEntry,
    atol: float,
    rtol: float,
    ignore_dtype: bool,
    chunks: Iterator[tuple[torch.Tensor, torch.Tensor]],
    chunk: int,
    work: _Work,
    bar: tqdm,
) -> TensorDiff:
    """Compare one pair; ``chunks`` yields its aligned chunk pairs (nothing when the shapes differ)."""
    reasons: list[str] = []
    dtype_differs = ea.dtype != eb.dtype
    if dtype_differs and not ignore_dtype:
        reasons.append("dtype")
    common: dict[str, Any] = dict(
        key=ka,
        key_b=kb if kb != ka else None,
        role=ea.role.value,
        shape_a=ea.shape,
        shape_b=eb.shape,
        dtype_a=dtype_name(ea.dtype),
        dtype_b=dtype_name(eb.dtype),
        numel=ea.numel,
    )
    if ea.shape != eb.shape:
        reasons.insert(0, "shape")
        return TensorDiff(
            **common, max_abs_diff=None, max_rel_diff=None, rel_l2=None, cosine=None, changed=None,
            nan_a=None, nan_b=None, inf_a=None, inf_b=None, differs=True, reasons=tuple(reasons),
        )  # fmt: skip
    exact = is_exact(ea.dtype) and is_exact(eb.dtype)
    acc = _Acc()
    owed = 0  # leading bit-identical chunks whose float64 norms are not summed yet
    nonzero = False  # some finite element of those chunks is nonzero
    for xa, xb in chunks:
        if not exact and owed >= 0 and _bits_equal(xa, xb):
            nonzero |= _scan_same(xa, acc)
            owed += 1
        else:
            if owed > 0:  # a chunk differs after all: sum the owed norms (re-reads A's chunks)
                for _, x in itertools.islice(iter_chunks(ea, chunk), owed):
                    _fold_same(x, acc, work, count=False)
            owed = -1
            _fold(xa, xb, exact, atol, rtol, acc, work)
        bar.update(xa.numel())
    if acc.changed:
        reasons.append("values")
    na, nb = math.sqrt(acc.a2), math.sqrt(acc.b2)
    nd = math.sqrt(acc.d2)
    rel_l2 = (nd / nb) if nb > 0 else (0.0 if nd == 0 else math.inf)
    cosine = acc.ab / (na * nb) if na > 0 and nb > 0 else None
    if owed > 0:  # every chunk bit-identical: <a,b> = ||a|| ||b|| without summing anything
        cosine = 1.0 if nonzero else None
    if cosine is not None:
        cosine = max(-1.0, min(1.0, cosine))
    return TensorDiff(
        **common,
        max_abs_diff=acc.max_abs,
        max_rel_diff=acc.max_rel,
        rel_l2=rel_l2,
        cosine=cosine,
        changed=acc.changed,
        nan_a=acc.nan_a,
        nan_b=acc.nan_b,
        inf_a=acc.inf_a,
        inf_b=acc.inf_b,
        differs=bool(reasons),
        reasons=tuple(reasons),
    )


_Pair = tuple[str, str, TensorEntry, TensorEntry]


def _chunk_stream(pairs: list[_Pair], chunk: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(pair index, chunk of A, chunk of B)`` over every same-shape pair, in order: zero-copy views
    of both files' page cache (see ``zckpt.io.spans.aligned_views``)."""
    for i, (_, _, ea, eb) in enumerate(pairs):
        if ea.shape == eb.shape:
            for xa, xb in aligned_views(ea, eb, chunk):
                yield i, xa, xb


class _Pending:
    """Chunk pairs of one tensor pair, drawn from the shared prefetched stream."""

    def __init__(self, stream: Iterator[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        self._stream = stream
        self._head: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def of(self, index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            if self._head is None:
                self._head = next(self._stream, None)
                if self._head is None:
                    return
            i, xa, xb = self._head
            if i != index:
                return
            self._head = None
            yield xa, xb


class _Work:
    """Reusable float64 working buffers (fresh multi-MiB allocations cost a page fault per page)."""

    def __init__(self) -> None:
        self._a = torch.empty(0, dtype=torch.float64)
        self._b = torch.empty(0, dtype=torch.float64)

    def f64(self, xa: torch.Tensor, xb: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = xa.numel()
        if self._a.numel() < n:
            self._a = torch.empty(n, dtype=torch.float64)
            self._b = torch.empty(n, dtype=torch.float64)
        a = self._a[:n].copy_(xa)
        b = self._b[:n] if xb is None else self._b[:n].copy_(xb)
        return a, b


def _bits_equal(xa: torch.Tensor, xb: torch.Tensor) -> bool:
    """Both chunks hold the same bit patterns (same dtype): NaN payloads and signed zeros included."""
    if xa.dtype != xb.dtype:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(xa.element_size())
    if as_int is None or xa.is_complex():
        return torch.equal(xa, xb)  # NaN-free equality is enough for the fast path
    return torch.equal(xa.view(as_int), xb.view(as_int))


def _fold(
    xa: torch.Tensor, xb: torch.Tensor, exact: bool, atol: float, rtol: float, acc: _Acc, work: _Work
) -> None:
    """Fold one chunk pair (same length, logical dtypes) into ``acc``."""
    if exact:
        ia, ib = xa.to(torch.int64), xb.to(torch.int64)
        acc.changed += int((ia != ib).sum())
        a, b = xa.to(torch.float64), xb.to(torch.float64)
        if a.numel():
            _fold_finite(a, b, True, atol, rtol, acc)
        return
    if _bits_equal(xa, xb):
        _fold_same(xa, acc, work)
        return
    a, b = work.f64(xa, xb)
    a2, b2 = float(torch.dot(a, a)), float(torch.dot(b, b))
    if math.isfinite(a2) and math.isfinite(b2):  # then every element is finite (no float64 overflow)
        _fold_finite(a, b, False, atol, rtol, acc, a2, b2)
        return
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    both = fa & fb
    if not bool(both.all()):
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        acc.nan_a += int(nan_a.sum())
        acc.nan_b += int(nan_b.sum())
        acc.inf_a += int(torch.isinf(a).sum())
        acc.inf_b += int(torch.isinf(b).sum())
        odd = ~both
        same = (a[odd] == b[odd]) | (nan_a[odd] & nan_b[odd])
        acc.changed += int((~same).sum())
        a, b = a[both], b[both]
    if a.numel():
        _fold_finite(a, b, False, atol, rtol, acc)


def _scan_same(x: torch.Tensor, acc: _Acc) -> bool:
    """Count the non-finite values of a chunk that is bit-identical on both sides, without float64
    work; return whether some finite element is nonzero. One float-dtype dot of ``x`` with itself
    answers both when it is finite and nonzero (a finite sum of squares has no NaN/Inf term)."""
    s = float(torch.dot(x, x)) if x.dtype in _DOT_DTYPES else math.nan
    if math.isfinite(s) and s > 0:
        return True
    nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
    acc.nan_a += nan
    acc.nan_b += nan
    acc.inf_a += inf
    acc.inf_b += inf
    return bool((x[torch.isfinite(x)] if nan or inf else x).any())


_DOT_DTYPES = (torch.float32, torch.float64)


def _fold_same(x: torch.Tensor, acc: _Acc, work: _Work, count: bool = True) -> None:
    """A chunk whose two sides are bit-identical: no difference metric moves, only the norms and the
    non-finite counts (the same on both sides) need the values."""
    a, _ = work.f64(x)
    s = float(torch.dot(a, a))
    if not math.isfinite(s):
        nan, inf = int(torch.isnan(a).sum()), int(torch.isinf(a).sum())
        if count:  # else ``_scan_same`` counted them already
            acc.nan_a += nan
            acc.nan_b += nan
            acc.inf_a += inf
            acc.inf_b += inf
        if nan or inf:
            a = a[torch.isfinite(a)]
            s = float(torch.dot(a, a))
    acc.a2 += s
    acc.b2 += s
    acc.ab += s


def _fold_finite(
    a: torch.Tensor,
    b: torch.Tensor,
    exact: bool,
    atol: float,
    rtol: float,
    acc: _Acc,
    a2: float | None = None,
    b2: float | None = None,
) -> None:
    """Fold float64 chunks of finite values in; ``a`` and ``b`` are scratch (overwritten)."""
    acc.a2 += float(torch.dot(a, a)) if a2 is None else a2
    acc.b2 += float(torch.dot(b, b)) if b2 is None else b2
    acc.ab += float(torch.dot(a, b))
    d = a.sub_(b)
    acc.d2 += float(torch.dot(d, d))
    d.abs_()
    acc.max_abs = max(acc.max_abs, float(d.max()))
    bab = b.abs_()
    if not exact:
        if atol == 0 and rtol == 0:
            acc.changed += int(torch.count_nonzero(d))
        else:
            tol = bab.mul(rtol).add_(atol) if rtol else atol
            acc.changed += int((d > tol).sum())
    rel = d.div_(bab).nan_to_num_(nan=0.0, posinf=math.inf)  # 0/0 -> 0, x/0 -> inf
    acc.max_rel = max(acc.max_rel, float(rel.max()))


def _real(x: float | None) -> float | str | None:
    """JSON has no NaN/Infinity: non-finite numbers become the strings "inf", "-inf", "nan"."""
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


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
        key = t.key if t.key_b is None else f"{t.key} -> {t.key_b}"
        nans = "-" if t.nan_a is None else f"{t.nan_a}/{t.nan_b}"
        body.append((
            key, shape or "scalar", dtype, _fmt(t.max_abs_diff), _fmt(t.max_rel_diff), _fmt(t.rel_l2),
            _fmt(t.cosine), _fmt(t.fraction_changed, pct=True), nans, ",".join(t.reasons) or "-",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i < 3 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*r).rstrip() for r in [head, *body])
