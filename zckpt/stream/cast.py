"""Casting tensor bytes between floating dtypes, bit-exact with torch's ``tensor.to(dtype)``, without torch.

Why numpy: ``zckpt consolidate`` of a checkpoint whose tensors are read from files (every format but pickles
of live tensors) needs no tensor math beyond a cast, and ``import torch`` is most of such a command's start-up
(1.5-2 s warm, 4-5 s cold on the GPU host). numpy (already the write path's buffer layer) imports in ~0.1 s.

``cast_into(dst, dst_dtype, src, src_dtype)`` writes ``src``'s values (raw little-endian bytes, a uint8
array) cast to ``dst_dtype`` into ``dst`` (uint8, the output's bytes). Where torch is already imported (a
program that uses it; the CLI when the job needs it) its cast runs: it is the reference, and vectorised. Else
the numpy kernels below run for every pair of ``float64``/``float32``/``float16``/``bfloat16`` sources and
``float32``/``float16``/``bfloat16`` outputs (what consolidate casts); any other pair imports torch.

The kernels reproduce what torch's CPU copy kernel gives for every input class (``tests/test_cast.py``
checks them against torch on hand-made values): finite values round to nearest, ties to even; values past
the largest finite output round to ±inf; subnormals and ±0 as IEEE says. NaNs, as torch's vectorised
kernels write them: to ``bfloat16`` from float32/float64 ``0xFFFF``, from float16 ``0x7FC0``; to
``float16`` the sign, the quiet bit and the top 9 payload bits of the float32 value; to ``float32`` from
float16 the payload with the quiet bit set, from bfloat16 the bits shifted (a signalling NaN stays one).
A float64 source is rounded to float32 first, as torch does. (torch's scalar tail loop writes some NaNs
differently from its vector loop: a float64 tensor of a few elements cast to bfloat16 gets ``0x7FC0`` for a
NaN from torch; these kernels give the vector loop's bits everywhere.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np

from zckpt.dtypes import DType

BLOCK = 1 << 18
"""Elements cast per numpy pass: a block's temporaries stay in a server core's 2 MiB L2 cache, and each
pass releases the GIL long enough that 8-16 fill threads do not queue for it (GPU host, bench/cpu_probe.py:
1.43 ns an element on one thread, 3.17 on each of 8; at 1 << 16: 1.25 and 7.62; at 1 << 20: 1.96, 2.61)."""

_F32, _F16, _U16, _U32 = np.dtype("<f4"), np.dtype("<f2"), np.dtype("<u2"), np.dtype("<u4")


def cast_into(dst: np.ndarray, dst_dtype: DType, src: np.ndarray, src_dtype: DType) -> None:
    """``dst`` (uint8, ``n * dst_dtype.itemsize`` bytes) = the ``n`` values of ``src`` (uint8 bytes of
    ``src_dtype``) cast to ``dst_dtype`` (see the module doc for which implementation runs)."""
    n = src.size // src_dtype.itemsize
    if dst.size != n * dst_dtype.itemsize:
        raise ValueError(f"{dst.size} bytes cannot hold {n} {dst_dtype} values")
    if src_dtype == dst_dtype:
        dst[:] = src
    elif "torch" in sys.modules or not can_cast(src_dtype, dst_dtype):
        torch_cast(dst, dst_dtype, src, src_dtype)
    else:
        numpy_cast(dst, dst_dtype, src, src_dtype)


def can_cast(src_dtype: DType, dst_dtype: DType) -> bool:
    """Whether ``numpy_cast`` has a kernel for this pair."""
    return src_dtype.name in _TO_F32 and dst_dtype.name in _FROM_F32


def torch_cast(dst: np.ndarray, dst_dtype: DType, src: np.ndarray, src_dtype: DType) -> None:
    """The cast done by torch (imported here if it was not)."""
    import torch

    out = torch.from_numpy(dst).view(dst_dtype.torch)
    out.copy_(torch.from_numpy(src).view(src_dtype.torch))


def numpy_cast(dst: np.ndarray, dst_dtype: DType, src: np.ndarray, src_dtype: DType) -> None:
    """The cast done by the numpy kernels (``can_cast`` must hold), one ``BLOCK`` of elements at a time."""
    widen, narrow = _TO_F32[src_dtype.name], _FROM_F32[dst_dtype.name]
    si, di = src_dtype.itemsize, dst_dtype.itemsize
    n = src.size // si
    wide = np.empty(min(n, BLOCK), _U32)
    tmp = np.empty(min(n, BLOCK), _U32)
    for a in range(0, n, BLOCK):
        b = min(n, a + BLOCK)
        w = wide[: b - a]
        u = src[a * si : b * si]
        if widen is None:
            w = u.view(_U32)  # no widening: the source is the float32 bits
        else:
            widen(u, w)
        narrow(w, dst[a * di : b * di], tmp[: b - a], src_dtype.name)


def _from_f64(src: np.ndarray, out: np.ndarray) -> None:
    with np.errstate(over="ignore", invalid="ignore"):  # the hardware's rounding, as torch's
        np.copyto(out.view(_F32), src.view("<f8"), casting="unsafe")


def _from_f16(src: np.ndarray, out: np.ndarray) -> None:
    f = out.view(_F32)
    np.copyto(f, src.view(_F16), casting="unsafe")  # exact; a NaN keeps its payload, quiet or not
    nan = np.isnan(f)
    if nan.any():
        out[nan] |= 0x00400000  # torch's vector kernel (F16C) quiets it


def _from_bf16(src: np.ndarray, out: np.ndarray) -> None:
    out[:] = src.view(_U16)
    np.left_shift(out, 16, out=out)  # a bfloat16 is a float32's top half


def _to_f32(u: np.ndarray, dst: np.ndarray, tmp: np.ndarray, source: str) -> None:
    dst.view(_U32)[:] = u


def _to_bf16(u: np.ndarray, dst: np.ndarray, tmp: np.ndarray, source: str) -> None:
    """Round to nearest even on the low 16 bits (c10's ``round_to_nearest_even``), NaN as torch writes it."""
    np.right_shift(u, 16, out=tmp)
    np.bitwise_and(tmp, 1, out=tmp)
    np.add(tmp, 0x7FFF, out=tmp)
    np.add(tmp, u, out=tmp)  # wraps only for a negative NaN, replaced below
    np.right_shift(tmp, 16, out=tmp)
    out = dst.view(_U16)
    np.copyto(out, tmp, casting="unsafe")
    nan = np.isnan(u.view(_F32))
    if nan.any():
        out[nan] = 0x7FC0 if source == "float16" else 0xFFFF


def _to_f16(u: np.ndarray, dst: np.ndarray, tmp: np.ndarray, source: str) -> None:
    """numpy's float32 -> float16 rounding (to nearest even, overflow to ±inf); NaN as F16C writes it."""
    f = u.view(_F32)
    out = dst.view(_U16)
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(out.view(_F16), f, casting="unsafe")
    nan = np.isnan(f)
    if nan.any():
        v = u[nan]
        out[nan] = ((v >> 16) & 0x8000) | 0x7E00 | ((v >> 13) & 0x3FF)


_TO_F32: dict[str, Callable[[np.ndarray, np.ndarray], None] | None] = {
    "float64": _from_f64, "float32": None, "float16": _from_f16, "bfloat16": _from_bf16,
}  # fmt: skip
"""Source dtype -> its exact (or, for float64, torch's rounding) widening to float32 bits."""
_FROM_F32: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray, str], None]] = {
    "float32": _to_f32, "bfloat16": _to_bf16, "float16": _to_f16,
}  # fmt: skip
"""Output dtype -> its rounding from float32 bits."""

__all__ = ["BLOCK", "can_cast", "cast_into", "numpy_cast", "torch_cast"]
