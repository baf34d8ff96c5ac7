"""Streamed per-tensor statistics (``zckpt inspect --stats``) and the chunked reader diff shares.

A tensor is read in bounded chunks of its flattened elements (``iter_chunks``: at most ``CHUNK``
elements at a time, assembled from whichever pieces overlap the chunk, never the padding), so a
100 GB tensor costs the same memory as a small one. Each chunk is cast to the entry's logical
dtype exactly as ``Checkpoint.read`` would, then folded into float64 accumulators:

- ``min``/``max``/``mean``/``std``/``norm`` are over the *finite* elements (NaN and ±Inf are
  counted separately in ``nan``/``inf``); ``std`` is the population standard deviation.
- mean/variance use Chan et al.'s pairwise update of (count, mean, M2) per chunk in float64, so
  the result does not depend on the chunk size beyond float64 rounding and does not suffer the
  cancellation of sum/sum-of-squares.
- Integer and bool tensors keep exact ``min``/``max`` (Python ints); their moments are in float64.

The arithmetic runs in numpy, one tensor per thread (``checkpoint_stats``: up to one thread a core), not in
torch: a chunk is small (1 Mi elements), and torch splits each of the ~10 kernels of a chunk over its
intra-op threads; on a busy 2-core machine every kernel then waits for a thread the OS has not scheduled
(issue 42: ``inspect --stats`` of 78 MB of fp32 took 17-21 s in torch, 1.2-1.4 s with one torch thread,
0.3-0.5 s here; bench/RESULTS.md).
Non-finite values are looked for only when a chunk's min or max is not finite (NaN propagates through both).

Reading needs no torch either where a tensor's pieces are byte ranges of files stored in its dtype (every
format's tensors but pickled values and stored-dtype casts): each span is read by ``pread`` into a reused
buffer (nothing mapped, so a file truncated under the reader is an error, not a SIGBUS; an object streams
ahead as for every reader), its checksum fed (``checks.consumed``); bf16 and float8 are widened exactly to
float32 as ``zckpt.ops.diff_numpy`` does (``diff_numpy.readable`` says which tensors). Other tensors
are read through torch (``iter_chunks``), imported then.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from zckpt.checkpoint import Checkpoint
from zckpt.model import TensorEntry, dtype_name
from zckpt.ops import diff_numpy
from zckpt.ops.diff_report import CHUNK, each, is_exact  # as diff: one chunk size, one notion of exact
from zckpt.storage import checks, fileio, scan
from zckpt.stream.spans import read_range, spans, windows

if TYPE_CHECKING:  # only tensors that are not plain file bytes are read through torch (``iter_chunks``)
    import torch


def iter_chunks(
    entry: TensorEntry, chunk: int = CHUNK, dtype: torch.dtype | None = None
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(start, values)`` over the flattened logical tensor in order, ``chunk`` elements at a
    time, cast to ``dtype`` (default: the entry's dtype). Only the bytes of the pieces that overlap
    each chunk are touched; padding is never read."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    for lo, hi in windows(0, entry.numel, chunk):
        yield lo, read_range(entry, lo, hi, dtype)


@dataclass(frozen=True)
class TensorStats:
    """Summary of one logical tensor. Moments are ``None`` when no element is finite."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    numel: int
    min: float | int | None
    max: float | int | None
    mean: float | None
    std: float | None
    norm: float | None
    nan: int
    inf: int

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "role": self.role,
            "numel": self.numel,
            "min": self.min,
            "max": self.max,
            "mean": self.mean,
            "std": self.std,
            "norm": self.norm,
            "nan": self.nan,
            "inf": self.inf,
        }


class _Moments:
    """Running (count, mean, M2, sum of squares) in float64, merged chunk by chunk (Chan et al.)."""

    __slots__ = ("n", "mean", "m2", "sumsq")

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.sumsq = 0.0

    def add(self, x: np.ndarray) -> None:
        """Fold a chunk of finite values in (computed in float64)."""
        nb = x.size
        if nb == 0:
            return
        d = x.astype(np.float64)  # a copy: centred and squared in place below
        mb = float(d.sum()) / nb
        d -= mb
        m2b = float(np.square(d, out=d).sum())
        self.sumsq += m2b + nb * mb * mb  # sum(x^2) = sum((x - mean)^2) + n mean^2: two positive terms
        na = self.n
        n = na + nb
        delta = mb - self.mean
        self.mean += delta * nb / n
        self.m2 += m2b + delta * delta * na * nb / n
        self.n = n


def _values(x: torch.Tensor) -> np.ndarray:
    """A chunk read through torch as a numpy array, without a torch kernel where numpy holds the dtype: bf16
    widened to float32 by shifting its bits (exact), bool as uint8; other dtypes (float8) cast to float32 by
    torch."""
    import torch

    x = x.reshape(-1)
    if x.dtype in (torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
                   torch.int32, torch.int64):  # fmt: skip
        return x.numpy()
    if x.dtype == torch.bfloat16:
        return (x.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if x.dtype == torch.bool:
        return x.view(torch.uint8).numpy()
    return x.to(torch.float32).numpy()


def _numpy_chunks(entry: TensorEntry, chunk: int) -> Iterator[np.ndarray]:
    """``entry``'s elements in logical order, at most ``chunk`` at a time, as numpy values (float8 and bf16
    widened exactly to float32, bool as uint8), read by ``pread`` into one reused buffer (an object: fetched
    ahead to each record's end, as every reader does) and checked (``checks.consumed``);
    ``diff_numpy.readable`` must hold. Never keep a yielded array: the next read overwrites it."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    layout = diff_numpy.layout(entry.dtype)
    assert layout is not None  # readable
    isz = entry.dtype.itemsize
    buf = np.empty(min(chunk, max(entry.numel, 1)) * isz, dtype=np.uint8)
    for s in spans(entry, max_elems=chunk):
        p = s.piece
        raw = buf[: s.n * isz]
        fileio.read_into(p.file, s.byte_offset, raw, checks.record_end(p))
        checks.consumed(p.check, s.byte_offset, raw)
        x = raw.view(layout)
        if x.dtype == np.bool_:
            yield x.view(np.uint8)
        elif entry.dtype.kind == "f":
            yield diff_numpy.floats((x, entry.dtype))  # bf16 and float8 widened exactly to float32
        else:
            yield x


def tensor_stats(entry: TensorEntry, *, chunk: int = CHUNK, use_torch: bool = False) -> TensorStats:
    """Stream one tensor (``_numpy_chunks`` where ``diff_numpy.readable``, else ``iter_chunks``;
    ``use_torch``: always the latter) and summarise it (see the module docstring)."""
    exact = is_exact(entry.dtype)
    nan = inf = 0
    lo_v: float | int | None = None
    hi_v: float | int | None = None
    mom = _Moments()
    if diff_numpy.readable(entry) and not use_torch:
        chunks: Iterable[np.ndarray] = _numpy_chunks(entry, chunk)
    else:
        chunks = (_values(t) for _, t in iter_chunks(entry, chunk))
    for x in chunks:
        if not x.size:
            continue
        if exact:
            finite = x
            imin, imax = int(x.min()), int(x.max())
            lo_v = imin if lo_v is None else min(lo_v, imin)
            hi_v = imax if hi_v is None else max(hi_v, imax)
        else:
            cmin, cmax = float(x.min()), float(x.max())  # NaN if any is, +-inf if any is
            finite = x
            if not (math.isfinite(cmin) and math.isfinite(cmax)):
                nan += int(np.isnan(x).sum())
                inf += int(np.isinf(x).sum())
                finite = x[np.isfinite(x)]
                if not finite.size:
                    continue
                cmin, cmax = float(finite.min()), float(finite.max())
            lo_v = cmin if lo_v is None else min(lo_v, cmin)
            hi_v = cmax if hi_v is None else max(hi_v, cmax)
        mom.add(finite)
    have = mom.n > 0
    return TensorStats(
        key=entry.key,
        shape=entry.shape,
        dtype=dtype_name(entry.dtype),
        role=entry.role.value,
        numel=entry.numel,
        min=lo_v,
        max=hi_v,
        mean=mom.mean if have else None,
        std=math.sqrt(max(mom.m2, 0.0) / mom.n) if have else None,
        norm=math.sqrt(mom.sumsq) if have else None,
        nan=nan,
        inf=inf,
    )


def checkpoint_stats(
    ckpt: Checkpoint,
    keys: Iterable[str] | None = None,
    *,
    include_optimizer: bool = False,
    progress: bool = False,
    chunk: int = CHUNK,
) -> list[TensorStats]:
    """Stats of each owner tensor (tied aliases are summarised once, under the owner's key), in
    checkpoint order; ``keys`` restricts to those keys (aliases resolve to their owners)."""
    if keys is None:
        entries = ckpt.model_entries()
        if include_optimizer:
            entries += [ckpt.entries[k] for k in ckpt.optim_keys()]
    else:
        seen: dict[str, TensorEntry] = {}
        for k in keys:
            e = ckpt.entry(k)
            seen.setdefault(e.key, e)
        entries = list(seen.values())
    bar = tqdm(
        total=len(entries), desc="stats", unit="tensor", file=sys.stderr, disable=not progress, leave=False
    )

    def one(e: TensorEntry) -> TensorStats:
        out = tensor_stats(e, chunk=chunk)
        bar.update(1)
        return out

    try:  # numpy's loops release the GIL: one tensor a core
        return each(entries, one, scan.threads(cap=8, per=1), name="zckpt-stats")
    finally:
        bar.close()
