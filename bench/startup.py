#!/usr/bin/env python3
"""Start-up of the metadata commands (issue 42): ``zckpt inspect`` and ``zckpt verify`` of a small checkpoint,
warm, against the interpreter's own start-up and ``import torch``, which they no longer pay.

Each command runs ``--repeat`` times as its own process (``python -m zckpt.cli.app``, and the venv's
``zckpt`` console script where there is one: pip's generated script, ``zckpt.cli.main``); per row the best
and median wall time and the best run's user+sys CPU time (less sensitive than wall time to other work on a
shared machine), and the 1-minute load average before the row. The children run without
``PYTHONDONTWRITEBYTECODE`` (a user's second run reads the bytecode its first wrote; with it set, every
run compiles zckpt again: ~0.1 s more). The "first run" row gives each run an empty
``PYTHONPYCACHEPREFIX``: nothing cached, the standard library included (an upper bound on the first run of
a fresh ``make setup``, whose venv is installed ``--no-compile``). Then the ``-X importtime`` of one
``inspect`` run, its heaviest top-level imports first, and whether torch was among them. Target: inspect
and verify <= 0.3 s on the 2-core machine.

    .venv/bin/python bench/startup.py                       # fixtures/ds/s3_bf16_w2_g2, 10 runs each
    .venv/bin/python bench/startup.py --ckpt PATH --repeat 20
    .venv/bin/python bench/startup.py --tree ../main         # another checkout's code, measured the same way

A row for ``zckpt diff`` of two small safetensors files (compared in numpy, no torch) follows the two
metadata commands.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMALL = REPO / "fixtures" / "ds" / "s3_bf16_w2_g2"
ST = REPO / "fixtures" / "dcp" / "fsdp2_w2" / "ref_model.safetensors"
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PYTHONPATH": str(REPO)}


def _run(argv: list[str], cold: bool = False) -> tuple[float, float]:
    """(wall, user+sys CPU) of one process (``cold``: with no bytecode cached)."""
    with tempfile.TemporaryDirectory(prefix="zckpt-pycache-") as cache:
        env = {**ENV, "PYTHONPYCACHEPREFIX": cache} if cold else ENV
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, cwd=ENV["PYTHONPATH"], env=env)
        wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _row(name: str, argv: list[str], repeat: int, cold: bool = False) -> None:
    load = os.getloadavg()[0]
    _run(argv)  # bytecode written (the user's first run), page cache warm
    runs = [_run(argv, cold) for _ in range(repeat)]
    walls = sorted(w for w, _ in runs)
    best = min(runs)
    print(f"{name:<34} best {walls[0]:6.3f} s  median {statistics.median(walls):6.3f} s  "
          f"cpu(best) {best[1]:6.3f} s  load {load:4.2f}")  # fmt: skip


def _importtime(argv: list[str], top: int) -> None:
    done = subprocess.run([sys.executable, "-X", "importtime", *argv[1:]], capture_output=True, text=True,
                          cwd=ENV["PYTHONPATH"], env=ENV, check=True)  # fmt: skip
    rows = []
    for line in done.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)", line)
        if m and len(m.group(3)) <= 1:  # imported by the program itself, not by another module
            rows.append((int(m.group(2)), m.group(4)))
    total = sum(c for c, _ in rows)
    print(f"\n-X importtime of inspect: {total / 1e6:.3f} s in top-level imports; heaviest:")
    for c, name in sorted(rows, reverse=True)[:top]:
        print(f"  {c / 1e6:6.3f} s  {name}")
    torch = any(re.search(r"\| +torch$", x) for x in done.stderr.splitlines())
    print(f"torch imported: {torch}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, default=SMALL)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--tree", type=Path, default=REPO, help="the checkout whose zckpt runs (default: this)")
    a = ap.parse_args()
    ENV["PYTHONPATH"] = str(a.tree.resolve())
    py = sys.executable
    zckpt = [py, "-m", "zckpt.cli.app"]
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, {a.ckpt}, zckpt from {a.tree}")
    _row("python -c pass", [py, "-c", "pass"], a.repeat)
    _row("python -c 'import torch'", [py, "-c", "import torch"], max(1, a.repeat // 5))
    _row("zckpt inspect", [*zckpt, "inspect", str(a.ckpt)], a.repeat)
    _row("zckpt verify", [*zckpt, "verify", str(a.ckpt), "--no-progress"], a.repeat)
    _row("zckpt diff (2 safetensors)", [*zckpt, "diff", str(ST), str(ST), "--no-progress"], a.repeat)
    script = Path(py).parent / "zckpt"
    if script.exists():  # pip's console script (zckpt.cli.main), as a user runs it
        _row("zckpt inspect (console script)", [str(script), "inspect", str(a.ckpt)], a.repeat)
        _row("zckpt verify (console script)", [str(script), "verify", str(a.ckpt), "--no-progress"], a.repeat)
    _row("zckpt inspect, first run", [*zckpt, "inspect", str(a.ckpt)], max(1, a.repeat // 5), cold=True)
    _importtime([*zckpt, "inspect", str(a.ckpt)], a.top)


if __name__ == "__main__":
    main()
