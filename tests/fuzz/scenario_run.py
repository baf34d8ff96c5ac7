"""Running the invocation scenarios of ``tests.fuzz.scenarios`` and classifying them with ``runner``'s rules.

- ``plain``: the mutation's own argv (and cwd), after its ``setup`` commands; exit 0 is judged against the
  clean output of ``params["ref_command"]`` when the output lands in ``out/``;
- ``concurrent``: the argv twice at the same moment: both exiting 0 is ``silent-wrong`` (one output
  silently replaced the other);
- ``signal``: a signal to the process group (``_trigger``: a moment of start-up, or just after the staging
  folder appeared, writes slowed by ``ZCKPT_TEST_WRITE_DELAY``); exit 130 must come with one error line,
  and nothing may be left behind;
- ``kill-rerun``: SIGKILL mid-write, then the same command again: the second run is judged, and staging
  debris of the first counts as ``leftover``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path

from tests.fuzz import proc
from tests.fuzz.corpus import Base
from tests.fuzz.mutation import Mutation, NotApplicable
from tests.fuzz.runner import CaseResult, Ref, Refs, classify, fill, worst

SLOW_WRITES = {"ZCKPT_TEST_WRITE_DELAY": "0.02"}


def run(m: Mutation, base: Base, refs: Refs, *, timeout: float) -> CaseResult:
    runners = {"plain": _plain, "concurrent": _concurrent, "signal": _signal, "kill-rerun": _kill_rerun}
    return runners[str(m.scenario)](m, base, refs, timeout)


def _ref(m: Mutation, base: Base, refs: Refs) -> tuple[str, Ref | None]:
    cmd = m.params.get("ref_command") or "-"
    if cmd == "-":
        return "-", None
    ref = refs.get(base, cmd)
    return cmd, ref if ref.ok else None


def _plain(m: Mutation, base: Base, refs: Refs, timeout: float) -> CaseResult:
    for step in m.setup:
        p = proc.run_zckpt(fill(step, m.root, m.input, base, refs.cache), cwd=m.root, timeout=60)
        if p.rc != 0:
            raise NotApplicable(None, f"setup failed: {p.stderr[-200:]}")
    args = fill(m.argv or [], m.root, m.input, base, refs.cache)
    cwd = m.root / m.cwd if m.cwd else m.root
    before = proc.snapshot(m.root / "ckpt")
    p = proc.run_zckpt(args, cwd=cwd, timeout=timeout)
    cmd, ref = _ref(m, base, refs)
    outcome = classify(p, m, cmd, ref, timeout=timeout, before=before, expect_empty_out=not m.setup)
    return CaseResult(m, m.op, args, outcome, [p])


def _concurrent(m: Mutation, base: Base, refs: Refs, timeout: float) -> CaseResult:
    args = fill(m.argv or [], m.root, m.input, base, refs.cache)
    cmd, ref = _ref(m, base, refs)
    before = proc.snapshot(m.root / "ckpt")
    a, b = proc.run_pair(args, cwd=m.root, timeout=timeout)
    found = []
    for p in (a, b):
        found += classify(p, m, cmd, ref, timeout=timeout, before=before, expect_empty_out=False).why
    kinds = [(w.split(": ", 1)[0], w.split(": ", 1)[1]) for w in found]
    if a.rc == 0 and b.rc == 0:
        kinds.append(
            ("silent-wrong", "both concurrent writers exited 0; one output silently replaced the other")
        )
    return CaseResult(m, "concurrent", args, worst(kinds or [("ok-refused", "")]), [a, b])


def _trigger(m: Mutation, sent: list[int]) -> proc.Tick:
    """Send ``params["signal"]`` to the process group once: ``at`` seconds after start ("time"), or ``at``
    seconds after a staging folder appeared in ``out/`` ("staging"; never, if none appears in time)."""
    signum, at, out = int(m.params["signal"]), float(m.params["at"]), m.root / "out"
    seen: list[float] = []

    def tick(elapsed: float, pid: int) -> None:
        if sent:
            return
        if m.params["trigger"] == "staging":
            if not seen and any("zckpt-tmp" in p.name for p in out.iterdir()):
                seen.append(elapsed)
            if not seen or elapsed < seen[0] + at:
                return
        elif elapsed < at:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signum)
        sent.append(signum)

    return tick


def _signal(m: Mutation, base: Base, refs: Refs, timeout: float) -> CaseResult:
    args = fill(m.argv or [], m.root, m.input, base, refs.cache)
    cmd, ref = _ref(m, base, refs)
    sent: list[int] = []
    before = proc.snapshot(m.root / "ckpt")
    env = SLOW_WRITES if m.params["trigger"] == "staging" else None
    p = proc.run_zckpt(args, cwd=m.root, timeout=timeout, env=env, on_tick=_trigger(m, sent))
    p.signalled = sent[0] if sent else None
    outcome = classify(p, m, cmd, ref, timeout=timeout, before=before)
    if before_zckpt(p):  # Python's own start-up: no program can catch it; what it left is still judged
        rest = [w for w in outcome.why if not w.startswith("traceback: ")]
        note = (
            "note: SIGINT while the interpreter was starting, before any zckpt code ran (Python's traceback)"
        )
        outcome = worst([(w.split(": ", 1)[0], w.split(": ", 1)[1]) for w in rest] or [("ok-refused", "")])
        outcome.why.append(note)
    if not sent:
        outcome.why.append("note: the signal was never sent (no staging folder seen, or it finished first)")
    return CaseResult(m, m.op, args, outcome, [p])


_ZCKPT_FRAME = re.compile(r'File "[^"]*/zckpt/')


def before_zckpt(p: proc.Proc) -> bool:
    """A SIGINT that landed while ``python -m`` was still importing ``runpy`` and the standard library
    (seed 15 case 114, 0.07 s after start on a loaded machine: "Could not import runpy module", exit 1 or
    SIGINT): a traceback with no frame of zckpt, which installs its start-up handler at the top of its
    package."""
    return (
        p.signalled == signal.SIGINT
        and p.rc in (1, -signal.SIGINT)  # runpy's import failed, or the KeyboardInterrupt left as SIGINT
        and "Traceback (most recent call last)" in p.stderr
        and p.stderr.rstrip().endswith("KeyboardInterrupt")
        and _ZCKPT_FRAME.search(p.stderr) is None
    )


def _kill_rerun(m: Mutation, base: Base, refs: Refs, timeout: float) -> CaseResult:
    args = fill(m.argv or [], m.root, m.input, base, refs.cache)
    cmd, ref = _ref(m, base, refs)
    sent: list[int] = []
    first = proc.run_zckpt(args, cwd=m.root, timeout=timeout, env=SLOW_WRITES, on_tick=_trigger(m, sent))
    _clear_outputs(m.root / "out")
    before = proc.snapshot(m.root / "ckpt")
    second = proc.run_zckpt(args, cwd=m.root, timeout=timeout)
    outcome = classify(second, m, cmd, ref, timeout=timeout, before=before)
    if not sent:
        outcome.why.append(
            "note: the first run was not killed (no staging folder seen, or it finished first)"
        )
    return CaseResult(m, m.op, args, outcome, [first, second])


def _clear_outputs(out: Path) -> None:
    """Remove what a finished first run published (not hidden staging), so the re-run is not refused."""
    import shutil

    for p in out.iterdir():
        if not p.name.startswith("."):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
