"""Run a zckpt command on a mutated checkpoint and classify what happened.

Owns the standard commands (``COMMANDS``), the clean reference runs they are judged against (``Refs``,
cached per zckpt source hash under the fuzz cache), the outcome kinds and the classification rules:

- ``ok-identical``: exit 0 and the output equals the clean run's (files byte- or tensor-equal; ``inspect``:
  same tensors; ``verify``/``diff``: nothing checksummed or inconsistent was touched);
- ``ok-refused``: a refusal: exit != 0 with stderr = one ``error: ...`` line (<= 300 chars, naming a touched
  file) plus at most one ``hint: ...`` line, nothing at the output path; or ``verify``/``diff`` exit 1 with
  their report naming the file;
- ``ok-undetectable``: exit 0, output differs, but only bytes/values no checksum covers changed;
- failures: ``silent-wrong`` (exit 0, output differs or the mutation must be refused; ``verify`` OK or
  ``diff`` EQUAL on checksummed/inconsistent damage; stale shards; two racing writers both "succeed"),
  ``traceback``, ``hang`` (timeout, twice: ``suite``), ``memory`` (peak RSS > 1 GiB, or ``MemoryError`` at
  the 3 GiB address-space limit), ``input-modified`` (the input folder changed), ``leftover`` (staging
  debris, or output left by a refused run), ``unclear`` (stderr not one error line, too long, or not naming
  the file).

When several apply the worst wins (``FAIL_KINDS`` order); every reason is kept in ``Outcome.why``.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.fuzz import compare, corpus, proc
from tests.fuzz.corpus import Base
from tests.fuzz.mutation import Mutation, fresh_copy

OK_KINDS = ("ok-identical", "ok-refused", "ok-undetectable")
FAIL_KINDS = ("hang", "memory", "traceback", "input-modified", "leftover", "silent-wrong", "unclear")
KINDS = FAIL_KINDS + OK_KINDS
MAX_ERROR = 300
MAX_WHY = 400
TIMEOUT = 10.0
SHARDED = ("deepspeed", "native", "dcp")


@dataclass(frozen=True)
class Command:
    """A standard command: CLI args with ``{in}``, ``{root}``, ``{clean}``, ``{world}`` placeholders."""

    name: str
    args: tuple[str, ...]
    writes: bool = False
    kinds: tuple[str, ...] = corpus.KINDS


COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("inspect", ("inspect", "{in}", "--json")),
    Command("verify", ("verify", "{in}")),
    Command("consolidate", ("consolidate", "{in}", "{root}/out/model.safetensors", "--no-progress"), True),
    Command("consolidate-hf", ("consolidate", "{in}", "{root}/out/hf", "--max-shard-size", "2KB",
                               "--no-progress"), True),
    Command("consolidate-bin", ("consolidate", "{in}", "{root}/out/model.bin", "--no-progress"), True),
    Command("diff", ("diff", "{in}", "{clean}", "--include-optimizer", "--no-progress")),
    Command("reshard", ("reshard", "{in}", "{root}/out/rs", "--world", "{world}", "--no-progress"), True,
            SHARDED),
    Command("reshard-to-native", ("reshard", "{in}", "{root}/out/rs", "--world", "{world}", "--to", "native",
                                  "--no-progress"), True, ("deepspeed", "dcp")),
)}  # fmt: skip


def commands_for(base: Base) -> list[str]:
    return [c.name for c in COMMANDS.values() if base.kind in c.kinds]


def fill(args: list[str] | tuple[str, ...], root: Path, m_input: str, base: Base, cache: Path) -> list[str]:
    world = "2" if base.world == 3 else "3"
    clean = corpus.base_dir(base, cache) / base.input
    subs = {"{in}": str(root / m_input), "{root}": str(root), "{clean}": str(clean), "{world}": world}
    out = []
    for a in args:
        for k, v in subs.items():
            a = a.replace(k, v)
        out.append(a)
    return out


# ---- clean references --------------------------------------------------------------------------------
@dataclass
class Ref:
    """A command's run on the clean base: its exit status, stdout and output folder (``out/``)."""

    ok: bool
    rc: int | None
    stdout: str
    stderr: str
    out: Path


def zckpt_key() -> str:
    h = hashlib.sha256(repr(sorted(COMMANDS.items())).encode())
    for f in sorted((corpus.ROOT / "zckpt").rglob("*.py")):
        h.update(str(f.relative_to(corpus.ROOT)).encode() + f.read_bytes())
    return h.hexdigest()[:12]


class Refs:
    """Clean runs, computed on first use and cached in ``<cache>/refs-<zckpt hash>/<base>/<command>/``."""

    def __init__(self, cache: Path, bases: dict[str, Base], timeout: float = 60.0) -> None:
        self.cache, self.bases, self.timeout = cache, bases, timeout
        self.dir = cache / f"refs-{zckpt_key()}"
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, base: Base, cmd: str) -> Ref:
        with self._guard:
            lock = self._locks.setdefault((base.name, cmd), threading.Lock())
        with lock:
            where = self.dir / base.name / cmd
            if not (where / "ref.json").is_file():
                self._compute(base, cmd, where)
            d = json.loads((where / "ref.json").read_text())
            return Ref(d["ok"], d["rc"], d["stdout"], d["stderr"], where / "out")

    def _compute(self, base: Base, cmd: str, where: Path) -> None:
        _, root = fresh_copy(corpus.base_dir(base, self.cache))
        try:
            args = fill(COMMANDS[cmd].args, root, base.input, base, self.cache)
            p = proc.run_zckpt(args, cwd=root, timeout=self.timeout)
            tmp = Path(tempfile.mkdtemp(prefix=".ref-", dir=self.dir.parent))
            shutil.copytree(root / "out", tmp / "out", symlinks=True)
            doc = {"ok": p.rc == 0, "rc": p.rc, "stdout": p.stdout, "stderr": p.stderr[-2000:], "args": args}
            (tmp / "ref.json").write_text(json.dumps(doc))
            where.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(where, ignore_errors=True)
            tmp.rename(where)
        finally:
            shutil.rmtree(root, ignore_errors=True)


# ---- outcomes ----------------------------------------------------------------------------------------
@dataclass
class Outcome:
    kind: str
    why: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.kind in FAIL_KINDS


def worst(found: list[tuple[str, str]]) -> Outcome:
    kinds = [k for k, _ in found]
    kind = min(kinds, key=KINDS.index)
    ordered = sorted(((k, w) for k, w in found if w), key=lambda kw: KINDS.index(kw[0]))
    return Outcome(kind, [f"{k}: {w[:MAX_WHY]}{'...' if len(w) > MAX_WHY else ''}" for k, w in ordered])


def process_problems(p: proc.Proc, timeout: float) -> list[tuple[str, str]]:
    """hang / memory / traceback, whatever the command."""
    out: list[tuple[str, str]] = []
    if stuck(p):
        out.append(("hang", f"still running after {timeout:g}s (killed)"))
    if p.over_memory or p.peak_rss_mb > proc.RSS_LIMIT_MB:
        out.append(("memory", f"peak RSS {p.peak_rss_mb:.0f} MB"))
    if "MemoryError" in p.stderr:
        out.append(("memory", f"MemoryError at the {proc.AS_LIMIT >> 30} GiB address-space limit: "
                              f"{_last_line(p.stderr)}"))  # fmt: skip
    if "Traceback (most recent call last)" in p.stderr:
        out.append(("traceback", _last_line(p.stderr)))
    elif p.rc is not None and p.rc < 0 and not p.timed_out and not p.over_memory and p.signalled != -p.rc:
        out.append(("traceback", f"killed by signal {signal.Signals(-p.rc).name}"))
    return out


def stuck(p: proc.Proc) -> bool:
    """Killed at the timeout before printing anything final. (Killed after its error or traceback was out is
    a slow exit on a loaded machine, judged like an exit.)"""
    leaving = "Traceback (most recent call last)" in p.stderr or p.stderr.lstrip().startswith("error: ")
    return p.timed_out and not leaving


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:240] if lines else ""


def error_problems(
    p: proc.Proc, names: tuple[str, ...], misleading: tuple[str, ...] = ()
) -> list[tuple[str, str]]:
    """A refusal's stderr: one ``error:`` line (+ one ``hint:``), short, naming one of ``names``, using none
    of the ``misleading`` phrases."""
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("warning: ")]
    if (
        not lines
        or not lines[0].startswith("error: ")
        or len(lines) > 2
        or (len(lines) == 2 and not lines[1].startswith("hint: "))
    ):
        first = " | ".join(ln[:100] for ln in lines[:4])
        return [("unclear", f"stderr is not one error line (+ hint): {len(lines)} lines: {first}")]
    err = lines[0]
    out = []
    if max(len(ln) for ln in lines) > MAX_ERROR:
        out.append(("unclear", f"{max(len(ln) for ln in lines)}-char error/hint line: {err[:160]}..."))
    if names and not any(n in err for n in names):
        out.append(("unclear", f"error does not name {' or '.join(names[:3])}: {err[:200]}"))
    wrong = [ph for ph in misleading if ph in err]
    if wrong:
        out.append(("unclear", f"misleading ({wrong[0]!r}): {err[:200]}"))
    return out


def report_problems(p: proc.Proc, names: tuple[str, ...]) -> list[tuple[str, str]]:
    """verify / diff exit 1: the report is on stdout; it must name the damaged file, in short lines."""
    out = []
    long = [ln for ln in p.stdout.splitlines() if len(ln) > 4 * MAX_ERROR]
    if long:
        out.append(("unclear", f"{len(long[0])}-char report line: {long[0][:120]}..."))
    if names and not any(n in p.stdout for n in names):
        out.append(("unclear", f"report does not name {' or '.join(names[:3])}: {_last_line(p.stdout)}"))
    return out


def success_verdict(p: proc.Proc, m: Mutation, cmd: str, ref: Ref | None, out_dir: Path) -> tuple[str, str]:
    """Judge an exit-0 run."""
    if cmd == "verify":  # verify's job: checksums and consistency
        damaged = m.checksummed or m.inconsistent or m.must_refuse
        return ("silent-wrong", "verify says OK on a damaged input") if damaged else ("ok-identical", "")
    if cmd == "diff":  # EQUAL is truthful on inconsistent files whose compared values are intact
        damaged = m.checksummed or m.must_refuse
        return ("silent-wrong", "diff says EQUAL on checksummed damage") if damaged else ("ok-identical", "")
    if m.must_refuse:
        return "silent-wrong", "exit 0 on an input that must be refused"
    if ref is None:
        return "ok-identical", "exit 0 (no reference output to compare)"
    diff = (
        compare.compare_inspect(p.stdout, ref.stdout)
        if cmd == "inspect"
        else compare.compare_trees(out_dir, ref.out)
    )
    if diff is None:
        return "ok-identical", ""
    if m.value_only and not m.checksummed:
        return "ok-undetectable", f"output differs (unchecked values): {diff}"
    return "silent-wrong", f"exit 0, output differs from the clean run: {diff}"


def classify(p: proc.Proc, m: Mutation, cmd: str, ref: Ref | None, *, timeout: float,
             before: proc.Snapshot, expect_empty_out: bool = True) -> Outcome:  # fmt: skip
    root = m.root
    found = process_problems(p, timeout)
    mods = proc.changed(before, proc.snapshot(root / "ckpt"))
    if mods:
        found.append(("input-modified", f"{len(mods)} changes under the input: {mods[:4]}"))
    debris = proc.leftovers(root)
    if debris:
        found.append(("leftover", f"staging debris: {debris[:3]}"))
    if not stuck(p) and not p.over_memory:
        verdicts = _verdicts(p, m, cmd, ref, expect_empty_out)
        crashed = any(k == "traceback" for k, _ in found)  # its stderr is the traceback: not judged again
        found += [(k, w) for k, w in verdicts if not (crashed and k == "unclear")]
    return worst(found or [("ok-refused", "")])


def _verdicts(
    p: proc.Proc, m: Mutation, cmd: str, ref: Ref | None, expect_empty_out: bool
) -> list[tuple[str, str]]:
    out_dir = m.root / "out"
    if p.rc == 0:
        found = [success_verdict(p, m, cmd, ref, out_dir)]
        found += stale_shards(out_dir) if "no-stale-shards" in m.checks else []
        return found
    if p.rc == 1 and cmd in ("verify", "diff"):  # diff's report names tensors, verify's names files
        return report_problems(p, m.names if cmd == "verify" else ()) or [("ok-refused", "")]
    killed = p.signalled is not None and p.rc == -p.signalled  # died of our signal: nothing to print
    found = [] if killed else error_problems(p, m.names, m.misleading)
    left = [n for n in compare.files_under(out_dir) if not compare.is_debris(n)] if expect_empty_out else []
    if left:
        found.append(("leftover", f"refused but left output: {left[:3]}"))
    return found or [("ok-refused", "")]


_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.")


def stale_shards(out_dir: Path) -> list[tuple[str, str]]:
    """Shards or indexes of an earlier output left beside the new one."""
    names = [p.name for p in out_dir.iterdir() if not p.name.endswith(".sha256")]
    counts = {m.group(2) for n in names if (m := _SHARD.search(n))}
    single = any(n in ("model.safetensors", "model.bin") for n in names)
    if len(counts) > 1 or (single and (counts or any(n.endswith(".index.json") for n in names))):
        return [
            (
                "silent-wrong",
                f"stale files of the earlier output left beside the new one: {sorted(names)[:6]}",
            )
        ]
    return []


# ---- running a case ----------------------------------------------------------------------------------
@dataclass
class CaseResult:
    mutation: Mutation
    command: str
    argv: list[str]
    outcome: Outcome
    procs: list[proc.Proc]
    index: int | None = None
    """The case number in its suite run (``--index`` replays it)."""

    def to_json(self) -> dict[str, Any]:
        p = self.procs[-1] if self.procs else None
        return {
            "index": self.index, "command": self.command, "argv": self.argv, "outcome": self.outcome.kind,
            "why": self.outcome.why,
            "mutation": self.mutation.to_json(),
            "rc": p.rc if p else None, "seconds": round(p.seconds, 2) if p else None,
            "peak_rss_mb": round(p.peak_rss_mb) if p else None,
            "stderr_tail": p.stderr[-1500:] if p else "", "stdout_tail": p.stdout[-600:] if p else "",
        }  # fmt: skip


def run_case(m: Mutation, cmd: str, base: Base, refs: Refs, *, timeout: float = TIMEOUT) -> CaseResult:
    """Run ``cmd`` (a standard command, or the mutation's own scenario) on the mutated copy; classify."""
    from tests.fuzz import scenario_run

    if m.scenario is not None:
        return scenario_run.run(m, base, refs, timeout=timeout)
    args = fill(COMMANDS[cmd].args, m.root, m.input, base, refs.cache)
    ref = refs.get(base, cmd)
    before = proc.snapshot(m.root / "ckpt")
    p = proc.run_zckpt(args, cwd=m.root, timeout=timeout, no_dac=m.no_dac_override)
    outcome = classify(p, m, cmd, ref if ref.ok else None, timeout=timeout, before=before)
    return CaseResult(m, cmd, args, outcome, [p])
