"""Session fixtures and rules shared by every test file: a real S3 server (moto, 127.0.0.1, a free port)
started and stopped by the tests themselves, only when a test asks for it; what may skip; and SIGINT/SIGTERM
at their defaults for the commands tests start, however the run was started (``pytest_configure``).

Nothing skips but the CUDA tests (marker ``cuda``) on a machine without a GPU: the summary says how many did,
and any other skip fails the session. Tests marked ``deepspeed`` run real DeepSpeed from ``.venv-ds`` (``make
test`` builds it) and fail, naming the command that builds it, where it is missing. Tests marked
``heldout("VAR")`` read held-out checkpoints that are generated, not committed (docs/architecture.md): they
are deselected, and the summary says so, unless the environment variable ``VAR`` names their folder."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import _s3
import pytest

pytest_plugins = ["_xdist"]  # under pytest-xdist: slow tests first, ``serial`` ones alone (tests/_xdist.py)

DS_PYTHON = Path(__file__).resolve().parents[1] / ".venv-ds" / "bin" / "python"
_skipped: dict[str, list[str]] = {"cuda": [], "other": []}
_heldout: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """SIGINT and SIGTERM as an interactive shell gives them, however the run was started. A job started in
    the background of a non-interactive shell (CI's ``make test &``) ignores SIGINT, and an ignored signal
    stays ignored across exec: every command a test starts would shrug off its Ctrl-C (a test that interrupts
    one failed, or passed without testing the interrupt). Runs in the controller and in each xdist worker."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


@pytest.fixture(scope="session")
def s3_server() -> Iterator[_s3.Server]:
    srv = _s3.start()
    srv.client().create_bucket(Bucket="ckpts")  # type: ignore[attr-defined]
    yield srv
    srv.stop()


@pytest.fixture
def relay(s3_server: _s3.Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[_s3.FaultProxy]:
    """A relay in front of the S3 server that refuses or holds chosen requests (``_s3.FaultProxy``), the
    client pointed at it by the user's environment only."""
    proxy = _s3.FaultProxy(s3_server.url, p503=0, pdrop=0, ptrunc=0)
    for k, v in _s3.env_for(proxy.url):
        monkeypatch.setenv(k, v)
    yield proxy
    proxy.release.set()
    proxy.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    for item in items:
        mark = item.get_closest_marker("heldout")
        (drop if mark is not None and not os.environ.get(mark.args[0]) else keep).append(item)
    if drop:
        _heldout.extend(sorted({m.args[0] for i in drop if (m := i.get_closest_marker("heldout"))}))
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("deepspeed") is not None and not DS_PYTHON.exists():
        pytest.fail(
            f"{DS_PYTHON} missing: this test runs real DeepSpeed; `make test` builds .venv-ds "
            "(or `make .venv-ds/.installed`)",
            pytrace=False,
        )
    if item.get_closest_marker("cuda") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no GPU")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        cuda = "cuda" in report.keywords
        _skipped["cuda" if cuda else "other"].append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its deselections reach the summary
        session.config.workeroutput["heldout"] = _heldout
    if _skipped["other"] and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:  # xdist controller
    _heldout.extend(h for h in getattr(node, "workeroutput", {}).get("heldout", []) if h not in _heldout)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    tr = terminalreporter
    if _skipped["cuda"]:
        tr.write_line(f"{len(_skipped['cuda'])} CUDA tests skipped: no GPU")
    if _heldout:
        tr.write_line(
            f"held-out tests deselected: set {' / '.join(_heldout)} to the generated folder to run them"
        )
    if _skipped["other"]:
        tr.write_line(
            f"FAILED: {len(_skipped['other'])} non-CUDA tests skipped (only CUDA tests may skip): "
            + ", ".join(_skipped["other"][:10]),
            red=True,
        )
