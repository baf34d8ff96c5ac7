"""``zckpt diff`` in numpy (``zckpt.ops.diff_numpy``) says what the torch comparison (``diff_values``) says.

Oracle: the torch comparison of the same files (``diff_numpy.usable`` patched to refuse), on hand-made
safetensors files of every dtype safetensors has (NaN, +-inf, +-0, subnormals, values on rounding ties,
the largest values), across dtypes and every ``--dtype`` mode: counts, max abs and max rel differences,
verdicts and casts exactly; norms, rel_l2 and cosine (float64 sums in another order) to 1e-12. Then the
command line: ``zckpt diff x.safetensors y.safetensors`` never imports torch and prints byte for byte what the
torch comparison prints. And ``--dtype``'s dtype table (``diff_report.FINFO``) is torch's ``finfo``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _torchfree import run_torch_free
from safetensors.torch import save_file

import zckpt
from zckpt.ops import diff_numpy, diff_report, diff_values

REPO = Path(__file__).resolve().parents[1]
FLOATS = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
INTS = ("int64", "int32", "int16", "int8", "uint8", "bool")  # what zckpt reads of safetensors (no U16-U64)
EXACT = ("max_abs_diff", "max_rel_diff", "changed", "nan_a", "nan_b", "inf_a", "inf_b", "differs", "reasons",
         "compared_as", "dtype_a", "dtype_b", "key", "numel")  # fmt: skip
CLOSE = ("rel_l2", "cosine", "norm_a", "norm_b", "norm_diff")


def _values(n: int, seed: int, huge: bool = True) -> torch.Tensor:
    """float64 values with every special case a cast or a comparison treats apart (``huge``: also values
    whose squares overflow, where a sum's sign depends on its order)."""
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([
        0.0, -0.0, math.nan, math.inf, -math.inf, 1.0, -1.0, 2.0**-149, 2.0**-126 * 0.75, 2.0**-24, 2.0**-133,
        1 + 2.0**-8, 1 + 2.0**-8 + 2.0**-30, 1 + 3 * 2.0**-8, 1 + 2.0**-11, 1 + 2.0**-11 + 2.0**-40, 65504.0,
        65520.0, 448.0, 464.0, 57344.0, 3.3895313892515355e38, 3.4e38, 1e300, -1e300, 2.0**-1074, 1e-40,
    ], dtype=torch.float64)  # fmt: skip
    if not huge:
        special = special[special.nan_to_num(posinf=0, neginf=0).abs() < 1e30]
    rand = torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, n, dtype=torch.float64)
    return torch.cat([special, rand])


def _as(x: torch.Tensor, name: str) -> torch.Tensor:
    dt = getattr(torch, name)
    x = x.clone()  # every tensor its own storage (safetensors refuses shared ones)
    if name in INTS:
        y = torch.nan_to_num(x, nan=7.0, posinf=9.0, neginf=-9.0).clamp(-100, 100).round()
        if name == "bool":
            return y != 0
        return (y.abs() if name.startswith("uint") else y).to(torch.int64).to(dt)
    return x.to(dt).clone()


def _pair(tmp: Path, seed: int = 0, fp8_casts: bool = False, huge: bool = True) -> tuple[Path, Path]:
    """A and B: one tensor per (dtype of A, dtype of B) pair that a diff compares, B a perturbed A (pairs of
    float8 and another float dtype, which ``--dtype auto`` casts to float8, only with ``fp8_casts``)."""
    base = _values(300, seed, huge)
    other = base.clone()
    other[27::3] += torch.randn(len(other[27::3]), generator=torch.Generator().manual_seed(seed + 1))
    other[30] = math.nan
    other[31] = math.inf
    a, b = {}, {}
    for da in (*FLOATS, *INTS):
        for db in (*FLOATS, *INTS) if da in FLOATS else (da, "int64", "float32"):
            key = f"{da}-{db}"
            if not fp8_casts and da != db and {da, db} & {"float8_e4m3fn", "float8_e5m2"} and db in FLOATS:
                continue
            a[key], b[key] = _as(base, da), _as(other if db != da or da in FLOATS else base, db)
            a[key + "-same"], b[key + "-same"] = _as(base, da), _as(base, db)
    a["reshaped"], b["reshaped"] = torch.zeros(4), torch.zeros(2, 2)
    pa, pb = tmp / "a.safetensors", tmp / "b.safetensors"
    save_file(a, str(pa))
    save_file(b, str(pb))
    return pa, pb


def _torch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diff_numpy, "usable", lambda pairs, mode: False)


def _numpy_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("the torch comparison ran")

    monkeypatch.setattr(diff_values, "compare_all", refuse)


def _fields(t: diff_report.TensorDiff, names: tuple[str, ...]) -> dict[str, Any]:
    return {n: getattr(t, n) for n in names}


def _same(x: Any, y: Any) -> bool:
    return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))


@pytest.mark.parametrize("mode", ["auto", "full", "fp32", "bf16", "fp16"])
def test_numpy_says_what_torch_says(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pa, pb = _pair(tmp_path)
    kw: dict[str, Any] = dict(compare_dtype=mode, progress=False, chunk=97)  # chunks cut inside tensors
    with monkeypatch.context() as m:
        _torch_only(m)
        want = zckpt.diff(pa, pb, **kw)
    with monkeypatch.context() as m:
        _numpy_only(m)
        got = zckpt.diff(pa, pb, **kw)
    w, g = {t.key: t for t in want.tensors}, {t.key: t for t in got.tensors}
    assert list(w) == list(g) and len(w) > 100
    for k in w:
        we, ge = _fields(w[k], EXACT), _fields(g[k], EXACT)
        assert all(_same(we[n], ge[n]) for n in EXACT), (k, we, ge)
        for n in CLOSE:
            x, y = getattr(w[k], n), getattr(g[k], n)
            assert (x is None) == (y is None), (k, n, x, y)
            if x is not None and not (math.isnan(x) and math.isnan(y)):
                assert y == pytest.approx(x, rel=1e-12, abs=1e-300), (k, n, x, y)
    assert want.summary() == got.summary()
    assert sum(t.differs for t in got.tensors) > 50 and any(t.identical for t in got.tensors)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN and out-of-range casts (compare_all: errstate)
@pytest.mark.parametrize("name", FLOATS)
def test_numpy_reads_and_casts_as_torch(name: str) -> None:
    """Every float dtype widened exactly (all bit patterns of the 8- and 16-bit ones), and every cast to
    float32/float16/bfloat16 rounded as torch rounds it, NaN bits included where torch's are fixed."""
    from zckpt.dtypes import BY_NAME

    if BY_NAME[name].itemsize <= 2:
        u = torch.arange(2 ** (8 * BY_NAME[name].itemsize), dtype=torch.int32)
        x = u.to(torch.uint8 if BY_NAME[name].itemsize == 1 else torch.int16).view(getattr(torch, name))
    else:
        x = _values(4000, 3).to(getattr(torch, name))
    raw = x.view(torch.uint8).numpy().view(diff_numpy.layout(BY_NAME[name]))
    got = diff_numpy._f32((raw, BY_NAME[name])) if name != "float64" else raw
    assert (
        torch.equal(torch.from_numpy(got.astype("float64")), x.double())
        or (torch.from_numpy(got.astype("float64")).isnan() == x.double().isnan()).all()
        and torch.equal(torch.from_numpy(got.astype("float64")).nan_to_num(), x.double().nan_to_num())
    )
    for to in ("float32", "float16", "bfloat16"):
        want = x.to(getattr(torch, to))
        bits, d = diff_numpy._cast((raw, BY_NAME[name]), BY_NAME[to])
        assert d is BY_NAME[to]
        mine = torch.from_numpy(diff_numpy.floats((bits, d)).astype("float64"))
        assert torch.equal(mine.nan_to_num(), want.double().nan_to_num()), (name, to)
        assert torch.equal(mine.isnan(), want.isnan()), (name, to)


def test_float8_casts_go_to_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--dtype auto`` of float8 against a wider float casts to float8, which numpy does not here: the whole
    diff is torch's (``usable`` refuses), with the same result as when forced."""
    pa, pb = _pair(tmp_path, fp8_casts=True)
    got = zckpt.diff(pa, pb, progress=False)
    with monkeypatch.context() as m:
        _torch_only(m)
        want = zckpt.diff(pa, pb, progress=False)
    assert got.to_json() == want.to_json()
    assert any(t.compared_as == "float8_e4m3fn" and t.dtype_a == "float32" for t in got.tensors)
    assert zckpt.diff(pa, pb, progress=False, compare_dtype="full").compare_dtype == "full"


def test_finfo_is_torchs() -> None:
    for name, (eps, big, tiny) in diff_report.FINFO.items():
        f = torch.finfo(getattr(torch, name))
        assert (eps, big, tiny) == (f.eps, f.max, f.smallest_normal), name


def _cli_diff_both_ways(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> tuple[Any, Any]:
    """``zckpt ARGV`` (a diff of two inputs that differ) in a fresh interpreter that must never import torch,
    and in this process with the torch comparison forced: (the subprocess's result, CliRunner's)."""
    from typer.testing import CliRunner

    from zckpt.cli.app import app

    done = run_torch_free(argv)
    assert done.returncode == 1, done.stderr[-3000:]
    with monkeypatch.context() as m:
        _torch_only(m)
        want = CliRunner().invoke(app, argv)
    assert want.exit_code == 1
    return done, want


def test_cli_diff_of_safetensors_imports_no_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line, in a fresh interpreter: torch never imported, and the text output byte for byte the
    torch comparison's (values whose squares overflow left out: there a cosine's sign follows the summation
    order, which BLAS picks; JSON: the figures as ``test_numpy_says_what_torch_says`` compares them)."""
    pa, pb = _pair(tmp_path, seed=5, huge=False)
    for extra in ([], ["--json"], ["--dtype", "full", "--top", "5"], ["--dtype", "bf16", "--atol", "1e-3"]):
        done, want = _cli_diff_both_ways(monkeypatch, ["diff", str(pa), str(pb), *extra])
        if extra != ["--json"]:
            assert done.stdout == want.stdout, extra
            continue
        got, ref = json.loads(done.stdout), json.loads(want.stdout)
        assert got["summary"] == ref["summary"] and got["summary"]["differing"] > 50
        for g, w in zip(got["tensors"], ref["tensors"], strict=True):
            assert {k: v for k, v in g.items() if k not in CLOSE} == {
                k: v for k, v in w.items() if k not in CLOSE
            }
            assert g["rel_l2"] == w["rel_l2"] or g["rel_l2"] == pytest.approx(w["rel_l2"], rel=1e-12)


@pytest.mark.parametrize("engine", ["numpy", "torch"])
def test_identical_leading_chunks_are_summed_once(
    tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ZeRO-3 tensor (two pieces: the aligned chunks are cut at the piece boundary) whose first chunk is
    bit-identical and whose last element differs: the leading chunk's norms are summed once (they were
    re-read by windows of ``chunk`` elements, the whole tensor, and counted twice). Oracle: torch's norms of
    the whole tensors."""
    from safetensors.torch import load_file

    src = REPO / "fixtures" / "ds" / "s3_bf16_w2_g2"
    assert src.exists(), f"fixture missing: {src}"
    zckpt.consolidate(src, tmp_path / "m.safetensors", dtype="fp32", progress=False)
    sd = load_file(str(tmp_path / "m.safetensors"))
    key = "emb.weight"
    assert len(zckpt.open(src).entries[key].pieces) == 2
    flat = sd[key].clone().reshape(-1)
    flat[-1] += 1.0
    save_file({**sd, key: flat.reshape(sd[key].shape)}, str(tmp_path / "b.safetensors"))
    if engine == "torch":
        _torch_only(monkeypatch)
    else:
        _numpy_only(monkeypatch)
    r = zckpt.diff(src, tmp_path / "b.safetensors", compare_dtype="full", progress=False)
    t = next(x for x in r.tensors if x.key == key)
    a, b = zckpt.open(src).read(key).double().reshape(-1), flat.double()
    assert t.rel_l2 == pytest.approx(((a - b).norm() / b.norm()).item(), rel=1e-12)
    assert t.norm_a == pytest.approx(a.norm().item(), rel=1e-12)
    assert t.cosine == pytest.approx(torch.nn.functional.cosine_similarity(a, b, dim=0).item(), rel=1e-12)


@pytest.mark.parametrize(
    ("a", "b"),
    [("s3_bf16_w2_g2", "consolidated"), ("s1_bf16_w2", "s2_bf16_w3_g2"), ("s3_fp32_w2", "s3_bf16_w3_sub_g2")],
)
def test_cli_diff_of_deepspeed_checkpoints_imports_no_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, a: str, b: str
) -> None:
    """Real DeepSpeed checkpoints (ZeRO-1/2/3, against each other or a changed consolidation) are compared
    by the command line without importing torch, and it prints what the torch comparison prints."""
    from safetensors.torch import load_file

    pa = REPO / "fixtures" / "ds" / a
    assert pa.exists(), f"fixture missing: {pa}"
    if b == "consolidated":
        zckpt.consolidate(pa, tmp_path / "m.safetensors", dtype="fp32", progress=False)
        sd = load_file(str(tmp_path / "m.safetensors"))
        k = sorted(sd)[0]
        sd[k] = sd[k] * 1.5
        save_file(sd, str(tmp_path / "b.safetensors"))
        pb = tmp_path / "b.safetensors"
    else:
        pb = REPO / "fixtures" / "ds" / b
        assert pb.exists(), f"fixture missing: {pb}"
    done, want = _cli_diff_both_ways(monkeypatch, ["diff", str(pa), str(pb)])
    assert done.stdout == want.stdout
