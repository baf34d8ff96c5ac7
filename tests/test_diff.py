"""zckpt.ops.diff against hand computations on hand-made checkpoints (tests/_handmade.py), and against
DeepSpeed's own zero_to_fp32 output when the real fixtures exist."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _fixtures import fixture
from _handmade import make_ckpt

import zckpt
from zckpt.errors import KeyMappingError
from zckpt.ops.diff import DiffResult, diff

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "docs" / "diff-json-schema.json").read_text())


def _base() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "emb.weight": torch.randn(13, 7, generator=g),
        "fc.weight": torch.randn(11, 7, generator=g),
        "fc.bias": torch.randn(11, generator=g),
        "norm.weight": torch.randn(7, generator=g).to(torch.bfloat16),
        "position_ids": torch.arange(5, dtype=torch.int64),
        "scale": torch.tensor([0.5]),
    }


def _oracle(a: torch.Tensor, b: torch.Tensor, atol: float = 0.0, rtol: float = 0.0) -> dict[str, float]:
    """Full-tensor float64 reference, written independently of zckpt.ops.diff's chunked code."""
    a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
    d = (a64 - b64).abs()
    rel = torch.where(d == 0, torch.zeros_like(d), d / b64.abs())
    changed = (~torch.isclose(a64, b64, rtol=rtol, atol=atol, equal_nan=True)).sum().item()
    return {
        "max_abs_diff": d.max().item(),
        "max_rel_diff": rel.max().item(),
        "rel_l2": (torch.linalg.vector_norm(a64 - b64) / torch.linalg.vector_norm(b64)).item(),
        "cosine": torch.nn.functional.cosine_similarity(a64, b64, dim=0).item(),
        "changed": changed,
        "fraction_changed": changed / a64.numel(),
    }


def _by_key(r: DiffResult) -> dict[str, Any]:
    return {t.key: t for t in r.tensors}


def test_equal_across_layouts_and_ties(tmp_path: Path) -> None:
    t = _base()
    a = make_ckpt(tmp_path / "a", t, world=2, tied={"head.weight": "emb.weight"})
    b = make_ckpt(tmp_path / "b", t, world=3, pad=0, tied={"head.weight": "emb.weight"})
    r = diff(a, b, progress=False, chunk=5)  # chunk 5 crosses every piece boundary
    assert r.equal, r.to_text()
    assert r.compared == len(t) and r.tied_skipped == 1 and r.differing == 0
    assert not r.only_in_a and not r.only_in_b
    for td in r.tensors:
        assert td.max_abs_diff == 0 and td.changed == 0 and td.nan_a == 0  # padding (NaN) never read
        assert td.rel_l2 == 0
    validate(r.to_json(), SCHEMA)


def test_nudged_tensor_matches_hand_computation(tmp_path: Path) -> None:
    t = _base()
    nudged = dict(t)
    w = t["fc.weight"].clone()
    w[3, 2] += 0.25
    w[7, 0] -= 1e-3
    w[10, 6] *= 1.5
    nudged["fc.weight"] = w
    a = make_ckpt(tmp_path / "a", nudged)
    b = make_ckpt(tmp_path / "b", t, world=3)
    for atol, rtol in [(0.0, 0.0), (1e-2, 0.0), (0.0, 0.3)]:
        r = diff(a, b, atol=atol, rtol=rtol, progress=False, chunk=4)
        assert not r.equal and r.differing == 1
        td = r.tensors[0]  # most changed first
        assert td.key == "fc.weight" and td.reasons == ("values",)
        exp = _oracle(w, t["fc.weight"], atol, rtol)
        assert td.changed == exp["changed"] and td.fraction_changed == pytest.approx(exp["fraction_changed"])
        for k in ("max_abs_diff", "max_rel_diff", "rel_l2", "cosine"):
            assert getattr(td, k) == pytest.approx(exp[k], rel=1e-12, abs=1e-15), k
        assert all(not x.differs for x in r.tensors[1:])
    assert _oracle(w, t["fc.weight"])["changed"] == 3
    # within tolerance: equal
    assert diff(a, b, atol=0.3, progress=False).equal
    assert diff(a, b, rtol=0.51, atol=1e-3, progress=False).equal


def test_dropped_key_and_changed_dtype_reported_exactly(tmp_path: Path) -> None:
    t = _base()
    other = dict(t)
    del other["fc.bias"]
    other["fc.weight"] = t["fc.weight"].to(torch.bfloat16)
    a = make_ckpt(tmp_path / "a", t)
    b = make_ckpt(tmp_path / "b", other)
    r = diff(a, b, progress=False, compare_dtype="full")  # as stored: the rounding to bf16 shows
    assert r.only_in_a == ("fc.bias",) and r.only_in_b == ()
    assert r.dtype_mismatches == 1 and r.shape_mismatches == 0 and r.differing == 1
    td = _by_key(r)["fc.weight"]
    assert (td.dtype_a, td.dtype_b) == ("float32", "bfloat16")
    assert td.reasons == ("values",)  # the rounding to bf16 changed values; the dtype alone would not count
    exp = _oracle(t["fc.weight"], t["fc.weight"].to(torch.bfloat16))
    assert td.max_abs_diff == pytest.approx(exp["max_abs_diff"], rel=1e-12)
    assert td.changed == exp["changed"]
    assert diff(a, b, strict_dtype=True, progress=False, compare_dtype="full").tensors[0].reasons == (
        "dtype",
        "values",
    )
    # by default B (bf16) is compared with A cast to bf16: exactly what B holds, so no value differs
    auto = diff(a, b, progress=False)
    assert auto.differing == 0 and auto.dtype_only == 1 and not auto.equal  # fc.bias is still only in A
    assert auto.casts == (("A cast to bfloat16 as stored in B", 1, 1),)
    # values compared in float64 after exact upcasting: the same values in another dtype are equal,
    # the dtype difference is reported, and counts only with strict_dtype
    up = make_ckpt(tmp_path / "c", {k: v.float() if v.is_floating_point() else v for k, v in t.items()})
    r2 = diff(a, up, progress=False)
    assert r2.equal and r2.dtype_mismatches == 1 and "--strict-dtype" in r2.summary()
    assert _by_key(r2)["norm.weight"].reasons == () and _by_key(r2)["norm.weight"].changed == 0
    r3 = diff(a, up, strict_dtype=True, progress=False)
    assert not r3.equal and r3.dtype_mismatches == 1 and _by_key(r3)["norm.weight"].reasons == ("dtype",)
    js = r.to_json()
    validate(js, SCHEMA)
    assert js["equal"] is False and js["only_in_a"] == ["fc.bias"]


def test_shape_mismatch_is_not_value_compared(tmp_path: Path) -> None:
    t = _base()
    a = make_ckpt(tmp_path / "a", t)
    b = make_ckpt(tmp_path / "b", {**t, "fc.bias": torch.zeros(12)})
    r = diff(a, b, progress=False)
    td = r.tensors[0]
    assert td.key == "fc.bias" and td.reasons == ("shape",) and td.rel_l2 is None and r.shape_mismatches == 1
    validate(r.to_json(), SCHEMA)


def test_nonfinite_and_integers(tmp_path: Path) -> None:
    x = torch.tensor([1.0, float("nan"), float("inf"), -2.0, 0.0, 3.0])
    y = torch.tensor([1.0, float("nan"), float("inf"), -2.0, 0.0, float("nan")])
    z = torch.tensor([0.0, 1.0, 2.0])
    a = make_ckpt(tmp_path / "a", {"x": x, "i": torch.tensor([1, 2, 3]), "z": z})
    b = make_ckpt(tmp_path / "b", {"x": y, "i": torch.tensor([1, 2, 4]), "z": torch.zeros(3)})
    r = diff(a, b, atol=10.0, progress=False)  # tolerances never apply to integers
    k = _by_key(r)
    assert (k["x"].nan_a, k["x"].nan_b, k["x"].inf_a, k["x"].inf_b) == (1, 2, 1, 1)
    assert k["x"].changed == 1 and k["x"].max_abs_diff == 0.0  # metrics over elements finite on both sides
    assert k["i"].changed == 1 and k["i"].max_abs_diff == 1.0 and k["i"].max_rel_diff == pytest.approx(0.25)
    assert k["z"].rel_l2 == math.inf and k["z"].cosine is None and k["z"].max_rel_diff == math.inf
    js = r.to_json()
    validate(js, SCHEMA)
    zj = next(t for t in js["tensors"] if t["key"] == "z")
    assert zj["rel_l2"] == "inf" and zj["cosine"] is None
    json.dumps(js, allow_nan=False)


def test_map_keys_and_optimizer(tmp_path: Path) -> None:
    t = _base()
    opt = {"fc.weight:exp_avg": torch.ones(11, 7), "fc.bias:exp_avg": torch.ones(11)}
    a = make_ckpt(tmp_path / "a", {f"module.{k}": v for k, v in t.items()},
                  optim={f"module.{k}": v for k, v in opt.items()})  # fmt: skip
    opt_b = {**opt, "fc.bias:exp_avg": torch.full((11,), 2.0)}
    b = make_ckpt(tmp_path / "b", t, optim=opt_b)
    r = diff(a, b, progress=False)
    assert len(r.only_in_a) == len(t) and r.compared == 0
    r = diff(a, b, map=["module.="], progress=False)
    assert r.equal and r.compared == len(t) and not r.optimizer_compared
    r = diff(a, b, map=["module.="], include_optimizer=True, progress=False)
    assert r.optimizer_compared and r.compared == len(t) + 2 and r.differing == 1
    td = r.tensors[0]
    assert td.key == "module.fc.bias:exp_avg" and td.key_b == "fc.bias:exp_avg" and td.role == "optim"
    assert td.rel_l2 == pytest.approx(0.5)
    r = diff(a, b, map=["module.="], keys=["fc.*"], include_optimizer=True, progress=False)
    assert sorted(x.key_b for x in r.tensors) == [
        "fc.bias",
        "fc.bias:exp_avg",
        "fc.weight",
        "fc.weight:exp_avg",
    ]
    # a side without optimizer states: nothing listed as one-sided
    c = make_ckpt(tmp_path / "c", t)
    r = diff(a, c, map=[("module.", "")], include_optimizer=True, progress=False)
    assert r.equal and not r.optimizer_compared
    with pytest.raises(KeyMappingError):
        diff(a, b, map=["module"], progress=False)
    with pytest.raises(KeyMappingError):
        diff(a, b, map=["module.emb.=fc.", "module.="], progress=False)  # emb.weight and fc.weight collide


def test_top_and_text(tmp_path: Path) -> None:
    t = _base()
    a = make_ckpt(tmp_path / "a", {k: (v + 1 if v.is_floating_point() else v) for k, v in t.items()})
    b = make_ckpt(tmp_path / "b", t)
    r = diff(a, b, top=2, progress=False)
    assert r.differing == 5 and len(r.tensors) == 2
    assert r.tensors[0].rel_l2 >= r.tensors[1].rel_l2  # type: ignore[operator]
    text = r.to_text()
    assert text.splitlines()[0].startswith("6 tensors compared, 5 differ") and "DIFFERENT" in text
    assert "scale" in text  # |+1| on 0.5 is the largest relative change


def test_lazy_entry_point(tmp_path: Path) -> None:
    t = _base()
    a = make_ckpt(tmp_path / "a", t)
    assert zckpt.diff(a, a, progress=False).equal


# -- real DeepSpeed: our reader vs DeepSpeed's own zero_to_fp32 ------------------------------------

DS = sorted(p.parent.parent for p in fixture("ds").glob("*/ref_zero_to_fp32/*") if p.is_file())
assert DS, "no DeepSpeed fixture with a zero_to_fp32 reference: restore fixtures/ds"


@pytest.mark.parametrize("case", DS, ids=[p.name for p in DS])
def test_deepspeed_fixture_matches_zero_to_fp32(case: Path) -> None:
    info = json.loads((case / "case.json").read_text())
    ref = case / "ref_zero_to_fp32"
    ref_path = next(iter(sorted(ref.iterdir()))) if len(list(ref.iterdir())) == 1 else ref
    r = diff(case, ref_path, progress=False)
    # zero_to_fp32 drops frozen params of ZeRO-0/1 checkpoints (DeepSpeed saves frozen_param_shapes
    # only for stage >= 2, deepspeed-format.md §4.3); we read them from `module`.
    dropped = sorted(info.get("frozen", [])) if info["stage"] < 2 else []
    assert sorted(r.only_in_a) == dropped and r.only_in_b == (), r.to_text()
    assert r.differing == 0 and r.shape_mismatches == 0, r.to_text(top=10)
    assert r.equal == (not dropped)
    assert (_cli(str(case), str(ref_path))[0] == 0) == (not dropped)  # the user's question: same model? yes
    # ... except for the frozen params zero_to_fp32 left out, which the report explains
    assert bool(r.notes) == bool(dropped) and all("frozen parameter of A" in n for n in r.notes), r.notes
    k = _by_key(r)
    for name in info["param_shapes"]:
        if name in info.get("frozen", []):
            continue
        td = k[name]  # trainable params: fp32 masters, bit-exact
        assert td.dtype_a == td.dtype_b == "float32" and td.changed == 0 and td.max_abs_diff == 0, name
    # dtype-only mismatches are 16-bit frozen params / buffers upcast by zero_to_fp32 (values exact)
    for td in r.tensors:
        if td.dtype_a != td.dtype_b:
            assert td.dtype_b == "float32" and td.changed == 0, td


# -- a small JSON-schema validator (jsonschema is not a dependency) -------------------------------


def validate(x: Any, schema: dict[str, Any], root: dict[str, Any] | None = None, where: str = "$") -> None:
    """Validate the subset of JSON Schema our schemas use: $ref to #/$defs, type (str or list),
    enum, const, properties, required, additionalProperties: false, items, minimum, oneOf."""
    root = root or schema
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/$defs/")
        return validate(x, root["$defs"][name], root, where)
    if "oneOf" in schema:
        ok = 0
        for s in schema["oneOf"]:
            try:
                validate(x, s, root, where)
                ok += 1
            except AssertionError:
                pass
        assert ok == 1, f"{where}: {x!r} matches {ok} of oneOf"
        return None
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        py = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
        good = any(
            (isinstance(x, int) and not isinstance(x, bool)) if ty == "integer"
            else (isinstance(x, (int, float)) and not isinstance(x, bool)) if ty == "number"
            else isinstance(x, py[ty])
            for ty in types
        )  # fmt: skip
        assert good, f"{where}: {x!r} is not {types}"
    if "enum" in schema:
        assert x in schema["enum"], f"{where}: {x!r} not in {schema['enum']}"
    if "const" in schema:
        assert x == schema["const"], f"{where}: {x!r} != {schema['const']!r}"
    if "minimum" in schema and isinstance(x, (int, float)) and not isinstance(x, bool):
        assert x >= schema["minimum"], f"{where}: {x} < {schema['minimum']}"
    if isinstance(x, dict):
        for k in schema.get("required", []):
            assert k in x, f"{where}: missing {k!r}"
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            extra = set(x) - set(props)
            assert not extra, f"{where}: unexpected {sorted(extra)}"
        for k, v in x.items():
            if k in props:
                validate(v, props[k], root, f"{where}.{k}")
    if isinstance(x, list) and "items" in schema:
        for i, v in enumerate(x):
            validate(v, schema["items"], root, f"{where}[{i}]")
    return None


def test_validator_rejects_bad_documents(tmp_path: Path) -> None:
    a = make_ckpt(tmp_path / "a", _base())
    js = diff(a, a, progress=False).to_json()
    validate(js, SCHEMA)
    for bad in ({**js, "equal": "yes"}, {k: v for k, v in js.items() if k != "summary"}, {**js, "x": 1},
                {**js, "tensors": [{**js["tensors"][0], "rel_l2": "big"}]}):  # fmt: skip
        with pytest.raises(AssertionError):
            validate(bad, SCHEMA)


# -- CLI -----------------------------------------------------------------------------------------


def _cli(*args: str) -> tuple[int, str]:
    from typer.testing import CliRunner

    from zckpt.cli.app import app

    res = CliRunner().invoke(app, ["diff", *args])
    return res.exit_code, res.output


def _save_st(path: Path, sd: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def test_cli_exit_codes_and_json(tmp_path: Path) -> None:
    t = _base()
    a = _save_st(tmp_path / "a.safetensors", t)
    b = _save_st(tmp_path / "b.safetensors", {**t, "fc.bias": t["fc.bias"] + 0.5})
    code, out = _cli(str(a), str(a))
    assert code == 0 and out.startswith("6 tensors compared, 0 differ") and "EQUAL" in out
    code, out = _cli(str(a), str(b))
    assert code == 1 and "fc.bias" in out.splitlines()[2]
    code, out = _cli(str(a), str(b), "--json", "--top", "1")
    js = json.loads(out)
    validate(js, SCHEMA)
    assert code == 1 and [x["key"] for x in js["tensors"]] == ["fc.bias"] and js["summary"]["differing"] == 1
    assert js["tensors"][0]["max_abs_diff"] == pytest.approx(0.5, rel=1e-6)
    assert _cli(str(a), str(b), "--atol", "0.51")[0] == 0
    assert _cli(str(a), str(tmp_path / "missing.safetensors"))[0] == 2
    assert _cli(str(a), str(b), "--map", "nomapping")[0] == 2


def test_cli_deepspeed_vs_nudged_zero_to_fp32_copy(tmp_path: Path) -> None:
    """Done-when of issue 5: a nudged copy of DeepSpeed's own output exits 1 naming the tensor in --json."""
    cases = [c for c in DS if (c / "ref_zero_to_fp32" / "pytorch_model.bin").is_file()]
    assert cases, "no DeepSpeed fixture with a zero_to_fp32 pytorch_model.bin: restore fixtures/ds"
    case = cases[0]
    ref = torch.load(case / "ref_zero_to_fp32" / "pytorch_model.bin", weights_only=True)
    info = json.loads((case / "case.json").read_text())
    names = [n for n in info["param_shapes"] if n not in info.get("frozen", [])]
    tied = set(info.get("tied", {})) | set(info.get("tied", {}).values())
    by_size = sorted((n for n in names if n not in tied), key=lambda n: -math.prod(info["param_shapes"][n]))
    nudge, drop, recast = by_size[0], by_size[1], by_size[2]
    orig = ref[nudge].clone()
    sd = {k: v.clone() for k, v in ref.items() if k != drop}
    sd[nudge].view(-1)[3] += 1e-3
    sd[recast] = sd[recast].to(torch.float64)
    torch.save(sd, tmp_path / "nudged.bin")
    keys = [f"--keys={n}" for n in names]  # frozen params are not in zero_to_fp32's output for ZeRO-1
    code, out = _cli(str(case), str(tmp_path / "nudged.bin"), "--json", *keys)
    js = json.loads(out)
    validate(js, SCHEMA)
    assert code == 1 and js["only_in_a"] == [drop] and js["only_in_b"] == []
    by = {t["key"]: t for t in js["tensors"]}
    assert by[recast]["reasons"] == [] and by[recast]["changed"] == 0 and not by[recast]["differs"]
    strict = json.loads(_cli(str(case), str(tmp_path / "nudged.bin"), "--json", "--strict-dtype", *keys)[1])
    assert {t["key"]: t for t in strict["tensors"]}[recast]["reasons"] == ["dtype"]
    assert by[nudge]["reasons"] == ["values"] and by[nudge]["changed"] == 1
    exp = _oracle(orig, sd[nudge])
    for k in ("max_abs_diff", "max_rel_diff", "rel_l2", "cosine"):
        assert by[nudge][k] == pytest.approx(exp[k], rel=1e-12), k
    assert [t["key"] for t in js["tensors"] if t["differs"]][0] == nudge  # most changed first
    assert _cli(str(case), str(case / "ref_zero_to_fp32"), *keys)[0] == 0
