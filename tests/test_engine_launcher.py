"""``python -m engine.run``: the engine as ``deepspeed`` for that process only, with distribution metadata
that transformers and accelerate accept, and a one-line refusal where real DeepSpeed is importable.

Oracles: transformers' own ``is_deepspeed_available`` (the dev venv has transformers) and ``packaging``'s
version comparison as accelerate's ``compare_versions`` does it; a stand-in "real DeepSpeed" (a ``deepspeed``
package with its ``.dist-info``, as pip installs it) made here for the refusal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _launch(tmp_path: Path, code: str, *, extra_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "probe.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([*([str(extra_path)] if extra_path else []), str(ROOT)])
    return subprocess.run(
        [sys.executable, "-m", "engine.run", str(script), "--flag", "x"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )


def test_launcher_makes_deepspeed_the_engine_with_metadata(tmp_path: Path) -> None:
    code = (
        "import sys, importlib.metadata\n"
        "from packaging.version import parse\n"
        "from transformers.integrations.deepspeed import is_deepspeed_available\n"
        "import deepspeed, engine\n"
        "assert deepspeed is engine, deepspeed\n"
        "import engine.run\n"
        "engine.run.activate()  # again, in a process where it is active: a no-op\n"
        "assert is_deepspeed_available()\n"
        "v = importlib.metadata.version('deepspeed')\n"
        "assert v == deepspeed.__version__ == '0.19.8+engine', v\n"
        "assert parse(v) >= parse('0.16.4') and parse(v) >= parse('0.9.3')  # accelerate's, transformers'\n"
        "assert sys.argv[1:] == ['--flag', 'x'] and __name__ == '__main__'\n"
        "print('engine', v)\n"
    )
    proc = _launch(tmp_path, code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["engine", "0.19.8+engine"]


def test_plain_python_does_not_see_the_engine_as_deepspeed(tmp_path: Path) -> None:
    """Without the launcher, nothing of this checkout answers ``import deepspeed`` (no .pth, no hook)."""
    code = (
        "import importlib.util, importlib.metadata\n"
        "spec = importlib.util.find_spec('deepspeed')\n"
        f"here = spec is not None and spec.origin and spec.origin.startswith({str(ROOT)!r})\n"
        "print('visible' if here else 'absent')\n"
    )
    (tmp_path / "plain.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(tmp_path / "plain.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["absent"]


def test_refuses_with_one_line_where_real_deepspeed_is_importable(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "deepspeed").mkdir(parents=True)
    (site / "deepspeed" / "__init__.py").write_text("__version__ = '0.19.8'\nraise SystemExit('imported!')\n")
    (site / "deepspeed-0.19.8.dist-info").mkdir()
    (site / "deepspeed-0.19.8.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n"
    )
    proc = _launch(tmp_path, "print('ran')\n", extra_path=site)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("engine.run: real DeepSpeed is importable here"), proc.stderr
    assert str(site / "deepspeed") in lines[0]
    # the metadata alone (a broken install without the package) is refused too
    (site / "deepspeed" / "__init__.py").unlink()
    (site / "deepspeed").rmdir()
    proc = _launch(tmp_path, "print('ran')\n", extra_path=site)
    assert proc.returncode == 2 and "distribution deepspeed 0.19.8" in proc.stderr, proc.stderr


def test_usage_errors_are_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args in ([], [str(tmp_path / "missing.py")], ["-m"]):
        proc = subprocess.run(
            [sys.executable, "-m", "engine.run", *args], capture_output=True, text=True, env=env
        )
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
