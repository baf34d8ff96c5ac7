"""``zckpt consolidate`` never imports torch when the job needs no torch object (issue 42): DeepSpeed
ZeRO-1/2/3, DCP, HF safetensors, HF Trainer, Megatron and native inputs, local or ``s3://``, to a
safetensors file or a sharded HF folder, every ``--dtype``, ``--keep-fp32``, ``--exclude-frozen``, tied
weights, sidecars.

Oracle: the same consolidation in this process, which has imported torch, so its casts run in torch
(``zckpt.stream.cast.cast_into`` hands them to torch when it is imported): every output file, sidecars and
index included, must be byte-identical. The torch-free runs are fresh interpreters that check ``sys.modules``
at their end. ZeRO-0 is left out: its reader matches fp32 masters to params by value, with torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import _s3
import pytest
import torch
from _torchfree import run_torch_free

import zckpt
from zckpt.cli.consolidate import needs_torch

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "fixtures"
DTYPES = ("auto", "fp32", "bf16", "fp16")

_NO_TORCH_JOBS = """
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import zckpt
    for ck, out, kw in json.loads(sys.argv[1]):
        zckpt.consolidate(ck, out, progress=False, **kw)
    leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    assert not leaked, leaked[:5]
"""


def _family(name: str, native: Path) -> list[Path]:
    """The checkpoints of one input family, every committed one (a family with none is an error)."""
    found = {
        "deepspeed": [p for p in sorted((FIX / "ds").iterdir())
                      if p.is_dir() and not p.name.startswith("s0_")],
        "dcp": [p / "checkpoint" for p in sorted((FIX / "dcp").iterdir()) if (p / "checkpoint").is_dir()
                and p.name != "zstd_w2"],  # compressed items: refused by zckpt whatever the path
        "hf": sorted((FIX / "dcp").glob("*/ref_model.safetensors")),
        "trainer": sorted((FIX / "trainer").glob("*/checkpoint-3")),
        "megatron": [p for p in sorted((FIX / "megatron").glob("*/ckpt"))
                     if not p.parent.name.startswith("legacy")],  # the legacy format: refused
        "native": [native],
    }[name]  # fmt: skip
    assert found and all(p.exists() for p in found), f"fixtures missing for {name}"
    return found


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A native checkpoint, written here from a real DeepSpeed one (none is committed)."""
    out = tmp_path_factory.mktemp("native") / "ck"
    zckpt.reshard(FIX / "ds" / "s3_bf16_w2_g2", out, world=3, to="native", progress=False)
    return out


def _jobs(cks: list[Path], out: Path) -> list[tuple[str, str, dict[str, Any]]]:
    """Every checkpoint in every dtype; the first also as a sharded HF folder with ``keep_fp32`` and
    ``exclude_frozen``."""
    jobs = [(str(ck), str(out / f"{i}.{dt}.safetensors"), {"dtype": dt}) for i, ck in enumerate(cks)
            for dt in DTYPES]  # fmt: skip
    more = {"dtype": "bf16", "keep_fp32": ["*"], "exclude_frozen": True, "max_shard_size": "300B"}
    jobs.append((str(cks[0]), str(out / "folder"), more))
    return jobs


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("family", ["deepspeed", "dcp", "hf", "trainer", "megatron", "native"])
def test_torch_free_output_equals_torch(family: str, native: Path, tmp_path: Path) -> None:
    cks = _family(family, native)
    free, ref = tmp_path / "free", tmp_path / "torch"
    free.mkdir()
    ref.mkdir()
    argv = [sys.executable, "-c", textwrap.dedent(_NO_TORCH_JOBS), json.dumps(_jobs(cks, free))]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch" in sys.modules  # the oracle's casts run in torch
    for ck, out, kw in _jobs(cks, ref):
        zckpt.consolidate(ck, out, progress=False, **kw)
    got, want = _files(free), _files(ref)
    assert sorted(got) == sorted(want)
    assert len(want) >= 2 * len(cks) * len(DTYPES)  # each file and its sidecar
    assert [k for k in want if got[k] != want[k]] == []


def _cli_without_torch(argv: list[str], env: dict[str, str] | None = None) -> None:
    """``zckpt ARGV`` (the program's own entry) in a fresh interpreter that then checks torch was never
    imported."""
    done = run_torch_free(argv, env)
    assert done.returncode == 0, done.stderr[-3000:]


CLI_CASES = {
    "zero1": (FIX / "ds" / "s1_bf16_w2", ["--dtype", "fp32"]),
    "zero2-offload": (FIX / "ds" / "s2_fp32_w3_offopt", ["--dtype", "bf16", "--exclude-frozen"]),
    "zero3": (FIX / "ds" / "s3_bf16_w2_g2", []),
    "dcp": (FIX / "dcp" / "fsdp2_w2" / "checkpoint", ["--dtype", "fp16"]),
    "hf-safetensors": (FIX / "dcp" / "fsdp2_w2" / "ref_model.safetensors", ["--dtype", "bf16"]),
    "trainer": (
        FIX / "trainer" / "trainer_z2_w2" / "checkpoint-3",
        ["--dtype", "bf16", "--keep-fp32", "*ln_*"],
    ),
    "megatron": (FIX / "megatron" / "tp2_fp32_gpt2" / "ckpt", ["--dtype", "bf16"]),
    "native": (Path("native"), ["--dtype", "bf16"]),
}


def _library_kwargs(opts: list[str]) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    it = iter(opts)
    for o in it:
        if o == "--exclude-frozen":
            kw["exclude_frozen"] = True
        elif o == "--keep-fp32":
            kw["keep_fp32"] = [next(it)]
        else:
            kw[o.lstrip("-").replace("-", "_")] = next(it)
    return kw


@pytest.mark.parametrize("case", sorted(CLI_CASES))
@pytest.mark.parametrize("layout", ["file", "folder"])
def test_cli_consolidate_imports_no_torch(case: str, layout: str, native: Path, tmp_path: Path) -> None:
    ck, opts = CLI_CASES[case]
    ck = native if case == "native" else ck
    assert ck.exists(), f"fixture missing: {ck}"
    name = "m.safetensors" if layout == "file" else "hf"
    shard = ["--max-shard-size", "400B"] if layout == "folder" else []
    _cli_without_torch(["consolidate", str(ck), str(tmp_path / "free" / name), *opts, *shard, "--json"])
    kw = _library_kwargs(opts + shard)
    zckpt.consolidate(ck, tmp_path / "torch" / name, progress=False, **kw)
    got, want = _files(tmp_path / "free"), _files(tmp_path / "torch")
    assert got == want and len(want) >= 2


def test_python_m_zckpt_consolidate_imports_no_torch(tmp_path: Path) -> None:
    """The program itself (``python -m zckpt``, whose ``main`` ends the process without returning): every
    module it imports is listed by ``-X importtime``; torch is not among them (numpy is: the casts')."""
    out = tmp_path / "m.safetensors"
    ck = FIX / "ds" / "s3_bf16_w2_g2"
    argv = [sys.executable, "-X", "importtime", "-m", "zckpt", "consolidate", str(ck), str(out),
            "--dtype", "fp16", "--no-progress"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = {
        line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")
    }
    assert "numpy" in imported and "zckpt.stream.cast" in imported
    assert sorted(m for m in imported if m == "torch" or m.startswith("torch.")) == []
    assert out.stat().st_size > 0


def test_cli_consolidate_from_bucket_imports_no_torch(s3_server: _s3.Server, tmp_path: Path) -> None:
    """An ``s3://`` ZeRO-3 checkpoint, the client configured by the user's environment only; written to a
    local file, and into the bucket."""
    c = s3_server.client()
    url = _s3.upload(c, FIX / "ds" / "s3_bf16_w3_sub_g2", "ckpts", "notorch/z3")
    env = dict(_s3.env_for(s3_server.url))
    _cli_without_torch(["consolidate", url, str(tmp_path / "free" / "m.safetensors"), "--dtype", "fp16"], env)
    _cli_without_torch(["consolidate", url, "s3://ckpts/notorch/out/m.safetensors", "--dtype", "fp16"], env)
    zckpt.consolidate(FIX / "ds" / "s3_bf16_w3_sub_g2", tmp_path / "torch" / "m.safetensors", dtype="fp16",
                      progress=False)  # fmt: skip
    want = _files(tmp_path / "torch")
    assert _files(tmp_path / "free") == want
    obj = c.get_object(Bucket="ckpts", Key="notorch/out/m.safetensors")  # type: ignore[attr-defined]
    assert obj["Body"].read() == want["m.safetensors"]


def test_torch_only_where_the_job_needs_it() -> None:
    """The CLI imports torch up front (reading input ahead meanwhile) only for a torch file output,
    ``--trust-pickle`` or ranks under torchrun."""
    assert not needs_torch({"out": "m.safetensors"})
    assert not needs_torch({"out": "hf_folder", "format": None})
    assert needs_torch({"out": "m.bin"}) and needs_torch({"out": "model.pt"})
    assert needs_torch({"out": "hf_folder", "format": "bin"})
    assert needs_torch({"out": "m.safetensors", "trust_pickle": True})


def test_torch_only_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert needs_torch({"out": "m.safetensors"})


def test_bin_output_still_imports_torch(tmp_path: Path) -> None:
    """A ``.bin`` is torch's pickle format: written with torch, loadable by ``torch.load``."""
    ck = FIX / "ds" / "s3_bf16_w2_g2"
    zckpt.consolidate(ck, tmp_path / "m.bin", dtype="bf16", progress=False)
    zckpt.consolidate(ck, tmp_path / "m.safetensors", dtype="bf16", progress=False)
    from safetensors.torch import load_file

    got, want = torch.load(tmp_path / "m.bin", weights_only=True), load_file(tmp_path / "m.safetensors")
    assert set(want) <= set(got) and all(torch.equal(got[k], want[k]) for k in want)
