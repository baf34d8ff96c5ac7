"""The typer CLI: option surface (a --help snapshot), output, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _fixtures import fixture
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from zckpt.cli.app import app

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1", "ZCKPT_DEBUG": ""})
SD = {"emb.weight": torch.randn(5, 3), "fc.bias": torch.randn(4).bfloat16(), "ids": torch.arange(3)}


def _options(args: list[str]) -> set[str]:
    res = runner.invoke(app, [*args, "--help"])
    assert res.exit_code == 0, res.output
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", res.output))


def test_help_snapshot() -> None:
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0 and "inspect" in res.output and "consolidate" in res.output
    inspect_opts = {
        "--tag",
        "--json",
        "--trust-pickle",
        "--stats",
        "--all",
        "--plot",
        "--storage-option",
        "--help",
    }
    assert _options(["inspect"]) == inspect_opts
    assert _options(["consolidate"]) == {
        "--dtype", "--keep-fp32", "--max-shard-size", "--tag", "--exclude-frozen", "--format", "--overwrite",
        "--trust-pickle", "--progress", "--no-progress", "--json", "--workers", "--verify-data",
        "--no-verify-data", "--storage-option", "--help",
    }  # fmt: skip
    assert _options(["diff"]) == {
        "--atol", "--rtol", "--dtype", "--strict-dtype", "--include-optimizer", "--json", "--keys", "--map",
        "--top", "--tag-a", "--tag-b", "--trust-pickle", "--progress", "--no-progress", "--verify-data",
        "--no-verify-data", "--plot", "--series", "--storage-option", "--help",
    }  # fmt: skip
    assert _options(["verify"]) == {
        "--json", "--tag", "--trust-pickle", "--sha256", "--progress", "--no-progress", "--storage-option",
        "--help",
    }  # fmt: skip
    assert _options(["reshard"]) == {
        "--world", "--tag", "--to", "--stage", "--overwrite", "--json", "--trust-pickle", "--progress",
        "--no-progress", "--verify-data", "--no-verify-data", "--storage-option", "--help",
    }  # fmt: skip


@pytest.fixture
def model(tmp_path: Path) -> Path:
    save_file(SD, tmp_path / "in.safetensors", metadata={"format": "pt"})
    return tmp_path / "in.safetensors"


def test_inspect_table_and_json(model: Path) -> None:
    res = runner.invoke(app, ["inspect", str(model)])
    assert res.exit_code == 0, res.output
    assert "emb.weight" in res.stdout and "5x3" in res.stdout and "bfloat16" in res.stdout
    res = runner.invoke(app, ["inspect", str(model), "--json"])
    data = json.loads(res.stdout)
    assert data["format"] == "hf" and data["params"] == 19
    assert {t["key"]: t["shape"] for t in data["tensors"]} == {
        "emb.weight": [5, 3],
        "fc.bias": [4],
        "ids": [3],
    }


def test_consolidate_cli(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.safetensors"
    args = ["consolidate", str(model), str(out), "--dtype", "fp16", "--keep-fp32", "emb.*", "--no-progress"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    got = load_file(out)
    assert got["emb.weight"].dtype == torch.float32 and torch.equal(got["emb.weight"], SD["emb.weight"])
    assert torch.equal(got["fc.bias"], SD["fc.bias"].half()) and torch.equal(got["ids"], SD["ids"])
    # again: the output exists -> one error line, a hint, exit 2, no traceback
    res = runner.invoke(app, args)
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [f"error: {out} already exists", "hint: pass --overwrite to replace it"]
    assert "Traceback" not in res.output
    res = runner.invoke(app, [*args, "--overwrite", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["tensors"] == 3


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "no such file or folder"),
        ("empty", "the folder is empty"),
        ("truncated", "truncated"),
        ("bad_suffix", "cannot tell the output format"),
    ],
)
def test_errors_are_one_line(tmp_path: Path, model: Path, setup: str, message: str) -> None:
    src, out = tmp_path / "nope", tmp_path / "out.safetensors"
    if setup == "empty":
        src.mkdir()
    elif setup == "truncated":
        src = tmp_path / "t.safetensors"
        src.write_bytes(model.read_bytes()[:-7])
    elif setup == "bad_suffix":
        src, out = model, tmp_path / "out.weird"
    res = runner.invoke(app, ["consolidate", str(src), str(out), "--no-progress"])
    assert res.exit_code == 2, res.output
    first = res.stderr.splitlines()[0]
    assert first.startswith("error: ") and message in first
    assert "Traceback" not in res.output and not out.exists()


def test_debug_env_shows_traceback(tmp_path: Path) -> None:
    res = runner.invoke(app, ["inspect", str(tmp_path / "nope")], env={"ZCKPT_DEBUG": "1"})
    assert res.exit_code == 2 and "Traceback" in res.stderr


def test_bad_option_value_is_usage_error(model: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["consolidate", str(model), str(tmp_path / "o.safetensors"), "--dtype", "fp8"])
    assert res.exit_code == 2 and "fp8" in res.output


FIXTURE = fixture("ds", "s2_fp16_w2")


def test_inspect_deepspeed_fixture() -> None:
    info = json.loads((FIXTURE / "case.json").read_text())
    res = runner.invoke(app, ["inspect", str(FIXTURE), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert (data["format"], data["stage"], data["world_size"]) == ("deepspeed", info["stage"], info["world"])
    assert data["tied"] == info["tied"] and sorted(data["frozen"]) == sorted(info["frozen"])
    assert {"exp_avg", "exp_avg_sq"} <= set(data["optimizer_states"])
    params = {t["name"]: t["shape"] for t in data["tensors"] if t["role"] == "param"}
    assert params == {k: v for k, v in info["param_shapes"].items() if k not in info["frozen"]}
    res = runner.invoke(app, ["inspect", str(FIXTURE)])
    assert res.exit_code == 0 and "tied: head.weight -> emb.weight" in res.stdout


def _zckpt(*args: str, fast: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ZCKPT_FAST_EXIT": "1" if fast else "0", "ZCKPT_DEBUG": ""}
    argv = [sys.executable, "-c", "from zckpt.cli.app import main; main()", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_fast_exit_keeps_exit_codes_and_flushes_all_output(model: Path, tmp_path: Path) -> None:
    """The console script ends with os._exit: same status and the same complete stdout as a normal exit."""
    other = tmp_path / "other.safetensors"
    save_file({**SD, "fc.bias": SD["fc.bias"] + 1}, str(other))
    for args, want in (
        (["inspect", str(model), "--json", "--stats"], 0),
        (["diff", str(model), str(model)], 0),
        (["diff", str(model), str(other), "--json"], 1),
        (["inspect", str(tmp_path / "missing")], 2),
    ):
        fast, slow = _zckpt(*args), _zckpt(*args, fast=False)
        assert (fast.returncode, slow.returncode) == (want, want), (args, fast.stderr)
        assert fast.stdout == slow.stdout and fast.stderr == slow.stderr, args
    assert json.loads(_zckpt("inspect", str(model), "--json").stdout)["format"]


@pytest.mark.slow
def test_closed_pipe_exits_quietly(model: Path) -> None:
    """`zckpt inspect ... | head -1`: no 'Broken pipe' error line, status 141 as for `cat`."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from zckpt.cli.app import main; main()", "inspect", str(model), "--all"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader leaves before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


def test_interrupt_outside_a_command_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """Ctrl-C while typer parses arguments (or after the command returned) makes typer exit 130 silently:
    ``main`` says so in one line; an interrupt the command reported itself is not reported twice."""
    from zckpt.cli import app as cli_app

    def parse_interrupted() -> None:
        raise SystemExit(130)

    from zckpt.storage import collector

    monkeypatch.setenv("ZCKPT_FAST_EXIT", "0")
    monkeypatch.setattr(cli_app, "app", parse_interrupted)
    monkeypatch.setattr(collector._State, "owned", False)  # main() takes the collector; given back after
    with pytest.raises(SystemExit) as e:
        cli_app.main()
    assert e.value.code == 130
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: interrupted"), err
    monkeypatch.setattr(cli_app._said, "interrupted", True)
    with pytest.raises(SystemExit):
        cli_app.main()
    assert capsys.readouterr().err == ""


def _sigint_default() -> None:
    """In the child: SIGINT at its default, so Python installs its handler even under a parent that ignores
    SIGINT (a job started in the background of a non-interactive shell), which these tests would miss."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_commands_a_test_starts_take_ctrl_c() -> None:
    """A run started as a background job of a non-interactive shell (CI) ignores SIGINT, and children inherit
    that: the interrupt tests' commands shrugged off their Ctrl-C (fresh-clone .ci/run: 6 failures).
    tests/conftest.py gives SIGINT and SIGTERM their defaults back, so a child started plainly installs
    Python's Ctrl-C handler, and neither signal is blocked."""
    import signal

    code = (
        "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, "
        "signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "
        "bool({signal.SIGINT, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, [])))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert p.stdout.split() == ["True", "True", "False"], p.stdout
    assert signal.getsignal(signal.SIGINT) != signal.SIG_IGN


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
from zckpt.cli import main  # the console script's entry point
main()
"""


@pytest.mark.slow
def test_interrupt_while_torch_imports_is_the_startup_guards(model: Path, tmp_path: Path) -> None:
    """Commands import torch lazily; an interrupt during that import is the start-up guard's (one line, exit
    130): a ``KeyboardInterrupt`` raised inside torch's C++ start-up can abort the process (SIGABRT from
    pybind11) or leave torch half-imported ("cannot load module more than once"), as the hostile-input suite
    saw at seed 6 (1 case in 300, 1 in 60 Ctrl-Cs at random moments on a loaded machine)."""
    import signal
    import time

    flag = tmp_path / "flag"
    env = {**os.environ, "SLOW_TORCH_FLAG": str(flag), "ZCKPT_DEBUG": ""}
    # --stats --trust-pickle: tensors built from pickles, so torch imports at start-up (plain --stats: numpy)
    argv = [sys.executable, "-c", _SLOW_TORCH, "inspect", "--stats", "--trust-pickle", str(model)]
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


def test_signals_held_once_the_command_is_done() -> None:
    """Fuzz ``--fast`` case 44 (SIGINT 0-0.3 s after the staging folder appeared, on a tiny input) once
    printed a KeyboardInterrupt traceback: the command had finished and the signal landed in the exit path.
    The program's process blocks SIGINT and SIGTERM once a command returns, or exits with its own status
    (diff: 1), until ``_fast_exit``. ``ZCKPT_FAST_EXIT=0`` (``main`` returns to a caller) restores the mask
    first; a command run in-process (typer's runner, here) leaves it alone."""
    import signal

    repo = Path(__file__).resolve().parents[1]
    ck = repo / "fixtures" / "dcp" / "fsdp2_w2" / "checkpoint"
    other = repo / "fixtures" / "dcp" / "tp_w2" / "checkpoint"
    script = (
        "import atexit, signal, sys\n"
        "mask = lambda: sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))\n"
        "atexit.register(lambda: print(mask()))\n"
        "from zckpt.cli import app\n"
        "fast_exit = app._fast_exit\n"
        "app._fast_exit = lambda code: (print(mask()), fast_exit(code))\n"
        "sys.argv = ['zckpt', *sys.argv[1:]]\n"
        "app.main()\n"
    )
    held = str(sorted([int(signal.SIGINT), int(signal.SIGTERM)]))
    for fast, argv, rc in (
        ("1", ["inspect", str(ck)], 0),
        ("1", ["diff", str(ck), str(other)], 1),
        ("0", ["inspect", str(ck)], 0),
    ):
        env = {**os.environ, "ZCKPT_FAST_EXIT": fast}
        p = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env)
        assert p.returncode == rc, p.stderr
        assert p.stdout.splitlines()[-1] == (held if fast == "1" else "[]"), (argv, p.stdout[-300:])
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert CliRunner().invoke(app, ["inspect", str(ck)]).exit_code == 0
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


# ---- issue 40.9: first-contact wording -----------------------------------------------------------------
@pytest.mark.parametrize("cmd", [["inspect"], ["verify"], ["diff", "A"], ["reshard", "--world", "2"]])
@pytest.mark.parametrize("url", ["s3://", "gs://"])
def test_url_without_bucket_is_one_line(cmd: list[str], url: str) -> None:
    """``zckpt inspect s3://`` said ``s3:: no such file or folder`` (pathlib's spelling of the URL)."""
    res = runner.invoke(app, [*cmd, url])
    scheme = url.removesuffix("://")
    assert res.exit_code == 2, res.output
    assert res.stderr.splitlines() == [
        f"error: {url}: the URL names no bucket",
        f"hint: give {scheme}://BUCKET/PATH",
    ]


def test_lone_safetensors_file_is_no_hf_checkpoint_and_counts_agree(tmp_path: Path) -> None:
    """A lone ``.safetensors`` is "a safetensors file" (not "hf checkpoint"); "1 file", "1 checksum",
    "1 tensor" are singular; an HF folder is still an hf checkpoint."""
    f = tmp_path / "one.safetensors"
    save_file({"w": torch.ones(2)}, str(f))
    (tmp_path / "one.safetensors.sha256").write_text(
        __import__("hashlib").sha256(f.read_bytes()).hexdigest() + "  one.safetensors\n"
    )
    res = runner.invoke(app, ["verify", str(f)])
    assert res.exit_code == 0 and res.stdout.strip() == (
        f"{f}: safetensors file, world size 1: 1 tensor, 1 file, 1 checksum verified: OK"
    ), res.output
    res = runner.invoke(app, ["reshard", str(f), "--world", "2"])
    assert res.exit_code == 2 and f"{f}: a safetensors file is not sharded" in res.stderr, res.output
    hf = tmp_path / "hf"
    res = runner.invoke(app, ["consolidate", str(fixture("ds", "s1_bf16_w2")), str(hf), "--no-progress"])
    assert res.exit_code == 0 and res.stdout.startswith("wrote 12 tensors ("), res.output
    assert (
        ": hf checkpoint, world size 1: 12 tensors, 1 file, 1 checksum verified: OK"
        in runner.invoke(app, ["verify", str(hf)]).stdout
    )


def test_write_hints_do_not_blame_a_missing_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """zckpt makes missing parent folders itself, so "check the folder exists" was no advice: a parent that
    is a file, and a folder this user may not write, each get their own hint."""
    import errno
    import tempfile

    (tmp_path / "f").write_text("")
    res = runner.invoke(
        app, ["consolidate", str(fixture("ds", "s1_bf16_w2")), str(tmp_path / "f" / "o.safetensors")]
    )
    assert res.exit_code == 2 and "hint: a part of the path is a file, not a folder" in res.stderr, res.output

    def denied(*a: object, **k: object) -> str:
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / ".o.zckpt-tmp-x"))

    monkeypatch.setattr(tempfile, "mkdtemp", denied)
    res = runner.invoke(
        app, ["consolidate", str(fixture("ds", "s1_bf16_w2")), str(tmp_path / "o.safetensors")]
    )
    assert res.exit_code == 2 and "hint: you may not write in that folder" in res.stderr, res.output
    assert "exists" not in res.stderr


# ---- issue 40.13: every environment switch in one place, one worker-count parser ---------------------------
_SWITCH = re.compile(r"\bZCKPT_[A-Z0-9_]+\b")


def test_every_environment_switch_is_documented_and_none_is_a_test_hook() -> None:
    """Every ``ZCKPT_*`` name in the code (the library, the engine, and the tests', fixtures' and benchmarks'
    own) appears in docs/environment.md, and zckpt and the engine read no test hook."""
    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "environment.md").read_text()
    used: dict[str, set[str]] = {}
    for top in ("zckpt", "engine", "tests", "fixtures", "bench"):
        for f in (root / top).rglob("*.py"):
            for name in _SWITCH.findall(f.read_text(errors="replace")):
                used.setdefault(name, set()).add(str(f.relative_to(root)))
    assert {"ZCKPT_WORKERS", "ZCKPT_DEBUG", "ZCKPT_TEST_WRITE_DELAY"} <= set(used)  # the scan found them
    missing = {n: sorted(fs) for n, fs in used.items() if f"`{n}`" not in doc}
    assert not missing, f"docs/environment.md does not list {missing}"
    hooks = {
        n: sorted(f for f in fs if f.startswith(("zckpt/", "engine/")))
        for n, fs in used.items()
        if "TEST" in n
    }
    assert not any(hooks.values()), hooks


def test_workers_one_parser_that_follows_cpu_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ZCKPT_WORKERS`` was read three ways (``isdigit``, a bare ``int()`` that crashed on ``four``, and not
    at all by the block digest, which counted ``os.cpu_count()`` rather than the CPU affinity)."""
    from zckpt.ops.diff_report import compare_threads
    from zckpt.storage import digest, scan
    from zckpt.stream import pipeline

    monkeypatch.delenv("ZCKPT_WORKERS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})  # a 6-core share
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # of a bigger machine
    assert (digest.lanes(), scan.threads(), pipeline.default_workers(), compare_threads()) == (4, 6, 6, 3)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert (digest.lanes(), scan.threads(), pipeline.default_workers(), compare_threads()) == (1, 1, 1, 1)
    monkeypatch.setenv("ZCKPT_WORKERS", "3")
    assert (digest.lanes(), scan.threads(), pipeline.default_workers(), compare_threads()) == (3, 3, 3, 3)
    for bad in ("four", "0", "-2", "1.5"):
        monkeypatch.setenv("ZCKPT_WORKERS", bad)
        for f in (digest.lanes, scan.threads, pipeline.default_workers):
            with pytest.raises(
                ValueError, match=f"^ZCKPT_WORKERS='{re.escape(bad)}': not a positive whole number"
            ):
                f()
        res = runner.invoke(app, ["inspect", str(fixture("ds", "s1_bf16_w2"))], env={"ZCKPT_WORKERS": bad})
        assert res.exit_code == 2, res.output
        assert res.stderr.splitlines() == [
            f"error: ZCKPT_WORKERS='{bad}': not a positive whole number",
            "hint: unset it, or give a count: ZCKPT_WORKERS=4",
        ]
