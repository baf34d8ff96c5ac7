"""``--plot`` on the command line: ``diff`` and ``inspect`` write the file and say so, JSON stays the diff
schema, bad names and a missing matplotlib are one ``error:`` line (exit 2) before any work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from zckpt.cli.app import app

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1", "ZCKPT_DEBUG": ""})
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    g = torch.Generator().manual_seed(0)
    a = {f"h.{i}.attn.c_attn.weight": torch.randn(6, 4, generator=g) for i in range(3)}
    b = {k: v + (0.1 if k.startswith("h.1.") else 0.0) for k, v in a.items()}
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    return tmp_path / "a.safetensors", tmp_path / "b.safetensors"


def test_diff_and_inspect_plot(pair: tuple[Path, Path], tmp_path: Path) -> None:
    import matplotlib  # noqa: F401  # the dev extra installs it

    a, b = pair
    png = tmp_path / "d.png"
    res = runner.invoke(app, ["diff", str(a), str(b), "--plot", str(png)])
    assert res.exit_code == 1 and f"plot: {png}" in res.stdout and png.stat().st_size > 0
    res = runner.invoke(
        app, ["diff", str(a), str(b), "--plot", str(tmp_path / "d.html"), "--json", "--top", "1"]
    )
    js = json.loads(res.stdout)
    assert res.exit_code == 1 and len(js["tensors"]) == 1 and js["options"]["top"] == 1
    assert "h.0.attn.c_attn.weight" in (tmp_path / "d.html").read_text()  # the page has every tensor
    res = runner.invoke(app, ["inspect", str(a), "--plot", str(tmp_path / "i.svg")])
    assert res.exit_code == 0 and "<svg" in (tmp_path / "i.svg").read_text()


def test_bad_plot_names_fail_before_work(pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = pair
    for bad, msg in (
        (tmp_path / "d.jpg", "must end in .png, .svg, .html"),
        (tmp_path / "no" / "d.png", "no folder"),
    ):
        res = runner.invoke(app, ["diff", str(a), str(b), "--plot", str(bad)])
        assert res.exit_code == 2 and msg in res.stderr and res.stdout == ""
    res = runner.invoke(app, ["diff", str(a)])
    assert res.exit_code == 2 and "diff needs two checkpoints" in res.stderr


def test_without_matplotlib_one_line(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """A real process in which matplotlib cannot be imported: one error line naming the extra, exit 2."""
    a, b = pair
    argv = ["zckpt", "inspect", str(a), "--plot", str(tmp_path / "i.png")]
    block = "import sys; sys.modules['matplotlib'] = None"
    code = f"{block}; from zckpt.cli.app import main; sys.argv = {argv!r}; main()"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "error: --plot needs matplotlib, which is not installed: pip install 'zckpt[plot]'"
    ]
