"""The seeded fuzz suite: plan N cases across families, bases and commands, run them, report.

    python -m tests.fuzz.suite --seed 1 --cases 400 --report fuzz.json     # long mode
    python -m tests.fuzz.suite --fast                                      # ~80 cases, for `make test` later
    python -m tests.fuzz.suite --families latest ranks --cases 40 -v
    python -m tests.fuzz.suite --ops concurrent-consolidates shape-bool --cases 10 -v   # chosen mutators
    python -m tests.fuzz.suite --seed 1 --index 77 113 --keep -v      # replay cases of a report, keep copies
    python -m tests.fuzz.suite --dcp --seed 11 --cases 300 --report dcp.json   # the DCP families only
    python -m tests.fuzz.suite --megatron --seed 0 --cases 100 --report meg.json  # the Megatron families

Case ``i`` of seed ``S`` is fully determined by ``(S, i)``: its family (round-robin over the selected
families, so each gets its share), mutator and base (``random.Random(f"{S}:{i}")``), the damage, and the
command (a scenario's own, or one of ``runner.COMMANDS`` the base supports). Cases run on ``--jobs``
threads (default 2), never more than ``proc.MAX_PROCS`` zckpt processes at once. Prints a table of
outcomes by family x kind and writes a JSON report with every failing case (command, mutation, stderr
tail). A case killed at ``--timeout`` runs once more, alone, with ``RETRY_FACTOR`` x the timeout; its
second outcome stands (a ``hang`` only when it is still running then). Exit status 0, or with ``--strict``
1 when any case failed.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.fuzz import corpus, mutation, runner
from tests.fuzz.corpus import Base
from tests.fuzz.mutation import NotApplicable, Op
from tests.fuzz.mutators import DCP_FAMILIES, FAMILIES, MEGATRON_FAMILIES, SIDE_FAMILIES

FAST_SEED, FAST_CASES = 0, 60
TRIES = 8
RETRY_FACTOR = 6
"""A case killed at the timeout runs once more, alone, with this many times the timeout: a loaded machine
(CI's 2 cores shared with other test workers) can make a healthy reshard take over 10 s; a real hang still
hangs then."""


@dataclass(frozen=True)
class Planned:
    index: int
    family: str
    ops: frozenset[str] = frozenset()
    """Only these mutators (empty: all of the family's)."""


def plan(n: int, families: list[str], ops: frozenset[str] = frozenset(), only: list[int] | None = None
         ) -> list[Planned]:  # fmt: skip
    """Cases ``0..n-1`` (or just the indices ``only``: case i is the same case whatever else runs)."""
    return [Planned(i, families[i % len(families)], ops) for i in (only if only is not None else range(n))]


def _choose(rng: random.Random, case: Planned, bases: list[Base]) -> tuple[Op, Base]:
    usable = [o for o in FAMILIES[case.family] if any(o.applies(b) for b in bases)]
    op = rng.choice([o for o in usable if o.name in case.ops] if case.ops else usable)
    return op, rng.choice([b for b in bases if op.applies(b)])


def _command(rng: random.Random, m: mutation.Mutation, base: Base, refs: runner.Refs) -> str | None:
    if m.scenario is not None:
        return m.op
    names = [c for c in (m.commands or runner.commands_for(base)) if base.kind in runner.COMMANDS[c].kinds]
    rng.shuffle(names)
    return next((c for c in names if refs.get(base, c).ok), None)


def run_one(seed: int, case: Planned, bases: list[Base], refs: runner.Refs, timeout: float,
            keep: bool) -> runner.CaseResult | None:  # fmt: skip
    """Run planned case; None when no mutator applied. A bug of the harness itself is printed, not raised."""
    try:
        return _run_one(seed, case, bases, refs, timeout, keep)
    except Exception:
        print(
            f"[{case.index:4d}] HARNESS ERROR (family {case.family}):\n{traceback.format_exc()}",
            file=sys.stderr,
        )
        return None


def _run_one(seed: int, case: Planned, bases: list[Base], refs: runner.Refs, timeout: float,
             keep: bool) -> runner.CaseResult | None:  # fmt: skip
    rng = random.Random(f"{seed}:{case.index}")
    for _ in range(TRIES):
        op, base = _choose(rng, case, bases)
        try:
            m = op.fn(corpus.base_dir(base, refs.cache), rng)
        except NotApplicable as e:
            if e.root is not None:
                shutil.rmtree(e.root, ignore_errors=True)
            continue
        cmd = _command(rng, m, base, refs)
        if cmd is None:
            shutil.rmtree(m.root, ignore_errors=True)
            continue
        try:
            return runner.run_case(m, cmd, base, refs, timeout=timeout)
        except NotApplicable:
            continue
        finally:
            if not keep:
                shutil.rmtree(m.root, ignore_errors=True)
    return None


def _again_alone(r: runner.CaseResult, case: Planned, args: argparse.Namespace, bases: list[Base],
                 refs: runner.Refs) -> runner.CaseResult:  # fmt: skip
    """A case killed at the timeout, run again with nothing else in flight and ``RETRY_FACTOR`` × the
    timeout (the same seed and index give the same mutation and command). Its outcome then stands, with the
    first try's line kept in ``why``; a case still running then is a hang."""
    if r.outcome.kind != "hang":
        return r
    again = run_one(args.seed, case, bases, refs, args.timeout * RETRY_FACTOR, args.keep)
    if again is None:
        return r
    again.index = r.index
    again.outcome.why.append(f"first try, {args.jobs} in flight: {(r.outcome.why or ['hang'])[0]}")
    print(f"{_line(again.index or 0, again)} [second try, alone, limit {args.timeout * RETRY_FACTOR:g}s]",
          flush=True)  # fmt: skip
    return again


# ---- reporting ---------------------------------------------------------------------------------------
def table(results: list[runner.CaseResult]) -> str:
    fams = sorted({r.mutation.family for r in results})
    counts: dict[str, Counter[str]] = {f: Counter(r.outcome.kind for r in results if r.mutation.family == f)
                                       for f in fams}  # fmt: skip
    kinds = [k for k in runner.KINDS if any(c[k] for c in counts.values())]
    rows = [["family", *kinds, "cases"]]
    for f in fams:
        rows.append([f, *(str(counts[f][k] or ".") for k in kinds), str(sum(counts[f].values()))])
    total: Counter[str] = sum(counts.values(), Counter())
    rows.append(["TOTAL", *(str(total[k]) for k in kinds), str(len(results))])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(r: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )

    return "\n".join(line(r) for r in rows)


def report(results: list[runner.CaseResult], args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    by_family: dict[str, Counter[str]] = defaultdict(Counter)
    by_op: dict[str, Counter[str]] = defaultdict(Counter)
    by_command: dict[str, Counter[str]] = defaultdict(Counter)
    for r in results:
        by_family[r.mutation.family][r.outcome.kind] += 1
        by_op[f"{r.mutation.family}/{r.mutation.op}"][r.outcome.kind] += 1
        by_command[r.command if r.mutation.scenario is None else "scenario"][r.outcome.kind] += 1
    failing = [r for r in results if r.outcome.failed]
    return {
        "seed": args.seed, "cases": len(results), "families": args.families, "seconds": round(seconds, 1),
        "zckpt_key": runner.zckpt_key(),
        "counts": {k: dict(v) for k, v in sorted(by_family.items())},
        "by_op": {k: dict(v) for k, v in sorted(by_op.items())},
        "by_command": {k: dict(v) for k, v in sorted(by_command.items())},
        "failures": [r.to_json() for r in failing],
        **({"all_cases": [r.to_json() for r in results]} if args.all_cases else {}),
    }  # fmt: skip


def _line(i: int, r: runner.CaseResult) -> str:
    m = r.mutation
    why = (r.outcome.why or [""])[0][:150]
    return f"[{i:4d}] {r.outcome.kind:15s} {m.family}/{m.op} {m.base} {r.command}: {why}"


# ---- main --------------------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz.suite", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--cases", type=int, default=None)
    ap.add_argument("--families", nargs="+", default=None, choices=sorted(FAMILIES))
    ap.add_argument("--ops", nargs="+", default=None, metavar="MUTATOR",
                    help="only these mutators (see --list), e.g. concurrent-consolidates")  # fmt: skip
    ap.add_argument(
        "--index",
        type=int,
        nargs="+",
        default=None,
        metavar="I",
        help="run only these case indices (as numbered in a report of the same seed/families)",
    )
    ap.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    ap.add_argument(
        "--fast", action="store_true", help=f"the fixed selection: seed {FAST_SEED}, {FAST_CASES} cases"
    )
    ap.add_argument("--jobs", type=int, default=2, help="cases in flight (zckpt processes are capped at 2)")
    ap.add_argument("--timeout", type=float, default=runner.TIMEOUT)
    ap.add_argument("--cache", type=Path, default=corpus.DEFAULT_CACHE)
    ap.add_argument("--keep", action="store_true", help="keep every mutated copy (its path is in the report)")
    ap.add_argument("--all-cases", action="store_true", help="the report lists passing cases too")
    ap.add_argument("--strict", action="store_true", help="exit 1 when any case failed")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per case")
    ap.add_argument("--list", action="store_true", help="list the families and their mutators, then exit")
    ap.add_argument("--dcp", action="store_true", help=f"the DCP families ({', '.join(DCP_FAMILIES)})")
    ap.add_argument(
        "--megatron", action="store_true", help=f"the Megatron families ({', '.join(MEGATRON_FAMILIES)})"
    )
    a = ap.parse_args(argv)
    a.seed = (FAST_SEED if a.fast else 1) if a.seed is None else a.seed
    a.cases = (FAST_CASES if a.fast else 400) if a.cases is None else a.cases
    names = {o.name for ops in FAMILIES.values() for o in ops}
    if a.ops and set(a.ops) - names:
        ap.error(f"unknown mutators {sorted(set(a.ops) - names)}; --list shows them")
    holding = sorted(f for f, ops in FAMILIES.items() if a.ops and {o.name for o in ops} & set(a.ops))
    named = (*DCP_FAMILIES, *MEGATRON_FAMILIES, *SIDE_FAMILIES)
    default = (sorted(DCP_FAMILIES) if a.dcp else sorted(MEGATRON_FAMILIES) if a.megatron
               else sorted(f for f in FAMILIES if f not in named))  # fmt: skip
    a.families = a.families or holding or default
    if a.ops:
        a.families = [f for f in a.families if {o.name for o in FAMILIES[f]} & set(a.ops)]
    return a


def _default_sigint() -> None:
    """A background shell job starts with SIGINT ignored, and ignored signals stay ignored across exec:
    give this process a handler (reset to the default in children) so the ``signals`` family can work."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    _default_sigint()
    if args.list:
        for fam, family_ops in FAMILIES.items():
            print(f"{fam}: " + ", ".join(f"{o.name} [{'/'.join(o.kinds)}]" for o in family_ops))
        return 0
    t0 = time.monotonic()
    bases = corpus.build(args.cache)
    refs = runner.Refs(args.cache, {b.name: b for b in bases})
    mutation.TMP_ROOT = Path(tempfile.mkdtemp(prefix="zckpt-fuzz-run-"))
    results: list[runner.CaseResult] = []
    try:
        with ThreadPoolExecutor(args.jobs) as pool:
            cases = plan(args.cases, args.families, frozenset(args.ops or ()), args.index)
            futures = [
                pool.submit(run_one, args.seed, c, bases, refs, args.timeout, args.keep) for c in cases
            ]
            for i, f in zip(args.index or range(args.cases), futures, strict=True):
                r = f.result()
                if r is None:
                    continue
                r.index = i
                results.append(r)
                if args.verbose or (r.outcome.failed and r.outcome.kind != "hang"):
                    print(_line(i, r), flush=True)
        planned = {c.index: c for c in cases}
        results = [_again_alone(r, planned[r.index or 0], args, bases, refs) for r in results]
    finally:
        if not args.keep:
            shutil.rmtree(mutation.TMP_ROOT, ignore_errors=True)
    seconds = time.monotonic() - t0
    print()
    print(table(results))
    print(f"\n{len(results)} cases, seed {args.seed}, {seconds:.0f}s; "
          f"{sum(r.outcome.failed for r in results)} failing")  # fmt: skip
    if args.report is not None:
        args.report.write_text(json.dumps(report(results, args, seconds), indent=1, default=str))
        print(f"report: {args.report}")
    return 1 if args.strict and any(r.outcome.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
