"""Kill trials: run a zckpt command or an engine save in a forked child, SIGKILL (or SIGINT) it at a chosen
moment, and judge what is left on disk. Used by ``tests/test_atomic.py`` and ``tests/stress/kill_stress.py``.

Children are ``os.fork()`` copies of the calling process, which has zckpt and torch imported already, so a
trial costs milliseconds instead of an interpreter start. ``ZCKPT_TEST_WRITE_DELAY`` (seconds slept before
each ``HashingSink.write``, injected by ``_slow_writes``) stretches a write so kill moments land inside it. A
kill moment is either uniform over the whole run or uniform over the write phase (from the moment a temporary
name appears in the output folder until the child exits), both measured on an uninterrupted calibration run.

Verdicts: ``absent`` (no output), ``complete`` (output present, equal to a reference written without a kill,
and ``zckpt verify`` clean), ``CORRUPT`` (anything else: the bug these tests exist to catch).
"""

from __future__ import annotations

import os
import random
import resource
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _slow_writes
import torch

_slow_writes.install()  # forked children inherit it; each file reads the delay its child set
DELAY_ENV = _slow_writes.ENV
TEMP_MARKS = ("zckpt-tmp", "zckpt-old", ".tmp-")


# ---- forked children -----------------------------------------------------------------------------
def fork(
    fn: Callable[..., Any],
    *args: Any,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    fsize_limit: int | None = None,
) -> int:
    """Run ``fn(*args)`` in a forked child; its return value (or SystemExit code) is the exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 99
    try:
        out = open(log or os.devnull, "w", buffering=1)  # noqa: SIM115 - the child exits below
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        sys.stdout = sys.stderr = out
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if fsize_limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
        os.environ.pop(DELAY_ENV, None)
        os.environ.update(env or {})
        torch.set_num_threads(1)
        ret = fn(*args)
        code = ret if isinstance(ret, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 98
    finally:
        try:
            sys.stdout.flush()
        finally:
            os._exit(code)


def wait(pid: int, timeout: float = 60.0) -> int:
    """Exit status of ``pid`` (negative signal number when killed); SIGKILLs it after ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.002)


def exited(pid: int) -> bool:
    """Whether child ``pid`` has exited, without reaping it."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def run_cli(args: list[str]) -> int:
    """Child body: the zckpt CLI on ``args`` (exit status as the CLI sets it)."""
    from zckpt.cli.app import app

    app(args=[str(a) for a in args], prog_name="zckpt")
    return 0


def temps(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if any(m in p.name for m in TEMP_MARKS)] if folder.exists() else []


# ---- timing ------------------------------------------------------------------------------------------
@dataclass
class Timing:
    total: float
    """Fork to exit of an uninterrupted run."""
    write_start: float
    """Fork to the first temporary name in the watched folder."""


def calibrate(start: Callable[[], int], watch: Path) -> Timing:
    """Run ``start()`` (returns a child pid) to completion, timing it and when its first temp name appears."""
    t0 = time.monotonic()
    pid = start()
    seen = None
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        now = time.monotonic() - t0
        if seen is None and temps(watch):
            seen = now
        if got:
            code = os.waitstatus_to_exitcode(status)
            assert code == 0, f"calibration run failed with {code}"
            return Timing(now, seen if seen is not None else now * 0.5)
        time.sleep(0.001)


def kill_at(
    pid: int, watch: Path, timing: Timing, rng: random.Random, sig: int = signal.SIGKILL, early: bool = False
) -> str:
    """Send ``sig`` at a random moment: 1 trial in 4 uniform over the whole run, else uniform over the write
    phase (after the first temp name appears). ``early``: uniform over the first tenth of the write phase, a
    moment inside the write even when the calibration run was slow. Returns a description of the moment."""
    t0 = time.monotonic()
    if not early and rng.random() < 0.25:
        at = rng.uniform(0, timing.total * 1.05)
        while time.monotonic() - t0 < at:
            if exited(pid):
                return "after-exit"
            time.sleep(0.001)
        how = f"t={at:.3f}s"
    else:
        deadline = t0 + timing.total * 3 + 5
        while not temps(watch) and time.monotonic() < deadline:
            time.sleep(0.001)
        at = rng.uniform(0, max(timing.total - timing.write_start, 0.01) * (0.1 if early else 1.05))
        time.sleep(at)
        how = f"write+{at:.3f}s"
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return "after-exit"
    return how


# ---- judging -------------------------------------------------------------------------------------
def tensors_of(path: Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor (model and optimizer state) of a checkpoint, through the zckpt reader."""
    from zckpt.formats import open_checkpoint

    ck = open_checkpoint(path, tag=tag)
    return {k: ck.read(k) for k in ck.entries}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a
    )


def verify_ok(path: Path, tag: str | None = None) -> bool:
    from zckpt.ops.verify import verify

    return verify(path, tag=tag).ok


def judge_output(out: Path, ref: dict[str, torch.Tensor]) -> str:
    """``absent``, ``complete`` (equal to ``ref`` and verify clean) or ``CORRUPT: why``."""
    if not out.exists():
        return "absent"
    try:
        got = tensors_of(out)
    except Exception as e:  # noqa: BLE001 - any failure to read a present output is the bug
        return f"CORRUPT: unreadable ({type(e).__name__}: {e})"
    if not same(got, ref):
        return "CORRUPT: values differ from the uninterrupted run"
    if not verify_ok(out):
        return "CORRUPT: verify reports problems"
    return "complete"
