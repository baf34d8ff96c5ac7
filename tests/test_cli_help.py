"""First contact with the command line: ``--help`` of every command at 80 columns, ``--version``, and
``python -m zckpt`` / ``python -m zckpt.cli`` (issue 25).

The help is rendered by the app (typer's CliRunner, ``COLUMNS`` set, named as ``python -m zckpt``, the
longest spelling); the entry points run in subprocesses. The oracle is the click command itself (its
registered option names and the help strings it was given), so a cut option name, a word wrapped at a
hyphen or a truncated sentence shows as a string that no longer appears whole.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer.main
from _fixtures import fixture
from typer.testing import CliRunner

import zckpt
from zckpt.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "ZCKPT_DEBUG": ""}
GROUP: Any = typer.main.get_command(app)
COMMANDS = [[], *([name] for name in sorted(GROUP.commands))]
FIXTURE = fixture("ds", "s2_fp16_w2")


def _run(*args: str, columns: int = 80, module: str = "zckpt") -> subprocess.CompletedProcess[str]:
    env = {**ENV, "COLUMNS": str(columns), "LINES": "24"}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env)


def _help(*path: str, columns: int = 80) -> str:
    runner = CliRunner(env={"COLUMNS": str(columns), "LINES": "24", "NO_COLOR": "1"})
    res = runner.invoke(app, [*path, "--help"], prog_name="python -m zckpt")
    assert res.exit_code == 0 and res.stderr == "", res.output
    return res.stdout


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_every_command_is_checked() -> None:
    assert {c[0] for c in COMMANDS if c} == {"inspect", "consolidate", "diff", "verify", "reshard"}


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "zckpt")
def test_help_fits_the_terminal(path: list[str], columns: int) -> None:
    text = _help(*path, columns=columns)
    cmd = GROUP if not path else GROUP.commands[path[0]]
    too_long = [line for line in text.splitlines() if len(line) > min(columns, 80)]
    assert not too_long, "\n".join(too_long)
    # nothing truncated ('…' from rich, '...' from click's short help), no typer type label (<bool>, <path>)
    assert "…" not in text and "..." not in text.replace("COMMAND [ARGS]...", ""), text
    assert not re.search(r"<[a-z][a-z \[\]|]*>", text), text
    assert "{" not in text.splitlines()[0], text  # typer's `{ckpt}` for a required argument
    flat = _flat(text)
    ctx = cmd.context_class(cmd, info_name=path[0] if path else "zckpt")
    for p in cmd.params:
        if getattr(p, "hidden", False):
            continue
        for name in [*p.opts, *p.secondary_opts] if p.param_type_name == "option" else []:
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"{name} cut or missing"
        if p.param_type_name == "argument":  # named in capitals in the usage line and in its row
            assert re.search(rf"^Usage: .* \[?{p.metavar}\b", text, re.M) and p.metavar.isupper(), text
        if p.param_type_name == "option" and not p.is_flag:  # a value is named, e.g. --tag TAG
            assert p.metavar and any(f"{o} {p.metavar}" in text for o in p.opts), p.opts
        if p.param_type_name == "option" and p.is_flag:  # a flag shows no value
            assert re.search(rf"{re.escape(p.opts[-1])}(  | /|\n)", text), p.opts
        # every word of its help and of its [default: ...] is whole: wrapping only made spaces line breaks
        record = p.get_help_record(ctx)
        assert record is not None and _flat(record[1]) in flat, record
    for para in (cmd.help or "").split("\n\n") + (cmd.epilog or "").split("\n\n"):
        lines = para.strip("\n").splitlines()
        if lines and lines[0].strip() == "\b":  # examples: kept line by line
            for line in lines[1:]:
                assert line.strip() in [row.strip() for row in text.splitlines()], line
        else:
            assert _flat(para) in flat, para
    if not path:  # the command list: each command's first sentence whole
        for sub in GROUP.commands.values():
            assert _flat(sub.help.split("\n\n")[0]) in flat, sub.help


def test_help_names_the_plot_extra() -> None:
    """rich markup used to eat `[plot]`, leaving "pip install 'zckpt'"."""
    for command in ("inspect", "diff"):
        assert "pip install 'zckpt[plot]'" in _flat(_help(command)), command


def test_usage_names_arguments_and_required_options() -> None:
    usage = {c: _help(c).splitlines()[0] for c in ("consolidate", "diff", "reshard")}
    assert usage["consolidate"] == "Usage: python -m zckpt consolidate [OPTIONS] CKPT OUT"
    assert usage["diff"] == "Usage: python -m zckpt diff [OPTIONS] [A [B]]"
    assert usage["reshard"] == "Usage: python -m zckpt reshard [OPTIONS] --world N [SRC [DST]]"


@pytest.mark.parametrize("module", ["zckpt", "zckpt.cli", "zckpt.cli.app"])
def test_version_and_module_entry_points(module: str) -> None:
    """`zckpt --version` prints the program's name and version on stdout, exit 0 (as `pip --version` and
    `git --version` begin); every `python -m` spelling runs the same command line."""
    res = _run("--version", module=module)
    assert (res.returncode, res.stdout, res.stderr) == (0, f"zckpt {zckpt.__version__}\n", "")
    assert re.fullmatch(r"\d+\.\d+\.\d+", zckpt.__version__)
    res = _run("inspect", "--help", module=module)
    assert res.returncode == 0 and res.stdout.startswith(f"Usage: python -m {module} inspect [OPTIONS] CKPT")


def test_python_m_zckpt_runs_a_command() -> None:
    """`python -m zckpt inspect` on a committed DeepSpeed checkpoint: the real command, its JSON result."""
    res = _run("inspect", str(FIXTURE), "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads((FIXTURE / "case.json").read_text())
    data = json.loads(res.stdout)
    assert (data["format"], data["stage"], data["world_size"]) == ("deepspeed", info["stage"], info["world"])


def test_usage_error_is_plain_text() -> None:
    """A bad option value: click's plain usage error (no box drawing), exit 2."""
    res = _run("consolidate", "in.safetensors", "out.safetensors", "--format", "pdf")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("Usage: python -m zckpt consolidate [OPTIONS] CKPT OUT\n"), res.stderr
    assert "Error: Invalid value for '--format'" in res.stderr and "╭" not in res.stderr, res.stderr


def _sigint_default() -> None:
    """In the child: SIGINT at its default, so Python installs its handler even under a parent that ignores
    SIGINT (a job started in the background of a non-interactive shell), which these tests would miss."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


_SLOW_TORCH = """
import os, sys, time
from pathlib import Path

class _SlowTorch:  # the first ``import torch`` announces itself, then takes 30 s
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            Path(os.environ["SLOW_TORCH_FLAG"]).write_text("importing torch")
            time.sleep(30)
        return None

sys.meta_path.insert(0, _SlowTorch())
"""


@pytest.mark.parametrize("module", ["zckpt", "zckpt.cli"])
def test_python_m_keeps_the_startup_guard(module: str, tmp_path: Path) -> None:
    """Ctrl-C while `python -m zckpt inspect --stats --trust-pickle` starts (torch importing; other inspects
    need none) is the start-up guard's: one line, exit 130, as for the console script (tests/test_cli.py).
    The slow import is planted by a sitecustomize, so the interpreter runs the real `-m` path."""
    import signal
    import time

    (tmp_path / "sitecustomize.py").write_text(_SLOW_TORCH)
    flag = tmp_path / "flag"
    env = {**ENV, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "SLOW_TORCH_FLAG": str(flag)}
    argv = [sys.executable, "-m", module, "inspect", "--stats", "--trust-pickle", str(FIXTURE)]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_sigint_default
    )
    deadline = time.monotonic() + 60
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert flag.exists(), proc.communicate()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == "error: interrupted; nothing was written\n" and out == "", err
