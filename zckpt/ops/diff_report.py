"""What a value comparison of ``zckpt diff`` reports, and at which dtype a pair is compared: shared by the
torch comparison (``zckpt.ops.diff_values``) and the numpy one (``zckpt.ops.diff_numpy``); imports neither.

``TensorDiff`` is one pair's result, ``Acc`` its float64 accumulators and ``result`` the one place that turns
them into a ``TensorDiff`` (definitions: ``zckpt.ops.diff_values``'s module doc). ``comparison_dtype`` is the
``--dtype`` policy, ``compare_threads`` how many pairs are compared at once, ``CHUNK`` the elements per chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from zckpt.dtypes import DType, is_torch_dtype
from zckpt.errors import InvalidArgument
from zckpt.model import PRECISIONS, TensorEntry, dtype_name, parse_precision
from zckpt.storage import scan
from zckpt.storage.threads import Pool

if TYPE_CHECKING:
    import torch

X = TypeVar("X")
"""One side's chunk, as a comparison backend holds it (a torch tensor; a numpy array with its dtype)."""
T = TypeVar("T")
R = TypeVar("R")

CHUNK = 1 << 20
"""Elements per chunk (1 Mi): 8 MiB per float64 working buffer, small enough to stay in cache for
the several passes diff and stats make over each chunk (measured faster than 256 Ki or 4 Mi)."""


def is_exact(dtype: DType | torch.dtype) -> bool:
    """Integer and bool dtypes: compared and summarised exactly, never with tolerances."""
    return not (dtype.is_floating_point or dtype.is_complex)


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
    norm_a: float | None = None
    """``||a||`` over the finite elements; ``None`` when the shapes differ or the fast path summed nothing
    (see the module doc)."""
    norm_b: float | None = None
    norm_diff: float | None = None
    """``||a-b||`` over the elements finite on both sides; ``None`` only when the shapes differ."""
    compared_as: str | None = None
    """The dtype both sides were cast to before comparing (see the module doc); ``None``: as stored."""

    @property
    def cast(self) -> str | None:
        """Which side(s) the comparison cast, in words (``"A cast to bfloat16 as stored in B"``), or None."""
        if self.compared_as is None:
            return None
        ca, cb = self.dtype_a != self.compared_as, self.dtype_b != self.compared_as
        if ca and cb:
            return f"both cast to {self.compared_as}"
        if ca:
            return f"A cast to {self.compared_as} as stored in B"
        return f"B cast to {self.compared_as} as stored in A" if cb else None

    @property
    def identical(self) -> bool:
        """Same shape and exactly the same values as compared (NaN where NaN, no element differs at all)."""
        return self.max_abs_diff == 0 and self.changed == 0

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
            "max_abs_diff": real(self.max_abs_diff),
            "max_rel_diff": real(self.max_rel_diff),
            "rel_l2": real(self.rel_l2),
            "cosine": real(self.cosine),
            "changed": self.changed,
            "fraction_changed": real(self.fraction_changed),
            "nan_a": self.nan_a,
            "nan_b": self.nan_b,
            "inf_a": self.inf_a,
            "inf_b": self.inf_b,
            "differs": self.differs,
            "reasons": list(self.reasons),
            "compared_as": self.compared_as,
        }


class Acc:
    """float64 accumulators of one tensor pair."""

    __slots__ = ("max_abs", "max_rel", "d2", "a2", "b2", "ab", "changed", "nan_a", "nan_b", "inf_a", "inf_b",
                 "same2", "same_known")  # fmt: skip

    def __init__(self) -> None:
        self.max_abs = self.max_rel = 0.0
        self.d2 = self.a2 = self.b2 = self.ab = 0.0
        self.changed = self.nan_a = self.nan_b = self.inf_a = self.inf_b = 0
        self.same2 = 0.0  # own-dtype sum of squares of the bit-identical chunks (fast path)
        self.same_known = True  # every such chunk gave a finite one

    def same_nonfinite(self, nan: int, inf: int) -> None:
        """NaN and inf counts of a chunk that is bit-identical on both sides: each side's."""
        self.nan_a += nan
        self.nan_b += nan
        self.inf_a += inf
        self.inf_b += inf


def start(
    ka: str, kb: str, ea: TensorEntry, eb: TensorEntry, strict_dtype: bool, cast: DType | torch.dtype | None
) -> tuple[dict[str, Any], list[str], TensorDiff | None]:
    """A pair's comparison begun: the fields each of its results holds, the reasons known before reading
    (``dtype``, with ``strict_dtype``) and, when the shapes differ, its whole result (nothing is read)."""
    reasons: list[str] = []
    if ea.dtype != eb.dtype and strict_dtype:  # else a dtype-only difference is none: values decide
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
        compared_as=None if cast is None else dtype_name(cast),
    )
    if ea.shape == eb.shape:
        return common, reasons, None
    reasons.insert(0, "shape")
    return common, reasons, TensorDiff(
        **common, max_abs_diff=None, max_rel_diff=None, rel_l2=None, cosine=None, changed=None,
        nan_a=None, nan_b=None, inf_a=None, inf_b=None, differs=True, reasons=tuple(reasons),
    )  # fmt: skip


def fold_chunks(  # noqa: PLR0913 - the loop's data, then the backend's five primitives
    common: dict[str, Any],
    reasons: list[str],
    chunks: Iterable[tuple[X, X]],
    exact: bool,
    bar: Any,
    *,
    bits_equal: Callable[[X, X], bool],
    scan_same: Callable[[X, Acc], bool],
    fold: Callable[[X, X, Acc], None],
    refold: Callable[[int, Acc], None],
    count: Callable[[X], int],
) -> TensorDiff:
    """The chunk loop of a same-shape pair, shared by the torch and the numpy comparison (each passes its own
    chunks and primitives): while the leading chunks are bit-identical they are only scanned
    (``scan_same``: NaN/inf counts, own-dtype norms; whether any is nonzero), their float64 norms owed; the
    first chunk that differs has ``refold(owed, acc)`` sum those (re-reading A's side), and it and every
    later chunk are ``fold``-ed. ``bar`` advances by each chunk's ``count``."""
    acc = Acc()
    owed = 0  # leading bit-identical chunks whose float64 norms are not summed yet
    nonzero = False  # some finite element of those chunks is nonzero
    for xa, xb in chunks:
        if not exact and owed >= 0 and bits_equal(xa, xb):
            nonzero |= scan_same(xa, acc)
            owed += 1
        else:
            if owed > 0:  # a chunk differs after all: sum the owed norms
                refold(owed, acc)
            owed = -1
            fold(xa, xb, acc)
        bar.update(count(xa))
    if acc.changed:
        reasons.append("values")
    return result(common, acc, owed, nonzero, reasons)


def result(common: dict[str, Any], acc: Acc, owed: int, nonzero: bool, reasons: list[str]) -> TensorDiff:
    """The ``TensorDiff`` of a same-shape pair from its accumulators; ``owed > 0``: every chunk was
    bit-identical (norms not summed in float64)."""
    na, nb = math.sqrt(acc.a2), math.sqrt(acc.b2)
    nd = math.sqrt(acc.d2)
    rel_l2 = (nd / nb) if nb > 0 else (0.0 if nd == 0 else math.inf)
    cosine = acc.ab / (na * nb) if na > 0 and nb > 0 else None
    norm_a: float | None = na
    norm_b: float | None = nb
    if owed > 0:  # every chunk bit-identical: <a,b> = ||a|| ||b|| without summing anything
        cosine = 1.0 if nonzero else None
        norm_a = norm_b = math.sqrt(acc.same2) if acc.same_known else None
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
        norm_a=norm_a,
        norm_b=norm_b,
        norm_diff=nd,
    )


Pair = tuple[str, str, TensorEntry, TensorEntry]


def compare_threads() -> int:
    """Tensor pairs compared at once: one per 2 usable cores, at most 8 (``ZCKPT_WORKERS`` overrides); each
    thread folds its own pair's chunks (torch and numpy release the GIL): a diff is not bound by one core."""
    return scan.threads(cap=8, per=2)


def each(
    items: list[T], one: Callable[[T], R], threads: int | None = None, name: str = "zckpt-diff"
) -> list[R]:
    """``one`` of every item (a diff's pairs, ``stats``' tensors), in order, ``threads`` (default
    ``compare_threads()``) at once, on threads named ``name``."""
    n = min(compare_threads() if threads is None else threads, len(items))
    if n <= 1:
        return [one(p) for p in items]
    with Pool(n, thread_name_prefix=name) as pool:
        return list(pool.map(one, items))


COMPARE_DTYPES = ("auto", "full", "fp32", "bf16", "fp16")
"""``compare_dtype`` values (the module doc); ``fp32``/``bf16``/``fp16`` in any spelling ``parse_precision``
reads."""


def parse_compare_dtype(name: str | DType | torch.dtype) -> str:
    """``auto``, ``full``, ``fp32``, ``bf16`` or ``fp16`` for a ``compare_dtype`` in any spelling."""
    if isinstance(name, str) and name.strip().lower() in ("auto", "full"):
        return name.strip().lower()
    got = parse_precision(name.strip()) if isinstance(name, str) else None
    if isinstance(name, DType) or is_torch_dtype(name):
        got = next((k for k, v in PRECISIONS.items() if v == name), None)
    if got is None:
        raise InvalidArgument(
            f"unknown comparison dtype {name!r}; choose auto, full, fp32, bf16 or fp16",
            hint="auto: a pair stored in two dtypes is compared at the narrower; full: as stored, in float64",
        )
    return got


def comparison_dtype(mode: str, da: DType, db: DType) -> DType | None:
    """The dtype a pair stored as ``da``/``db`` is cast to before comparing under ``mode`` (a
    ``parse_compare_dtype`` result), or None to compare it as stored (the module doc)."""
    if mode == "full" or not (da.is_floating_point and db.is_floating_point):
        return None
    if mode != "auto":
        target = PRECISIONS[mode]
        return None if da == db == target else target
    if da == db:
        return None
    return da if _holds(db, da) and not _holds(da, db) else db  # the narrower; else B's, the reference


def _holds(wide: DType, narrow: DType) -> bool:
    """Every value of ``narrow`` is a value of ``wide`` (finer or equal spacing, wider or equal range)."""
    w, n = FINFO[wide.name], FINFO[narrow.name]
    return w[0] <= n[0] and w[1] >= n[1] and w[2] <= n[2]


FINFO = {
    "float64": (2.0**-52, 1.7976931348623157e308, 2.0**-1022),
    "float32": (2.0**-23, 3.4028234663852886e38, 2.0**-126),
    "float16": (2.0**-10, 65504.0, 2.0**-14),
    "bfloat16": (2.0**-7, 3.3895313892515355e38, 2.0**-126),
    "float8_e4m3fn": (2.0**-3, 448.0, 2.0**-6),
    "float8_e5m2": (2.0**-2, 57344.0, 2.0**-14),
}
"""``torch.finfo``'s ``(eps, max, smallest_normal)`` of each float dtype (without torch;
``tests/test_diff_numpy.py`` checks them against torch's)."""


def real(x: float | None) -> float | str | None:
    """JSON has no NaN/Infinity: non-finite numbers become the strings "inf", "-inf", "nan"."""
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
