"""Time the same zckpt commands under two source trees, interleaved (A B A B ...), for before/after figures
measured in one session on one machine (a tree: a folder holding a ``zckpt`` package, e.g. ``git archive
<commit> zckpt | tar -x -C <folder>``).

    python bench/ab_trees.py --tree old=/path/a --tree new=/path/b --repeat 3 \
        --job "consolidate=consolidate CK OUT.safetensors --dtype fp32 --no-progress --overwrite" \
        --job "verify=verify CK"

``--clean PATH`` removes an output before each run, so that no run pays for replacing the last one's.
``--settle SEC``: ``sync``, then SEC seconds idle before each run (untimed), so that each run finds the disk
rested as the disk probe does, not still busy with the last run's writes.
``--cold``: the page cache is dropped before each run (``sync``, then ``drop_caches``; root only: without it
the bench stops), so that every run reads its inputs, and torch's libraries, from the disk (untimed, like
``--clean``). ``--evict PATH``: only the pages of the files under PATH (the checkpoint) are dropped before
each run (``posix_fadvise(DONTNEED)``, ``bench/run.py``'s ``evict``): a cold checkpoint on a machine whose
Python and torch are cached.

Each line printed: ``AB <job> <tree> run<k> rc=<rc> <wall s> <peak RSS MB>``, then one median line per job
and tree. Each run imports ``zckpt`` from its tree (first on ``sys.path``, ahead of the working folder);
``PYTHONPATH`` keeps what it held after the tree (site packages installed beside it).
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import drop_caches, evict  # noqa: E402  (bench/run.py: the page-cache helpers every bench uses)


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", action="append", required=True, help="NAME=FOLDER")
    ap.add_argument("--job", action="append", required=True, help="NAME=zckpt arguments")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--clean", action="append", default=[], help="a path removed before each run (untimed)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each run (root)")
    ap.add_argument("--settle", type=float, default=0.0, help="sync, then idle SEC before each")
    ap.add_argument("--evict", action="append", default=[], type=Path,
                    help="drop the cached pages of the files under this path before each run")  # fmt: skip
    a = ap.parse_args()
    if a.cold and not drop_caches():
        raise SystemExit("--cold needs root (writing /proc/sys/vm/drop_caches was refused)")
    trees = [t.split("=", 1) for t in a.tree]
    jobs = [j.split("=", 1) for j in a.job]
    walls: dict[tuple[str, str], list[float]] = {}
    base = os.environ.get("PYTHONPATH", "")
    for k in range(a.repeat):
        for jname, args in jobs:
            for tname, folder in trees if k % 2 == 0 else reversed(trees):
                for path in a.clean:
                    remove(path)
                if a.cold:
                    drop_caches()
                if a.evict:
                    evict(a.evict)
                if a.settle:
                    os.sync()
                    time.sleep(a.settle)
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (folder, base) if p))
                run = f"import sys, runpy; sys.path[0] = {os.path.abspath(folder)!r}; "
                run += "runpy.run_module('zckpt.cli.app', run_name='__main__')"  # not the cwd's zckpt
                before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
                t0 = time.perf_counter()
                rc = subprocess.run(
                    [sys.executable, "-c", run, *shlex.split(args)],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    check=False,
                ).returncode
                wall = time.perf_counter() - t0
                peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
                walls.setdefault((jname, tname), []).append(wall)
                rss = f"{peak / 1024:.0f} MB" if peak > before else "-"
                print(f"AB {jname} {tname} run{k + 1} rc={rc} {wall:.2f} s {rss}", flush=True)
    for (jname, tname), w in walls.items():
        print(f"AB-MEDIAN {jname} {tname} {statistics.median(w):.2f} s ({' '.join(f'{x:.2f}' for x in w)})")


if __name__ == "__main__":
    main()
