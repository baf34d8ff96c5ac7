"""What a user who runs ``pip install .`` gets (issue 25): the wheel pip builds from this tree, its declared
dependencies (the runtime ones only: the dev tools stay in the ``dev`` extra), and a working ``zckpt`` and
``python -m zckpt`` once it is installed into a fresh venv.

The fast tests build the wheel offline (``--no-build-isolation``: this venv's setuptools) and install it
with ``--no-deps`` into a new venv that borrows this venv's site-packages for torch & co. on a path entry
after its own (so the installed copy of zckpt, not this checkout, is what runs). The dependency list is
checked against ``pyproject.toml`` read with ``tomllib``. ``test_fresh_venv_pip_install`` (slow, needs the
package index) does what the README says, for real: an empty venv, ``pip install SRC``, dependencies
resolved by pip. ``make demo``'s script, run with its tools stubbed, writes only into its own folder.
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from _fixtures import fixture

import zckpt

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the dev venv is 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = fixture("ds", "s2_fp16_w2")
DEV_TOOLS = {"pytest", "ruff", "mypy", "hypothesis", "import-linter", "transformers", "deepspeed"}
SOURCES = ("pyproject.toml", "README.md", "zckpt", "engine")  # what setuptools reads to build the wheel
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _copy_source(dst: Path) -> Path:
    """The tree's build inputs in a scratch folder, so a build leaves nothing in the checkout."""
    dst.mkdir()
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dst / name)
    return dst


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _copy_source(tmp / "src")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
           "-w", str(tmp / "dist"), str(src)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=CLEAN_ENV)
    (whl,) = (tmp / "dist").glob("zckpt-*.whl")
    return whl


def test_wheel_declares_only_runtime_dependencies(wheel: Path) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    with zipfile.ZipFile(wheel) as z:
        info = f"zckpt-{zckpt.__version__}.dist-info"
        meta = email.parser.Parser().parsestr(z.read(f"{info}/METADATA").decode())
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert (meta["Name"], meta["Version"]) == ("zckpt", zckpt.__version__)
    requires = meta.get_all("Requires-Dist")
    always = [r for r in requires if "extra ==" not in r]
    assert sorted(map(_name, always)) == sorted(map(_name, project["dependencies"]))
    assert not {_name(r) for r in always} & DEV_TOOLS, always
    assert {"torch", "safetensors", "typer"} <= {_name(r) for r in always}
    plot = [_name(r) for r in requires if re.search(r"""extra == ["']plot["']""", r)]
    assert plot == ["matplotlib"] and "plot" in meta.get_all("Provides-Extra")
    scripts = r"^\[console_scripts\]\nengine-run = engine\.run:main\nzckpt = zckpt\.cli:main$"
    assert re.search(scripts, entry_points, re.M), entry_points


def test_wheel_holds_every_module_and_nothing_else(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    ours = {n for n in names if ".dist-info/" not in n}
    source = {
        p.relative_to(ROOT).as_posix()
        for pkg in ("zckpt", "engine")
        for p in (ROOT / pkg).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert {"zckpt/__main__.py", "zckpt/cli/__main__.py"} <= ours
    # what engine.run puts on the path: the deepspeed alias and its distribution metadata
    assert "engine/alias/deepspeed-0.19.8+engine.dist-info/METADATA" in names
    assert {s for s in source if s.endswith((".py", "py.typed"))} <= ours  # py.typed where there is one
    assert {n.split("/")[0] for n in ours} == {"zckpt", "engine"}, sorted(ours)  # no tests/, fixtures/


def _run(*cmd: object, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = env if env is not None else {**CLEAN_ENV, "COLUMNS": "80", "ZCKPT_DEBUG": ""}
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd)


def test_installed_wheel_runs(wheel: Path, tmp_path: Path) -> None:
    """The wheel in a new venv: the console script `zckpt` and `python -m zckpt` run the installed copy."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py, zckpt_bin = venv / "bin" / "python", venv / "bin" / "zckpt"
    pip = _run(sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", wheel,
               cwd=tmp_path, env=CLEAN_ENV)  # fmt: skip
    assert pip.returncode == 0, pip.stderr
    site = _run(py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp_path).stdout
    borrowed = sysconfig.get_path("purelib")  # this venv's torch & co., on sys.path after the venv's own
    (Path(site.strip()) / "zz_borrowed_deps.pth").write_text(borrowed + "\n")
    where = _run(py, "-c", "import zckpt; print(zckpt.__file__)", cwd=tmp_path).stdout
    assert Path(where.strip()).is_relative_to(venv), where
    version = _run(zckpt_bin, "--version", cwd=tmp_path)
    assert (version.returncode, version.stdout) == (0, f"zckpt {zckpt.__version__}\n"), version.stderr
    help_ = _run(py, "-m", "zckpt", "--help", cwd=tmp_path)
    assert help_.returncode == 0 and help_.stdout.startswith("Usage: python -m zckpt [OPTIONS] COMMAND")
    res = _run(zckpt_bin, "inspect", FIXTURE, "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    case = json.loads((FIXTURE / "case.json").read_text())
    data = json.loads(res.stdout)
    assert (data["format"], data["stage"], data["world_size"]) == ("deepspeed", case["stage"], case["world"])


@pytest.mark.slow
def test_fresh_venv_pip_install(tmp_path: Path) -> None:
    """The README's user install, for real: an empty venv, `pip install SRC` (build isolation, dependencies
    from the package index), then the CLI. No dev tool comes along. The versions are held to
    constraints.txt, which only caps versions and adds no package: the same wheels as `make setup` (pip's
    cache; torch's CPU build, not a CUDA download). ``--no-compile``: pip's byte-compiling of every installed
    module (torch's thousands) was 40 % of this test's time (45 s -> 27 s alone on 2 cores); the commands run
    here compile what they import. Needs the index: without it this fails, never skips."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    src = _copy_source(tmp_path / "src")
    pins = ROOT / "constraints.txt"
    pip = _run(py, "-m", "pip", "install", "-q", "--no-compile", "-c", pins, src, cwd=tmp_path, env=CLEAN_ENV)
    assert pip.returncode == 0, pip.stderr[-3000:]
    listed = _run(py, "-m", "pip", "list", "--format", "json", cwd=tmp_path, env=CLEAN_ENV).stdout
    installed = {_name(d["name"]) for d in json.loads(listed)}
    assert {"zckpt", "torch", "safetensors", "typer"} <= installed and not installed & DEV_TOOLS, installed
    version = _run(venv / "bin" / "zckpt", "--version", cwd=tmp_path)
    assert version.stdout == f"zckpt {zckpt.__version__}\n", version.stderr
    res = _run(py, "-m", "zckpt", "inspect", FIXTURE, "--json", cwd=tmp_path)
    assert res.returncode == 0 and json.loads(res.stdout)["format"] == "deepspeed", res.stderr


# ---- issue 40.10: `make demo` writes only into its own folder --------------------------------------------
_STUB = """#!/usr/bin/env bash
printf '%s\\n' "$(basename "$0") $*" >> "$DEMO_LOG"
prev=""
for a in "$@"; do  # make what the real tools would make, so later steps find it
  case "$prev" in --save) mkdir -p "$a" ;; esac
  case "$a" in *.safetensors) [ "$prev" = consolidate ] || [ -e "$a" ] || : > "$a" ;; esac
  prev=$a
done
"""


def test_demo_leaves_the_users_paths_alone(tmp_path: Path) -> None:
    """``make demo`` ran ``rm -rf out out-w2 model.safetensors demo-plots`` in the checkout: the names the
    README's examples give a user's own checkpoint. The script is run in a copy of the checkout with the
    tools stubbed (each logs its arguments): the user's files survive, every path a tool is given lies in
    ``demo-out/``, and a ``demo-out/`` the demo did not make is refused, not deleted."""
    root = tmp_path / "checkout"
    (root / "docs" / "demo").mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "demo" / "run.sh", root / "docs" / "demo" / "run.sh")
    bin_ = root / ".venv" / "bin"
    bin_.mkdir(parents=True)
    for tool in ("torchrun", "zckpt", "python"):
        (bin_ / tool).write_text(_STUB)
        (bin_ / tool).chmod(0o755)
    mine = {"out/keep.txt": "a", "out-w2/keep.txt": "b", "model.safetensors": "c", "demo-plots/keep.txt": "d"}
    for rel, text in mine.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    log = tmp_path / "calls.log"
    env = {**os.environ, "DEMO_LOG": str(log)}
    env.pop("DEMO_DIR", None)
    for _ in range(2):  # twice: the second run replaces the first run's demo-out/
        r = subprocess.run(
            ["bash", "docs/demo/run.sh", "4", "2"], cwd=root, env=env, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stdout + r.stderr
    assert {rel: (root / rel).read_text() for rel in mine} == mine
    calls = log.read_text().splitlines()
    assert len(calls) == 2 * 11, calls  # each run: 3 trainings, 7 zckpt commands, 1 evaluation
    paths = [a for c in calls for a in c.split()[1:] if "/" in a or a.endswith(".safetensors")]
    outside = [a for a in paths if not (a.startswith("demo-out/") or a.startswith("docs/demo/"))]
    assert paths and not outside, outside
    assert "demo-out/" in r.stdout.splitlines()[-1]
    (root / "demo-out" / ".zckpt-demo").unlink()  # now a folder the demo cannot call its own
    (root / "demo-out" / "mine.txt").write_text("e")
    r = subprocess.run(["bash", "docs/demo/run.sh"], cwd=root, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "demo-out exists and was not made by make demo" in r.stderr
    assert (root / "demo-out" / "mine.txt").read_text() == "e"
