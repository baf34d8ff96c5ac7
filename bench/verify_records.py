#!/usr/bin/env python3
"""``zckpt verify``'s cost per record (issue 42): the same model as a DeepSpeed ZeRO-3 checkpoint at world 2
and at world 8 holds the same bytes in 4x the rank files and zip records; verify should take about as long
(target: world 8 within 1.3x of world 2).

Both inputs are made from one DeepSpeed ZeRO-3 save (default: ``bench/data/gpt100m_z3_w2``, built by
``bench/make_inputs.py``) with ``zckpt reshard --world 2`` / ``--world 8`` and their ``.crc32.json`` sidecars
removed, so every byte is checked through the zip records' CRC-32s, as in a save DeepSpeed wrote. Each
``zckpt verify`` runs as its own process, warm (the files are read once first), ``--repeat`` times,
alternating; per world the best and median wall time and the best run's user+sys CPU time.

    .venv/bin/python bench/verify_records.py                      # into /tmp/zckpt-verify-records
    .venv/bin/python bench/verify_records.py --src bench/data/gpt400m_z3_w2 --out /data/tmp --repeat 5
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _make(src: Path, out: Path, world: int) -> Path:
    dst = out / f"w{world}"
    if not (dst / "latest").is_file():
        argv = ["reshard", str(src), str(dst), "--world", str(world), "--no-progress"]
        subprocess.run([sys.executable, "-m", "zckpt.cli.app", *argv], check=True, env=ENV, cwd=REPO)
    for f in dst.rglob("*.crc32.json"):
        f.unlink()
    for f in dst.rglob("*.pt"):  # warm: in the page cache
        with f.open("rb") as fh:
            while fh.read(64 << 20):
                pass
    return dst


def _verify(ck: Path) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "zckpt.cli.app", "verify", str(ck), "--no-progress"],
                          env=ENV, cwd=REPO, capture_output=True, text=True, check=False)  # fmt: skip
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"verify {ck} failed:\n{done.stdout}{done.stderr}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=REPO / "bench" / "data" / "gpt100m_z3_w2")
    ap.add_argument("--out", type=Path, default=Path("/tmp/zckpt-verify-records"))
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    if not (a.src / "latest").is_file():
        raise SystemExit(f"{a.src}: no DeepSpeed save there; build it with bench/make_inputs.py")
    cks = {w: _make(a.src, a.out, w) for w in (2, 8)}
    runs: dict[int, list[tuple[float, float]]] = {2: [], 8: []}
    for _ in range(a.repeat):
        for w, ck in cks.items():
            runs[w].append(_verify(ck))
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, {a.src.name}")
    for w, rs in runs.items():
        files = sum(1 for _ in cks[w].rglob("*.pt"))
        walls = sorted(r[0] for r in rs)
        med, cpu = statistics.median(walls), min(rs)[1]
        print(f"world {w}: {files:3d} files, best {walls[0]:6.2f} s, median {med:6.2f} s, cpu {cpu:6.2f} s")
    best = {w: min(r[0] for r in rs) for w, rs in runs.items()}
    print(f"world 8 / world 2: {best[8] / best[2]:.2f}x (target <= 1.3x)")


if __name__ == "__main__":
    main()
