"""Issue 25's diff / verify points, each on real fixtures (DeepSpeed's and HF Trainer's own files) or
hand-made tensors: tied aliases matched via their owner, options that select nothing are errors, a summary
that agrees with its table, the "... N more" count, ``--map`` reports, and ``verify`` on a file that is not
a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _fixtures import fixture
from safetensors.torch import load_file, save_file
from test_diff import validate
from typer.testing import CliRunner

import zckpt
from zckpt.errors import KeyMappingError, UnknownFormat
from zckpt.ops.diff import diff

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "docs" / "diff-json-schema.json").read_text())
GPT2 = fixture("ds", "gpt2_s3_bf16_w2")  # records lm_head.weight as a tie of transformer.wte.weight
GPT2_REF = fixture("ds", "gpt2_s3_bf16_w2", "ref_fp32.safetensors")  # DeepSpeed's fp32 weights: owner only
TOY = fixture("ds", "s1_bf16_w2")
TOY_REF = fixture("ds", "s1_bf16_w2", "ref_fp32.safetensors")
TRAINER = fixture("trainer", "trainer_z2_w1", "checkpoint-3")
ALIAS, OWNER = "lm_head.weight", "transformer.wte.weight"


def _cli(*args: str) -> tuple[int, str, str]:
    from zckpt.cli.app import app

    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.stdout, res.stderr


def _st(path: Path, sd: dict[str, torch.Tensor]) -> Path:
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


# ---- 1. a tied alias whose owner the other side holds is not a difference -------------------------------
def test_alias_matched_via_owner_on_deepspeed_fixture() -> None:
    """The DeepSpeed checkpoint records ``lm_head.weight`` as a tie; DeepSpeed's own fp32 file stores the
    owner once. Equal both ways, the alias counted as matched, in text and JSON (schema-valid)."""
    assert ALIAS not in load_file(GPT2_REF)  # the premise: B stores only the owner
    for a, b, side in ((GPT2, GPT2_REF, "A"), (GPT2_REF, GPT2, "B")):
        r = diff(a, b, progress=False)
        assert r.equal and not r.only_in_a and not r.only_in_b, r.to_text()
        assert r.aliases_matched == ((side, ALIAS, OWNER),)
        assert "1 tied alias matched via its owner" in r.summary() and "EQUAL" in r.summary()
        js = r.to_json()
        validate(js, SCHEMA)
        assert js["summary"]["aliases_matched"] == 1
        assert js["aliases_matched"] == [{"side": side, "alias": ALIAS, "owner": OWNER}]
    code, out, _ = _cli("diff", str(GPT2), str(GPT2_REF))
    assert code == 0 and "1 tied alias matched via its owner" in out


def test_trainer_folder_against_its_weights_stored_once(tmp_path: Path) -> None:
    """Issue 25's command: an HF Trainer ``checkpoint-N/`` against its weights saved the HF way (a tied weight
    stored once). The Trainer's own ``model.safetensors`` here holds both names; drop the alias as
    safetensors' ``save_model`` does."""
    sd = load_file(TRAINER / "model.safetensors")
    assert ALIAS in sd and torch.equal(sd[ALIAS], sd[OWNER])
    b = _st(tmp_path / "model.safetensors", {k: v for k, v in sd.items() if k != ALIAS})
    code, out, _ = _cli("diff", str(TRAINER), str(b))
    assert code == 0 and out.startswith("28 tensors compared, 0 differ, 1 tied alias matched"), out


def test_alias_still_reports_real_differences(tmp_path: Path) -> None:
    ref = load_file(GPT2_REF)
    # B stores the alias name as a tensor of its own, with other values: compared with A's owner, different
    b = _st(tmp_path / "b.safetensors", {**ref, ALIAS: ref[OWNER] + 1})
    r = diff(GPT2, b, progress=False)
    assert not r.equal and not r.aliases_matched and r.differing == 1
    assert r.tensors[0].key == ALIAS and r.tensors[0].max_abs_diff == pytest.approx(1.0)
    # the owner is absent on the other side: the alias stays one-sided (and so does the owner)
    c = _st(tmp_path / "c.safetensors", {k: v for k, v in ref.items() if k != OWNER})
    r = diff(GPT2, c, progress=False)
    assert not r.equal and set(r.only_in_a) == {ALIAS, OWNER} and not r.aliases_matched
    # the alias alone is compared with B's owner, values and all: a nudged owner differs through the alias
    nudged = {**ref, OWNER: ref[OWNER].clone()}
    nudged[OWNER].view(-1)[5] += 0.25
    d = _st(tmp_path / "d.safetensors", nudged)
    r = diff(GPT2, d, keys=[ALIAS], progress=False)
    assert r.compared == 1 and r.differing == 1 and r.tensors[0].changed == 1
    assert (r.tensors[0].key, r.tensors[0].key_b) == (ALIAS, OWNER)
    assert diff(GPT2, GPT2_REF, keys=[ALIAS], progress=False).equal


# ---- 2. options that select nothing are errors --------------------------------------------------------
def test_keys_matching_nothing_is_an_error(tmp_path: Path) -> None:
    code, out, err = _cli("diff", str(TOY), str(TOY_REF), "--keys", "nomatch*")
    assert (
        code == 2
        and out == ""
        and err.splitlines()[0] == "error: --keys 'nomatch*' matches no tensor name of A or B"
    )
    code, _, err = _cli("diff", str(TOY), str(TOY_REF), "--keys", "fc1.*", "--keys", "fc3.*")
    assert code == 2 and "'fc3.*'" in err  # one typo among good patterns
    with pytest.raises(KeyMappingError, match="nomatch"):
        diff(TOY, TOY_REF, keys=["nomatch"], progress=False)
    assert diff(TOY, TOY_REF, keys=["fc1.*"], progress=False).compared == 2  # a good pattern still works


def test_map_that_renames_nothing_is_an_error(tmp_path: Path) -> None:
    ref = load_file(TOY_REF)
    b = _st(tmp_path / "b.safetensors", {k.replace("fc1.", "ff1."): v for k, v in ref.items()})
    assert diff(TOY_REF, b, map=["fc1.=ff1."], progress=False).equal
    code, _, err = _cli("diff", str(TOY_REF), str(b), "--map", "ff1.=fc1.")  # the wrong way round
    lines = err.splitlines()
    assert code == 2 and lines[0] == "error: --map ff1.=fc1.: no key of A starts with 'ff1.'"
    assert lines[1].endswith("--map fc1.=ff1.?")
    with pytest.raises(KeyMappingError, match="an earlier --map"):  # shadowed by a first match
        diff(TOY_REF, b, map=["fc1.=ff1.", "fc1.w=ff1.w"], progress=False)


def test_include_optimizer_needs_an_optimizer_somewhere(tmp_path: Path) -> None:
    code, _, err = _cli("diff", str(TOY_REF), str(TOY_REF), "--include-optimizer")
    assert code == 2 and err.startswith("error: --include-optimizer: neither A")
    # one side only: the model tensors are compared, and the report says the optimizer states were not
    r = diff(TOY, TOY_REF, include_optimizer=True, progress=False)
    assert not r.optimizer_compared and any("only A holds optimizer states" in n for n in r.notes)
    assert r.notes[-1] in r.to_text()


def test_consolidate_keep_fp32_matching_nothing_is_an_error(tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    code, _, err = _cli("consolidate", str(TOY), str(out), "--keep-fp32", "nrom*", "--no-progress")
    assert code == 2 and "--keep-fp32 'nrom*' matches no tensor name" in err and not out.exists()
    assert not list(tmp_path.iterdir())  # nothing staged or left behind
    with pytest.raises(KeyMappingError):
        zckpt.consolidate(TOY, out, keep_fp32=["position_ids"], progress=False)  # an int64 buffer: no float


# ---- 3. a summary that agrees with its table; the "more" count ----------------------------------------
def test_dtype_summary_agrees_with_table(tmp_path: Path) -> None:
    """A: DeepSpeed's fp32 weights; B: the same with two tensors rounded to bf16 (values and dtype differ)
    and one stored in float64 (same values, dtype differs). The oracle is computed here with torch."""
    ref = load_file(TOY_REF)
    b = dict(ref)
    b["fc1.weight"], b["emb.weight"] = ref["fc1.weight"].bfloat16(), ref["emb.weight"].bfloat16()
    b["norm.bias"] = ref["norm.bias"].double()
    r = diff(TOY_REF, _st(tmp_path / "b.safetensors", b), progress=False, compare_dtype="full")
    same = [k for k in ref if b[k].dtype != ref[k].dtype and torch.equal(b[k].double(), ref[k].double())]
    valued = [k for k in ref if b[k].dtype != ref[k].dtype and k not in same]
    assert (same, sorted(valued)) == (["norm.bias"], ["emb.weight", "fc1.weight"])  # the premise
    assert (r.dtype_mismatches, r.dtype_only, r.differing) == (3, 1, 2)
    assert "3 dtype mismatches (1 equal, 2 differ in value)" in r.summary()
    table = r.to_text().splitlines()[2:]
    assert sorted(line.split()[0] for line in table if line.endswith("values")) == sorted(valued)
    only_values = _st(tmp_path / "c.safetensors", {**ref, "fc1.weight": ref["fc1.weight"].bfloat16()})
    full = diff(TOY_REF, only_values, progress=False, compare_dtype="full").summary()
    assert "1 dtype mismatch (1 differ in value)" in full
    # the default compares each pair at its narrower dtype: B's bf16 tensors are A's cast, B's float64 one
    # is A's upcast (cast back to A's float32), so every value agrees and each cast is said
    auto = diff(TOY_REF, tmp_path / "b.safetensors", progress=False)
    assert auto.equal and (auto.dtype_only, auto.differing) == (3, 0)
    a_cast, b_cast = "A cast to bfloat16 as stored in B", "B cast to float32 as stored in A"
    assert auto.casts == ((a_cast, 2, 2), (b_cast, 1, 1))
    assert (
        f"3 dtype mismatches (2 compared as {a_cast}, 1 compared as {b_cast}: 3 equal; not a difference "
        "without --strict-dtype)" in auto.summary()
    )


def _twenty(tmp_path: Path, differing: int) -> tuple[Path, Path]:
    g = torch.Generator().manual_seed(3)
    a = {f"t{i:02d}": torch.randn(4, generator=g) for i in range(20)}
    b = {k: (v + 0.1 * (i + 1) if i < differing else v) for i, (k, v) in enumerate(a.items())}
    return _st(tmp_path / "a.safetensors", a), _st(tmp_path / "b.safetensors", b)


def test_top_more_count(tmp_path: Path) -> None:
    """18 of 20 tensors differ: ``--top 3`` shows 3 and says 15 more differ (not 17: the 2 equal ones are no
    "more"); the default table shows all 18 and no "more"; ``top`` cut inside the library counts the same."""
    a, b = _twenty(tmp_path, 18)
    code, out, _ = _cli("diff", str(a), str(b), "--top", "3")
    lines = out.splitlines()
    assert (
        code == 1
        and len(lines) == 1 + 1 + 3 + 1
        and lines[-1] == "... 15 more differ (use --top K or --json)"
    )
    assert "more" not in _cli("diff", str(a), str(b))[1]
    assert (
        diff(a, b, top=3, progress=False)
        .to_text(top=3)
        .endswith("... 15 more differ (use --top K or --json)")
    )
    assert "more" not in diff(a, b, progress=False).to_text(top=20)  # 20 rows hold all 18
    (tmp_path / "all").mkdir()
    c, d = _twenty(tmp_path / "all", 20)
    assert diff(c, d, progress=False).to_text().count("\n") == 1 + 20  # default cap 20: all shown, none left


# ---- 4. --map reports names consistently ------------------------------------------------------------
def test_map_reports_mapped_names(tmp_path: Path) -> None:
    ref = load_file(TOY_REF)
    b = _st(
        tmp_path / "b.safetensors", {k.replace("fc1.", "ff1."): v for k, v in ref.items() if k != "fc1.bias"}
    )
    r = diff(TOY_REF, b, map=["fc1.=ff1."], progress=False)
    assert r.only_in_a == ("fc1.bias",) and r.only_in_b == () and r.compared == len(ref) - 1
    assert "only in A: fc1.bias -> ff1.bias" in r.to_text().splitlines()
    assert not [line for line in r.to_text().splitlines() if line.startswith("only in B")]


# ---- 5. verify on something that is not a checkpoint ------------------------------------------------
def test_verify_not_a_checkpoint_is_an_error(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    code, out, err = _cli("verify", str(notes))
    _, _, err_inspect = _cli("inspect", str(notes))
    assert (
        code == 2 and out == "" and err == err_inspect and err.startswith(f"error: {notes}: not a checkpoint")
    )
    assert len(err.splitlines()) == 2 and err.splitlines()[1].startswith("hint: ")
    with pytest.raises(UnknownFormat):
        zckpt.verify(tmp_path)  # a folder with no checkpoint and no tensor file in it
    # a damaged tensor file that no reader can open is still a problem of the checkpoint (exit 1)
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(TOY_REF.read_bytes()[:100])
    code, out, _ = _cli("verify", str(bad))
    assert code == 1 and "truncated" in out


# ---- issue 40.1: a checkpoint against its 16-bit export is EQUAL, and says how it was compared -----------
@pytest.mark.parametrize("case", ["s1_bf16_w2", "gpt2_s3_bf16_w2"])
def test_checkpoint_equals_its_default_export(tmp_path: Path, case: str) -> None:
    """``consolidate`` (default dtype) of a bf16 DeepSpeed run writes the fp32 masters cast to bf16; ``diff``
    of the checkpoint against that file is EQUAL by default, saying A was cast to B's bf16. The oracle is
    DeepSpeed's own fp32 weights cast by torch. ``--dtype full`` compares as stored (every rounding shows),
    and a tolerance that hides the rounding never calls the values the same."""
    ckpt, ref = fixture("ds", case), load_file(fixture("ds", case, "ref_fp32.safetensors"))
    out = tmp_path / "m.safetensors"
    zckpt.consolidate(ckpt, out, progress=False)
    got = load_file(out)
    cast = [k for k in got if got[k].dtype == torch.bfloat16]
    assert cast and all(torch.equal(got[k], ref[k].to(torch.bfloat16)) for k in cast)  # the premise
    assert any(not torch.equal(got[k].float(), ref[k]) for k in cast)  # the cast rounded something
    js = json.loads(_cli("diff", str(ckpt), str(out), "--json")[1])
    validate(js, SCHEMA)
    masters = [t["key"] for t in js["tensors"] if (t["dtype_a"], t["dtype_b"]) == ("float32", "bfloat16")]
    n = len(masters)  # the checkpoint's fp32 masters (its 16-bit frozen params and buffers match B's dtype)
    assert n and js["options"]["compare_dtype"] == "auto" and js["summary"]["dtype_only"] == n
    assert {t["compared_as"] for t in js["tensors"] if t["key"] in masters} == {"bfloat16"}
    code, text, _ = _cli("diff", str(ckpt), str(out), "--no-progress")
    assert code == 0, text
    head = text.splitlines()[0]
    assert f"{n} dtype mismatches (compared as A cast to bfloat16 as stored in B: {n} equal" in head
    assert head.endswith("EQUAL (atol=0, rtol=0, compared in float64)"), head
    # at full precision the masters differ from their bf16 rounding: DIFFERENT, never "same values"
    code, text, _ = _cli("diff", str(ckpt), str(out), "--no-progress", "--dtype", "full")
    rounded = sum(not torch.equal(got[k].float(), ref[k]) for k in masters)
    assert code == 1 and f"{rounded} differ in value" in text.splitlines()[0], text
    code, text, _ = _cli("diff", str(ckpt), str(out), "--no-progress", "--dtype", "full", "--rtol", "4e-3")
    head = text.splitlines()[0]
    assert code == 0 and f"{rounded} within tolerance" in head and "same" not in head, head
    # the explicit dtype: both sides at bf16 is the same verdict as auto
    assert _cli("diff", str(ckpt), str(out), "--no-progress", "--dtype", "bfloat16")[0] == 0


def test_export_off_by_one_ulp_differs(tmp_path: Path) -> None:
    """B is A cast to bf16 but for one element moved one bf16 step: the default comparison (A cast to bf16)
    finds exactly that element; a wrong comparison dtype is one clear error."""
    g = torch.Generator().manual_seed(7)
    a = {"w": torch.randn(64, generator=g), "b": torch.randn(8, generator=g)}
    b = {k: v.to(torch.bfloat16) for k, v in a.items()}
    bits = b["w"].view(torch.int16).clone()
    bits[5] += 1  # the next bf16 value
    b["w"] = bits.view(torch.bfloat16)
    pa, pb = _st(tmp_path / "a.safetensors", a), _st(tmp_path / "b.safetensors", b)
    r = diff(pa, pb, progress=False)
    w = next(t for t in r.tensors if t.key == "w")
    assert not r.equal and r.differing == 1 and w.changed == 1 and w.compared_as == "bfloat16"
    assert w.max_abs_diff == pytest.approx(abs(float(b["w"][5]) - float(a["w"][5].to(torch.bfloat16))))
    assert "1 equal, 1 differ in value" in r.summary()
    code, _, err = _cli("diff", str(pa), str(pb), "--dtype", "int8")
    assert code == 2 and err.startswith("error: unknown comparison dtype 'int8'") and "Traceback" not in err
