"""``zckpt inspect`` and ``zckpt verify`` never import torch (issue 42): each format family's metadata is read
through ``zckpt.dtypes.DType``, the restricted unpickler's stand-ins and byte-level checks only.

Each case runs the command line (``zckpt.cli.app``) in a fresh interpreter and asserts that ``torch`` is
not in ``sys.modules`` afterwards, nor anything else a metadata command's start-up (<= 0.3 s on 2 cores)
has no use for: ``HEAVY`` (numpy, pydantic through typer's converters (``zckpt.cli._coerce``), tqdm with no
bar shown, the object-store client's network modules for a local path). Oracle for what it printed: the
same report from the library in this process, which has imported torch (``zckpt.inspect`` /
``zckpt.verify``), so the torch-free path says exactly what the torch-backed one does. A start-up time
check lives in ``bench/startup.py`` (no wall clock here).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zckpt

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "fixtures"
HEAVY = (
    "torch", "numpy", "pydantic", "pydantic_core", "typer._adapters", "tqdm", "rich", "matplotlib", "obstore",
    "fsspec", "ssl", "http.client", "email", "configparser",
)  # fmt: skip
"""Packages (and modules) ``inspect`` / ``verify`` of a local checkpoint must not import."""


def _cli_without_torch(*argv: str) -> dict[str, object]:
    """``zckpt ARGV --json`` in a fresh interpreter; its JSON, after checking nothing of ``HEAVY`` (torch
    first) was imported."""
    code = f"""
        import sys
        sys.argv = ["zckpt", *{list(argv)!r}, "--json"]
        from zckpt.cli import app
        code = 0
        try:
            app.app()
        except SystemExit as e:
            code = e.code or 0
        heavy = {list(HEAVY)!r}
        leaked = sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))
        assert not leaked, leaked[:5]
        sys.exit(code)
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=REPO, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, object] = json.loads(done.stdout)
    return out


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A native checkpoint, written here from a real DeepSpeed one (none is committed)."""
    out = tmp_path_factory.mktemp("native") / "ck"
    zckpt.reshard(FIX / "ds" / "s3_bf16_w2_g2", out, world=3, to="native", progress=False)
    return out


CASES = {
    "deepspeed-zero3": FIX / "ds" / "s3_bf16_w2_g2",
    "deepspeed-zero2-offload": FIX / "ds" / "s2_fp32_w3_offopt",
    "dcp-fsdp2": FIX / "dcp" / "fsdp2_w2" / "checkpoint",
    "dcp-torchtitan": FIX / "dcp" / "torchtitan_w2" / "checkpoint",
    "hf-safetensors": FIX / "dcp" / "fsdp2_w2" / "ref_model.safetensors",
    "trainer": FIX / "trainer" / "trainer_z2_w2" / "checkpoint-3",
    "megatron": FIX / "megatron" / "tp2_fp32_gpt2" / "ckpt",
    "native": Path("native"),
}


def _path(name: str, request: pytest.FixtureRequest) -> Path:
    p = CASES[name]
    if name == "native":
        p = request.getfixturevalue("native")
    assert p.exists(), f"fixture missing: {p}"
    return p


@pytest.mark.parametrize("name", sorted(CASES))
def test_inspect_imports_no_torch(name: str, request: pytest.FixtureRequest) -> None:
    p = _path(name, request)
    got = _cli_without_torch("inspect", str(p), "--all")
    want = zckpt.inspect(p).to_json()
    assert got == json.loads(json.dumps(want)), name
    assert got["tensors"], name  # it did read the metadata


@pytest.mark.parametrize("name", sorted(CASES))
def test_verify_imports_no_torch(name: str, request: pytest.FixtureRequest) -> None:
    p = _path(name, request)
    got = _cli_without_torch("verify", str(p))
    want = zckpt.verify(p, progress=False)
    assert got == json.loads(json.dumps(want.to_json())), name
    assert got["ok"] and got["files"], name


def test_verify_without_torch_still_finds_damage(tmp_path: Path) -> None:
    """A flipped byte inside a tensor record of a ZeRO-3 rank file: the torch-free verify reports that
    file (exit 1), as the library does."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(FIX / "ds" / "s3_bf16_w2_g2", ck)
    rank = next(ck.glob("global_step3/*optim_states.pt"))
    ref = zckpt.open(ck).entries
    piece = next(p for e in ref.values() for p in e.pieces if p.file.endswith(rank.name) and p.numel > 4)
    data = bytearray(rank.read_bytes())
    data[piece.byte_offset + 2] ^= 0xFF
    rank.write_bytes(bytes(data))
    code = f"""
        import sys
        sys.argv = ["zckpt", "verify", {str(ck)!r}, "--json"]
        from zckpt.cli import app
        try:
            app.app()
        except SystemExit as e:
            if "torch" in sys.modules:  # not assert: its exit 1 is a verify that finds a problem too
                sys.exit(99)
            sys.exit(e.code)
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=REPO, check=False)  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    got = json.loads(done.stdout)
    assert [p["file"] for p in got["problems"]] == [str(rank)], got["problems"]
    assert got == json.loads(json.dumps(zckpt.verify(ck, progress=False).to_json()))


def test_dtype_is_torchs_where_tensors_are_built() -> None:
    """The metadata's ``DType`` equals torch's dtype of the same name both ways, and reads give torch
    tensors of that dtype."""
    ck = zckpt.open(FIX / "ds" / "s3_bf16_w2_g2")
    e = ck.entries["fc1.weight"]
    assert e.dtype == torch.float32 and torch.float32 == e.dtype and e.dtype != torch.bfloat16
    assert e.dtype.torch is torch.float32
    assert ck.read("fc1.weight").dtype is torch.float32
