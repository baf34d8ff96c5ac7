"""zckpt.ops.stats against full-tensor torch computations on hand-made checkpoints (tests/_handmade.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _handmade import make_ckpt
from _torchfree import run_torch_free

from zckpt.ops.diff_numpy import readable
from zckpt.ops.stats import checkpoint_stats, iter_chunks, tensor_stats
from zckpt.stream import spans

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "fixtures"


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    big = torch.randn(37, 11, generator=g) * 3 + 1e3  # offset mean: sum/sumsq would cancel badly in fp32
    odd = torch.randn(29, generator=g)
    odd[[0, 5, 28]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    return {
        "big": big,
        "odd": odd,
        "half": torch.randn(17, generator=g).to(torch.bfloat16),
        "ids": torch.tensor([[3, -7], [2**40, 5]], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "allnan": torch.full((4,), float("nan")),
        "empty": torch.zeros(0, 3),
    }


@pytest.mark.parametrize("chunk", [1, 3, 64, 1 << 22])
def test_iter_chunks_reassembles_exactly_without_padding(tmp_path: Path, chunk: int) -> None:
    t = _tensors()
    ck = make_ckpt(tmp_path, t, world=3)
    for k, v in t.items():
        parts = [x for _, x in iter_chunks(ck.entry(k), chunk)]
        got = torch.cat(parts) if parts else torch.empty(0, dtype=v.dtype)
        assert got.dtype == v.dtype and torch.equal(got.nan_to_num(7.0), v.reshape(-1).nan_to_num(7.0)), k
        assert all(x.numel() <= chunk for x in parts)


@pytest.mark.parametrize("chunk", [2, 7, 1 << 22])
def test_stats_match_full_tensor_oracle(tmp_path: Path, chunk: int) -> None:
    t = _tensors()
    ck = make_ckpt(tmp_path, t, world=2)
    for k, v in t.items():
        assert readable(ck.entry(k)), k  # read in numpy, no torch (the torch path: the test below)
        s = tensor_stats(ck.entry(k), chunk=chunk)
        flat = v.reshape(-1)
        assert s.numel == flat.numel() and s.shape == tuple(v.shape)
        if not v.is_floating_point():
            x = flat.to(torch.int64)
            assert (s.min, s.max) == ((int(x.min()), int(x.max())) if x.numel() else (None, None))
            assert s.nan == s.inf == 0
            fin = x.double()
        else:
            x64 = flat.double()
            assert s.nan == int(x64.isnan().sum()) and s.inf == int(x64.isinf().sum())
            fin = x64[x64.isfinite()]
            if fin.numel():
                assert (s.min, s.max) == (fin.min().item(), fin.max().item())
        if fin.numel() == 0:
            assert s.mean is s.std is s.norm is None
            continue
        assert s.mean == pytest.approx(fin.mean().item(), rel=1e-12)
        assert s.std == pytest.approx(fin.std(correction=0).item(), rel=1e-9)
        assert s.norm == pytest.approx(torch.linalg.vector_norm(fin).item(), rel=1e-12)
    assert tensor_stats(ck.entry("ids")).max == 2**40  # exact for integers


@pytest.mark.parametrize("chunk", [3, 1 << 22])
def test_numpy_reading_equals_torch_reading(tmp_path: Path, chunk: int) -> None:
    """The two readers (numpy views of the files; torch's ``read_range``) give the same figures to the bit,
    float8 and bfloat16 (widened from their bits) included."""
    from safetensors.torch import save_file

    import zckpt

    t = _tensors()
    g = torch.Generator().manual_seed(2)
    f8 = {
        "e4m3": (torch.randn(300, generator=g) * 40).to(torch.float8_e4m3fn),
        "e5m2": (torch.randn(300, generator=g) * 1e3).to(torch.float8_e5m2),
        "bf16": torch.randn(300, generator=g).to(torch.bfloat16),
    }
    save_file(f8, str(tmp_path / "f8.safetensors"))
    ck = make_ckpt(tmp_path / "ck", t, world=3)
    with zckpt.open(tmp_path / "f8.safetensors") as sf:
        for e in [ck.entry(k) for k in t] + [sf.entry(k) for k in f8]:
            assert readable(e), e.key
            _same_stats(
                tensor_stats(e, chunk=chunk).to_json(), tensor_stats(e, chunk=chunk, use_torch=True).to_json()
            )


def _same_stats(got: dict[str, object], want: dict[str, object]) -> None:
    """Counts, min and max to the bit; the moments to float64 rounding (the numpy reader folds each piece's
    run on its own where torch's reader folds whole chunks: the same sums, grouped otherwise)."""
    moments = ("mean", "std", "norm")
    assert {f: v for f, v in got.items() if f not in moments} == {
        f: v for f, v in want.items() if f not in moments
    }
    for f in moments:
        w = want[f]
        assert got[f] == (w if w is None else pytest.approx(w, rel=1e-12, abs=1e-300)), (want["key"], f)


@pytest.mark.parametrize("ck", ["ds/s3_bf16_w2_g2", "ds/s1_bf16_w2", "dcp/fsdp1_w2/checkpoint"])
def test_inspect_stats_imports_no_torch(ck: str) -> None:
    """``zckpt inspect --stats`` of real DeepSpeed and DCP checkpoints reads every tensor without torch, and
    its figures equal the torch reader's (``tensor_stats(use_torch=True)``)."""
    import json

    import zckpt

    path = FIX / ck
    assert path.exists(), f"fixture missing: {path}"
    done = run_torch_free(["inspect", str(path), "--stats", "--json"])
    assert done.returncode == 0, done.stderr[-3000:]
    got = {s["key"]: s for s in json.loads(done.stdout)["stats"]}
    with zckpt.open(path) as c:
        keys = [e.key for e in c.model_entries()] + list(c.optim_keys())
        want = {k: tensor_stats(c.entries[k], use_torch=True).to_json() for k in keys}
    assert got.keys() == want.keys() and len(want) > 3
    for k, w in want.items():
        _same_stats(got[k], w)


def test_checkpoint_stats_ties_and_optimizer(tmp_path: Path) -> None:
    t = {"w": torch.ones(4, 2), "b": torch.arange(3.0)}
    ck = make_ckpt(tmp_path, t, tied={"w2": "w"}, optim={"w:exp_avg": torch.full((4, 2), 2.0)})
    assert [s.key for s in checkpoint_stats(ck)] == ["w", "b"]
    assert [s.key for s in checkpoint_stats(ck, include_optimizer=True)] == ["w", "b", "w:exp_avg"]
    only = checkpoint_stats(ck, keys=["w2", "w"])
    assert [s.key for s in only] == ["w"] and only[0].norm == pytest.approx(math.sqrt(8))
    assert only[0].to_json()["std"] == 0.0


def test_inspect_stats_cli(tmp_path: Path) -> None:
    import json

    from safetensors.torch import save_file
    from typer.testing import CliRunner

    from zckpt.cli.app import app

    t = {k: v for k, v in _tensors().items() if k not in ("empty", "mask")}
    f = tmp_path / "m.safetensors"
    save_file(t, str(f))
    res = CliRunner().invoke(app, ["inspect", str(f), "--stats", "--json"])
    assert res.exit_code == 0, res.output
    got = {s["key"]: s for s in json.loads(res.output)["stats"]}
    assert set(got) == set(t)
    big = t["big"].double()
    assert got["big"]["mean"] == pytest.approx(big.mean().item(), rel=1e-12)
    assert got["big"]["std"] == pytest.approx(big.std(correction=0).item(), rel=1e-9)
    assert (got["odd"]["nan"], got["odd"]["inf"]) == (1, 2)
    text = CliRunner().invoke(app, ["inspect", str(f), "--stats"]).output
    assert "norm" in text.splitlines()[-len(t) - 1] and "allnan" in text


@pytest.mark.parametrize("chunk", [1, 4, 10, 1 << 22])
def test_aligned_views_pair_the_same_elements_across_piece_layouts(tmp_path: Path, chunk: int) -> None:
    """World 3 against world 2: piece boundaries differ, every chunk must still pair element i with i."""
    t = _tensors()
    ca, cb = make_ckpt(tmp_path / "a", t, world=3), make_ckpt(tmp_path / "b", t, world=2)
    for k, v in t.items():
        pairs = list(spans.aligned_views(ca.entry(k), cb.entry(k), chunk))
        assert all(xa.numel() == xb.numel() and 0 < xa.numel() <= chunk for xa, xb in pairs), k
        for side in (0, 1):
            got = torch.cat([p[side].clone() for p in pairs]) if pairs else torch.empty(0, dtype=v.dtype)
            assert got.dtype == v.dtype and torch.equal(got.nan_to_num(7.0), v.reshape(-1).nan_to_num(7.0)), k
