"""``zckpt.stream.cast``'s numpy kernels give torch's ``tensor.to(dtype)`` bit for bit (issue 42: consolidate
without torch). Oracle: torch itself, on hand-made bit patterns of every input class (quiet and signalling
NaNs of both signs with payloads, ±inf, ±0, the smallest and largest subnormals, the largest finite value,
values that round to inf, ties rounding to even both ways, float64 values that round differently through
float32 than directly) and on random bit patterns, in lengths that cross the kernels' block boundary."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zckpt import dtypes
from zckpt.dtypes import DType
from zckpt.stream import cast

F32 = [
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FA00000, 0xFFFFFFFF, 0x7FC00001,  # NaNs
    0x7F800000, 0xFF800000, 0x00000000, 0x80000000,  # ±inf, ±0
    0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x00008000, 0x00018000,  # subnormals, smallest normal
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # largest finite; rounds to inf in bf16 / stays
    0x3F808000, 0x3F818000, 0x3F80C000, 0x3F804000,  # bf16 ties: to even down, to even up; above; below
    0x477FEFFF, 0x477FF000, 0xC77FF000,  # float16: largest finite after rounding; rounds to ±inf
    0x33000000, 0x33000001, 0x387FC000, 0x387FE000, 0x38800000,  # float16 subnormal ties and edges
    0x3F800FFF, 0x3F801000, 0x3F803000,  # float16 ties at 1.0
]  # fmt: skip
F16 = [0x7C01, 0x7E00, 0xFC01, 0x7D00, 0xFE01, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x7BFF,
       0x3C01, 0x3C03]  # fmt: skip
BF16 = [
    0x7F81,
    0x7FC0,
    0xFF81,
    0xFFC1,
    0x7F80,
    0xFF80,
    0x0000,
    0x8000,
    0x0001,
    0x807F,
    0x0080,
    0x7F7F,
    0x3F81,
]
F64 = [
    0x7FF0000000000001, 0x7FF8000000000000, 0xFFF0000000000001, 0x7FF4000000000000,  # NaNs
    0x3FF0100000010000,  # 1 + 2^-8 + 2^-36: a bf16 tie through float32 (-> 1.0), above it directly
    0x3FF0080000000001, 0x3FF0000010000000, 0x47EFFFFFE0000000, 0x47EFFFFFF0000000,  # ... float32's edge
    0x0000000000000001, 0x3810000000000000, 0x36A0000000000000, 0x40EFFE0000000001,  # subnormals; f16 max
]  # fmt: skip
SPECIALS = {"float32": (F32, np.uint32), "float16": (F16, np.uint16), "bfloat16": (BF16, np.uint16),
            "float64": (F64, np.uint64)}  # fmt: skip


def _bits(name: str, n_random: int, seed: int) -> np.ndarray:
    """The special values of ``name``, then ``n_random`` random bit patterns: raw bytes."""
    special, ut = SPECIALS[name]
    rng = np.random.default_rng(seed)
    rand = rng.integers(0, np.iinfo(ut).max, n_random, dtype=ut, endpoint=True)
    return np.concatenate([np.array(special, dtype=ut), rand]).view(np.uint8)


def _bf16_as_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _torch_to(raw: np.ndarray, src: DType, dst: DType) -> np.ndarray:
    return torch.from_numpy(raw.copy()).view(src.torch).to(dst.torch).view(torch.uint8).numpy()


PAIRS = [(s, d) for s in SPECIALS for d in ("float32", "float16", "bfloat16") if s != d]


@pytest.mark.parametrize(("src", "dst"), PAIRS)
@pytest.mark.parametrize("n_random", [0, cast.BLOCK + 77])
def test_numpy_cast_equals_torch(src: str, dst: str, n_random: int) -> None:
    s, d = dtypes.of(src), dtypes.of(dst)
    raw = _bits(src, n_random, seed=n_random)
    assert cast.can_cast(s, d)
    got = np.empty(raw.size // s.itemsize * d.itemsize, np.uint8)
    cast.numpy_cast(got, d, raw, s)
    want = _torch_to(raw, s, d)
    ut = f"<u{d.itemsize}"
    if (src, dst) == ("float64", "bfloat16") and not n_random:
        # the one known divergence: a float64 tensor too short for torch's vector loop takes its scalar
        # loop, which writes a NaN as 0x7FC0 (the vector loop, as this kernel everywhere: 0xFFFF)
        nan = np.isnan(raw.view("<f8"))
        assert (want.view(ut)[nan] == 0x7FC0).all() and (got.view(ut)[nan] == 0xFFFF).all()
        want.view(ut)[nan] = 0xFFFF
    bad = np.flatnonzero(got.view(ut) != want.view(ut))
    src_nan = np.isnan(raw.view(f"<f{s.itemsize}") if src != "bfloat16" else _bf16_as_f32(raw))
    if (src, dst) == ("float16", "float32") and bad.size and src_nan[bad].all():
        # torch's float16 -> float32 on an AVX-512 host (the GPU host, 2026-12-06) wrote 0x7FFFFFFF for 1 of
        # ~2,000 NaNs, at no tail (its loop is not uniform across positions); the vector rule holds for the
        # rest, and the value stays a NaN: allow that many, never a non-NaN
        assert np.isnan(want.view("<f4")[bad]).all() and bad.size <= max(1, src_nan.sum() // 500)
        bad = bad[:0]
    shown = [(hex(int(raw.view(f"<u{s.itemsize}")[i])), hex(int(got.view(ut)[i])), hex(int(want.view(ut)[i])))
             for i in bad[:5]]  # fmt: skip
    assert not bad.size, f"{src}->{dst}: {bad.size} differ (source, numpy, torch): {shown}"


def test_special_classes_as_documented() -> None:
    """The NaN rules the module doc states, on their own (torch's vector kernels on this CPU gave them)."""
    f32 = np.array([0x7FC00000, 0xFFC00001, 0x3F808000, 0x3F818000, 0x7F7FFFFF], np.uint32).view(np.uint8)
    out = np.empty(10, np.uint8)
    cast.numpy_cast(out, dtypes.bfloat16, f32, dtypes.float32)
    assert [hex(v) for v in out.view(np.uint16)] == ["0xffff", "0xffff", "0x3f80", "0x3f82", "0x7f80"]
    cast.numpy_cast(out, dtypes.float16, f32, dtypes.float32)
    assert [hex(v) for v in out.view(np.uint16)] == ["0x7e00", "0xfe00", "0x3c04", "0x3c0c", "0x7c00"]


def test_cast_into_same_dtype_copies_and_checks_sizes() -> None:
    src = np.arange(8, dtype=np.uint8)
    dst = np.zeros(8, np.uint8)
    cast.cast_into(dst, dtypes.float32, src, dtypes.float32)
    assert dst.tolist() == src.tolist()
    with pytest.raises(ValueError, match="cannot hold"):
        cast.cast_into(np.zeros(3, np.uint8), dtypes.bfloat16, src, dtypes.float32)


def test_pairs_without_a_kernel_go_to_torch() -> None:
    """float8 has no numpy kernel: ``cast_into`` hands it to torch (which it imports where needed)."""
    assert not cast.can_cast(dtypes.float8_e4m3fn, dtypes.bfloat16)
    raw = np.array([0x38, 0xB8, 0x7F, 0x01], np.uint8)  # 1.0, -1.0, NaN, the smallest subnormal
    out = np.empty(8, np.uint8)
    cast.cast_into(out, dtypes.bfloat16, raw, dtypes.float8_e4m3fn)
    assert out.tolist() == _torch_to(raw, dtypes.float8_e4m3fn, dtypes.bfloat16).tolist()
