#!/usr/bin/env python3
"""What a read-time checksum costs: ``zckpt.diff`` of two identical safetensors files that zckpt wrote (each
with its ``.crc32.json`` block sidecar), with the checks (the default), without (``verify_data=False``), and
with the ``.sha256.json`` block sidecars of earlier versions instead (the "before" of issue 42). Warm page
cache; the runs alternate, so machine load falls on all three alike.

    python bench/check_cost.py [--gib 1] [--repeat 5] [--dir DIR] [--torch-threads N] [--json OUT.json]

Prints one ``CHECK ...`` line per variant (median and all runs, seconds; GB/s of the two files' bytes) and
the ratio of checked to unchecked. The page-cache read floor (``cat`` of both files to /dev/null, in the same
run) is printed too: ``of floor`` is that time over the variant's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch

import zckpt
from zckpt.formats.hf import write_safetensors
from zckpt.stream.items import items_from_state_dict


def build(folder: Path, gib: float) -> tuple[Path, Path]:
    """Two identical ~``gib`` GiB fp32 files (64 tensors of a GPT-like mix of sizes), written by zckpt."""
    folder.mkdir(parents=True, exist_ok=True)
    a, b = folder / "a" / "model.safetensors", folder / "b" / "model.safetensors"
    if a.is_file() and b.is_file():
        return a, b
    g = torch.Generator().manual_seed(0)
    numel = int(gib * (1 << 30)) // 4
    sizes = [numel // 48] * 32 + [numel // 96] * 32
    sd = {f"layer{i}.weight": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    items, tied = items_from_state_dict(sd)
    for f in (a, b):
        f.parent.mkdir(exist_ok=True)
        write_safetensors(f, items, tied=tied)
    return a, b


def sha256_sidecars(files: list[Path]) -> None:
    """Replace each file's ``.crc32.json`` by the ``.sha256.json`` an earlier zckpt wrote (same blocks)."""
    for f in files:
        crc = f.with_name(f.name + ".crc32.json")
        doc = json.loads(crc.read_text())
        raw, blk = f.read_bytes(), doc["block"]
        sha = [hashlib.sha256(raw[i : i + blk]).hexdigest() for i in range(0, len(raw), blk)]
        side = {"file": f.name, "size": doc["size"], "block": blk, "sha256": sha}
        f.with_name(f.name + ".sha256.json").write_text(json.dumps(side))
        crc.rename(crc.with_name(crc.name + ".off"))


def crc_sidecars(files: list[Path]) -> None:
    for f in files:
        f.with_name(f.name + ".sha256.json").unlink(missing_ok=True)
        off = f.with_name(f.name + ".crc32.json.off")
        if off.exists():
            off.rename(f.with_name(f.name + ".crc32.json"))


def timed(fn: object) -> float:
    t = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/zckpt-check-cost"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", action="store_true", help="keep the files for another run")
    ap.add_argument("--torch-threads", type=int, help="torch.set_num_threads(N) first")
    args = ap.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    a, b = build(args.dir, args.gib)
    files = [a, b]
    nbytes = sum(f.stat().st_size for f in files)

    def diff(verify: bool) -> None:
        r = zckpt.diff(a, b, verify_data=verify, progress=False)
        assert r.equal, r

    def floor() -> None:
        subprocess.run(["cat", str(a), str(b)], stdout=subprocess.DEVNULL, check=True)

    runs: dict[str, list[float]] = {"floor": [], "unchecked": [], "crc32": [], "sha256 (before)": []}
    diff(True)  # warm the page cache and the code paths
    for _ in range(args.repeat):
        runs["floor"].append(timed(floor))
        crc_sidecars(files)
        runs["unchecked"].append(timed(lambda: diff(False)))
        runs["crc32"].append(timed(lambda: diff(True)))
        sha256_sidecars(files)
        runs["sha256 (before)"].append(timed(lambda: diff(True)))
    crc_sidecars(files)
    med = {k: statistics.median(v) for k, v in runs.items()}
    out = {"bytes": nbytes, "cpus": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads()}
    out |= {"load_avg": os.getloadavg(), "median_s": med, "runs_s": runs}
    for k, v in runs.items():
        print(f"CHECK {k:16s} median {med[k]:.3f} s  {nbytes / med[k] / 1e9:.2f} GB/s  of floor "
              f"{med['floor'] / med[k]:.2f}  runs {' '.join(f'{x:.3f}' for x in v)}")  # fmt: skip
    print(f"CHECK crc32 / unchecked = {med['crc32'] / med['unchecked']:.3f}; "
          f"sha256 / unchecked = {med['sha256 (before)'] / med['unchecked']:.3f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    if not args.keep:
        shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
