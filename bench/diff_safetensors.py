#!/usr/bin/env python3
"""``zckpt diff`` of two ~1 GB safetensors files, warm, as the command line runs it (issue 42: compared in
numpy, torch never imported), against another tree of the project (``--before``: the torch comparison).

Pairs (made once under ``--dir``): A (16 fp32 tensors of 16 Mi elements, 1 GiB) against a copy of itself
(every chunk bit-identical: the fast path), against A plus noise on every element (every chunk compared in
float64), and against A stored in bf16 (A cast to bf16 as stored in B). Each command runs ``--repeat`` times
as its own process, after one run that warms the page cache; per row the best and median wall time, the
best run's user+sys CPU time and the 1-minute load average before the row.

    .venv/bin/python bench/diff_safetensors.py --before ../main        # this tree against main's
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
N, COUNT = 16 << 20, 16


def _make(d: Path) -> None:
    import torch
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    if (d / "c.safetensors").exists():
        return
    g = torch.Generator().manual_seed(0)
    a = {f"layer{i}.weight": torch.randn(N, generator=g) for i in range(COUNT)}
    save_file(a, str(d / "a.safetensors"))
    shutil.copyfile(d / "a.safetensors", d / "a2.safetensors")
    save_file({k: v + 1e-3 * torch.randn(N, generator=g) for k, v in a.items()}, str(d / "b.safetensors"))
    save_file({k: v.bfloat16() for k, v in a.items()}, str(d / "c.safetensors"))


def _run(tree: Path, argv: list[str]) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "zckpt.cli.app", *argv], stdout=subprocess.DEVNULL, env=env,
                          cwd=tree, check=False)  # fmt: skip
    wall = time.perf_counter() - t
    assert done.returncode in (0, 1), done.returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/zckpt-bench-diff"))
    ap.add_argument("--before", type=Path, help="another checkout of the project, run the same way")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    _make(a.dir)
    trees = [("this tree", REPO)] + ([("before", a.before.resolve())] if a.before else [])
    print(f"{os.cpu_count()} cores, {a.dir}")
    for other, what in (("a2", "equal"), ("b", "differs everywhere"), ("c", "fp32 vs bf16")):
        argv = ["diff", str(a.dir / "a.safetensors"), str(a.dir / f"{other}.safetensors"), "--no-progress"]
        for name, tree in trees:
            load = os.getloadavg()[0]
            _run(tree, argv)
            runs = [_run(tree, argv) for _ in range(a.repeat)]
            walls = sorted(w for w, _ in runs)
            print(f"{what:<20} {name:<10} best {walls[0]:6.2f} s  median {statistics.median(walls):6.2f} s  "
                  f"cpu(best) {min(runs)[1]:6.2f} s  load {load:4.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
