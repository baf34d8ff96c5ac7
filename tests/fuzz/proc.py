"""Running one zckpt CLI process under limits, and looking at the filesystem around it.

``run_zckpt`` starts ``python -m zckpt.cli.app ARGS`` from the worktree (``PYTHONPATH``) in its own session,
under ``prlimit --as`` (address space ``AS_LIMIT``: an allocation a file merely claims fails with
``MemoryError`` instead of taking the machine) and ``nice -n 10``, optionally without CAP_DAC_OVERRIDE
(``setpriv``: root would otherwise read a chmod-000 file). It polls ``/proc/<pid>/status`` every 20 ms for
the peak RSS (``VmHWM``), kills the process group past ``RSS_LIMIT`` or the timeout, and returns a ``Proc``
(peak RSS also from ``wait4``). ``SLOTS`` caps the zckpt processes alive at once across threads.

``snapshot`` / ``changed`` tell whether a run modified its input; ``leftovers`` finds staging debris
(``*.zckpt-tmp-*``, ``*.zckpt-old-*``, ``.<name>.tmp-<pid>``, ``*.tmp``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.fuzz.corpus import ROOT

AS_LIMIT = 3 << 30
RSS_LIMIT_MB = 1024
POLL_S = 0.02
MAX_PROCS = 2
SLOTS = threading.BoundedSemaphore(MAX_PROCS)
_PAIR = threading.Lock()
_NO_DAC = [
    "setpriv",
    "--inh-caps=-dac_override,-dac_read_search",
    "--bounding-set=-dac_override,-dac_read_search",
]


@dataclass
class Proc:
    """What one process did."""

    argv: list[str]
    cwd: str
    rc: int | None
    stdout: str
    stderr: str
    seconds: float
    peak_rss_mb: float
    timed_out: bool = False
    over_memory: bool = False
    signalled: int | None = None
    """A signal the harness sent on purpose (scenarios)."""


Tick = Callable[[float, int], None]


def command_line(args: list[str], *, no_dac: bool = False) -> list[str]:
    prefix = ["prlimit", f"--as={AS_LIMIT}", "--core=0", "--", "nice", "-n", "10"]
    return [*prefix, *(_NO_DAC if no_dac else []), sys.executable, "-m", "zckpt.cli.app", *args]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZCKPT_")}
    # the tests folder and its _site: a ZCKPT_TEST_WRITE_DELAY in ``extra`` slows the child's writes there
    path = os.pathsep.join(str(p) for p in (ROOT, ROOT / "tests", ROOT / "tests" / "_site"))
    env.update({"PYTHONPATH": path, "COLUMNS": "120", "NO_COLOR": "1"})
    env.update(extra or {})
    return env


def run_zckpt(args: list[str], *, cwd: Path, timeout: float, env: dict[str, str] | None = None,
              no_dac: bool = False, on_tick: Tick | None = None, slots: int = 1) -> Proc:  # fmt: skip
    """Run the CLI once (see the module docstring); ``slots`` process slots are held meanwhile."""
    with _slots(slots):
        return _run(command_line(args, no_dac=no_dac), cwd, timeout, child_env(env), on_tick, args)


@contextlib.contextmanager
def _slots(n: int) -> Iterator[None]:
    with _PAIR if n > 1 else contextlib.nullcontext():
        for _ in range(n):
            SLOTS.acquire()
    try:
        yield
    finally:
        for _ in range(n):
            SLOTS.release()


def run_pair(args: list[str], *, cwd: Path, timeout: float, env: dict[str, str] | None = None) -> list[Proc]:
    """The same command twice at the same moment (two slots held), e.g. two writers racing."""
    results: list[Proc] = []
    cmd = command_line(args)
    with _slots(2):

        def one() -> None:
            results.append(_run(cmd, cwd, timeout, child_env(env), None, args))

        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return results


def _run(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str], on_tick: Tick | None,
         args: list[str]) -> Proc:  # fmt: skip
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115 - closed by finish()
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                         start_new_session=True)  # fmt: skip
    p._fuzz_files = (out, err)  # type: ignore[attr-defined]
    return finish(p, time.monotonic(), timeout, args, str(cwd), on_tick)


def finish(p: subprocess.Popen[bytes], t0: float, timeout: float, args: list[str], cwd: str,
           on_tick: Tick | None = None) -> Proc:  # fmt: skip
    """Watch ``p`` until it exits (killing it past the timeout or the RSS limit) and collect its output.

    ``wait4``'s ``ru_maxrss`` is Linux's high-water mark of the child's memory *including the copy of this
    process it was forked from* (recorded at ``execve``), so it is counted only above this process's own
    high-water mark: a pytest process past 1 GB made every case look like a 1 GB run."""
    parent_kb = _hwm_kb(os.getpid())  # its high-water mark: what a fork of it can inherit at most
    peak_kb, timed_out, over, status, ru_kb = 0, False, False, 0, 0
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            ru_kb = ru.ru_maxrss
            break
        peak_kb = max(peak_kb, _hwm_kb(p.pid))
        elapsed = time.monotonic() - t0
        if on_tick is not None:
            on_tick(elapsed, p.pid)
        if peak_kb > RSS_LIMIT_MB * 1024 or elapsed > timeout:
            _kill_group(p.pid)
            _, status, ru = os.wait4(p.pid, 0)
            ru_kb = ru.ru_maxrss
            ours = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL  # not an exit just before
            over, timed_out = ours and peak_kb > RSS_LIMIT_MB * 1024, ours and elapsed > timeout
            break
        time.sleep(POLL_S)
    _kill_group(p.pid)  # anything it left running
    p.returncode = os.waitstatus_to_exitcode(status)
    out, err = p._fuzz_files  # type: ignore[attr-defined]
    ru_kb = ru_kb if ru_kb > parent_kb else 0  # else it is this process's size, inherited at the fork
    return Proc(args, cwd, p.returncode, _read(out), _read(err), time.monotonic() - t0,
                max(peak_kb, ru_kb) / 1024, timed_out, over)  # fmt: skip


def _hwm_kb(pid: int, key: str = "VmHWM:") -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _read(f: object) -> str:
    f.seek(0)  # type: ignore[attr-defined]
    data: bytes = f.read()  # type: ignore[attr-defined]
    f.close()  # type: ignore[attr-defined]
    return data.decode("utf-8", "replace")


# ---- the filesystem around a run ---------------------------------------------------------------------
Snapshot = dict[str, tuple[bool, int, int, int]]


def snapshot(folder: Path) -> Snapshot:
    """{relative path: (is dir, size, mtime_ns, mode)} of everything under ``folder`` (links not followed)."""
    out: Snapshot = {}
    for d, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = os.path.join(d, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            out[os.path.relpath(p, folder)] = (name in dirs, st.st_size, st.st_mtime_ns, st.st_mode)
    return out


def changed(before: Snapshot, after: Snapshot) -> list[str]:
    """What differs: ``+added``, ``-removed``, ``~modified`` (folders only when added or removed)."""
    out = [f"+{k}" for k in sorted(set(after) - set(before))]
    out += [f"-{k}" for k in sorted(set(before) - set(after))]
    out += [f"~{k}" for k in sorted(set(before) & set(after)) if not before[k][0] and before[k] != after[k]]
    return out


def leftovers(folder: Path) -> list[str]:
    """Staging debris under ``folder`` (relative paths)."""
    out = []
    for d, dirs, files in os.walk(folder):
        for name in dirs + files:
            if "zckpt-tmp" in name or "zckpt-old" in name or ".tmp-" in name or name.endswith(".tmp"):
                out.append(os.path.relpath(os.path.join(d, name), folder))
    return sorted(out)
