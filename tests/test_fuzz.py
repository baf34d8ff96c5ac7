"""The hostile-input suite's fixed selection (``tests/fuzz``, seed 0, 60 cases) as one test: each damaged
checkpoint is refused with one line naming the file at fault, or read to the same answer as the intact
one; nothing is left half-written and the input is never changed. Longer runs, other seeds:
``python -m tests.fuzz.suite --seed S --cases N --report fuzz.json``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fuzz import suite

pytestmark = pytest.mark.slow


def test_fast_selection_has_no_failures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = suite.main(["--fast", "--strict", "--report", str(tmp_path / "fuzz.json")])
    out = capsys.readouterr().out
    assert rc == 0, out[-6000:]
    assert "60 cases" in out, out[-2000:]


def test_dcp_families_handful(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The DCP families (``--dcp``) on a few cases: one per family of seed 0, each ending well."""
    report = str(tmp_path / "dcp.json")
    rc = suite.main(["--dcp", "--seed", "0", "--cases", "5", "--strict", "--report", report])
    out = capsys.readouterr().out
    assert rc == 0, out[-6000:]
    families = ("dcp-metadata", "dcp-chunks", "dcp-files", "dcp-paths", "dcp-signals")
    assert "5 cases" in out and all(f in out for f in families), out[-2000:]


_RUNPY_INTERRUPTED = """Could not import runpy module
Traceback (most recent call last):
  File "<frozen importlib._bootstrap>", line 1176, in _find_and_load
  File "<frozen runpy>", line 15, in <module>
  File "/usr/lib/python3.11/operator.py", line 232, in attrgetter
    class attrgetter:
KeyboardInterrupt
"""


def test_sigint_before_zckpt_ran_is_not_counted_as_its_traceback() -> None:
    """Seed 15 case 114: SIGINT 0.07 s after start hit ``python -m`` importing ``runpy`` (no zckpt code had
    run). That traceback is Python's; one with a zckpt frame, or after another signal, is still counted."""
    import signal

    from tests.fuzz.proc import Proc
    from tests.fuzz.scenario_run import before_zckpt

    def proc(stderr: str, sig: int = signal.SIGINT, rc: int = 1) -> Proc:
        return Proc([], "", rc, "", stderr, 0.1, 9.0, signalled=sig)

    assert before_zckpt(proc(_RUNPY_INTERRUPTED)) and before_zckpt(proc(_RUNPY_INTERRUPTED, rc=-2))
    ours = _RUNPY_INTERRUPTED.replace("/usr/lib/python3.11/operator.py", "/w/zckpt/cli/app.py")
    assert not before_zckpt(proc(ours))
    assert not before_zckpt(proc(_RUNPY_INTERRUPTED, signal.SIGTERM))


def test_megatron_families_handful(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The Megatron families (``--megatron``) on a few cases of seed 0: one per family, each ending well."""
    report = str(tmp_path / "megatron.json")
    rc = suite.main(
        ["--megatron", "--seed", "0", "--cases", "5", "--strict", "--timeout", "60", "--report", report]
    )
    out = capsys.readouterr().out
    assert rc == 0, out[-6000:]
    assert "5 cases" in out, out[-2000:]


def test_side_files_family_handful(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The ``side-files`` family (named only): HF side files made links out of the folder, FIFOs, folders or
    broken links; every case refused (13 of 40 cases of seed 435 were ``silent-wrong`` before
    ``zckpt.storage.copied``)."""
    report = str(tmp_path / "side.json")
    rc = suite.main(
        ["--families", "side-files", "--seed", "435", "--cases", "10", "--strict", "--report", report]
    )
    out = capsys.readouterr().out
    assert rc == 0, out[-6000:]
    assert "10 cases" in out and "ok-refused" in out, out[-2000:]
