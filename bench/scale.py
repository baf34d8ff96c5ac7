#!/usr/bin/env python3
"""Issue 22's scale benchmark on the lent GPU host: every command on a >= 1.5B real DeepSpeed ZeRO-3
checkpoint (world 1 as saved, world 8 after ``zckpt reshard``) and a DCP copy, against its floor and its
peer, in one call beside the disk probe.

    bash bench/gpu_scale.sh                     # on the GPU host (sets up wheels, then runs this)
    python bench/scale.py --dir /root/scale --out $OUT [--parts probe,make,w1,w8,dcp] [--repeat 3]
        [--cores 16] [--cores-scan 1,4] [--cold] [--cold-inputs 2] [--profile 'consolidate fp32,verify']
        [--peers]

Parts, in order (each reuses what an earlier call left in ``--dir`` when the machine stayed warm):
``probe`` (``bench/disk_probe.py``: O_DIRECT write/read GB/s, sha256 GB/s), ``make`` (a real DeepSpeed 0.19.8
ZeRO-3 bf16 save of GPT 1.5B, client AdamW, world 1, through ``bench/ckpt_bench.py --save-only``), ``w1``
(jobs on it), ``w8`` (``zckpt reshard --world 8`` timed as the reshard row, then jobs on the copy), ``dcp``
(``zckpt reshard --to dcp`` of the world-8 copy, then jobs on it; ``drop-w1`` deletes the world-1 save first,
``keep-w8`` keeps the world-8 copy). The jobs: consolidate ``--dtype fp32`` and
default dtype, ``verify``, ``diff`` of the checkpoint against its fp32 consolidation, and with ``--peers``
DeepSpeed's ``zero_to_fp32.py`` (+ ``sync``) and torch's ``dcp_to_torch_save`` (fsynced).

Each job runs ``--repeat`` times on a warm page cache (its inputs read once first; the median is the
figure), then once after ``drop_caches`` with ``--cold`` (torch's libraries are read from the disk too), and
``--cold-inputs N`` times with only the job's inputs evicted (``bench/run.py``'s ``evict``: a cold checkpoint,
the tools cached; cache ``cold-inputs`` in the table). ``--cores N`` pins every command to cores
``0..N-1`` (``taskset``); ``--cores-scan 1,4`` repeats the consolidate and verify jobs at those counts.
``--settle SEC``: ``sync``, then SEC seconds idle before the probe and before every timed run, so that each
run finds the disk as the probe did (not still writing back the last run's output).
Floor: the bytes the job must write at the probe's write speed; cold (or a job that writes nothing), the
larger of that and the bytes it must read at the read speed (overlapped); cold, a job that reads and
writes is also held to its read plus written bytes at the concurrent probe's speed (``rw_gbs``), where that
is larger (``job_floor``); ``of_floor`` = floor / wall. Peak RSS: the process tree's
(``bench/run.py``'s ``measure``). ``--profile`` runs the named jobs once more under ``py-spy record``
(raw folded stacks, idle threads included) into ``--out``.

Before the first timed run every package a command imports is byte-compiled, as ``pip install`` does for a
user (the host's image forbids writing bytecode; ``_uncompiled_sources``).

One ``SCALE {json}`` line per run, a ``SCALESUM`` line per job, and ``scale.md`` (the table) in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run import drop_caches, evict, measure, size_of, warm  # noqa: E402

PY = sys.executable
ZCKPT = [PY, "-m", "zckpt.cli.app"]
PYSPY = next(
    (str(p) for p in (Path(sys.executable).parent / "py-spy", Path("/tmp/site/bin/py-spy")) if p.exists()),
    shutil.which("py-spy") or "py-spy",
)


@dataclass
class Job:
    name: str
    input: str
    cmd: list[str]
    inputs: list[Path]
    out: Path | None = None
    in_bytes: int = 0  # what the job must read (0: measured from ``inputs`` after the first run)
    out_bytes: int | None = None  # what it must write (None: the output's size)
    ok_rc: tuple[int, ...] = (0,)
    keep: bool = False
    peer: bool = False  # a peer tool: warm runs only, ``--peer-repeat`` of them
    walls: list[float] = field(default_factory=list)
    rss: list[float] = field(default_factory=list)


@dataclass
class Ctx:
    args: argparse.Namespace
    probe: dict[str, float]
    rows: list[dict] = field(default_factory=list)


def tail_dir(d: Path) -> Path:
    latest = d / "latest"
    return d / latest.read_text().strip() if latest.exists() else d


def masters_bytes(ck: Path) -> int:
    """fp32 masters a ZeRO checkpoint holds: 4 bytes per param (params counted by ``zckpt inspect``)."""
    r = subprocess.run([*ZCKPT, "inspect", str(ck), "--json"], capture_output=True, text=True, check=True)
    info = json.loads(r.stdout)
    n = (
        info.get("num_params")
        or info.get("params")
        or sum(t.get("numel", 0) for t in info.get("tensors", []) if t.get("role", "param") == "param")
    )
    return 4 * int(n)


def env_for(cores: int) -> dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cuda", TOKENIZERS_PARALLELISM="false")


def pinned(cmd: list[str], cores: int) -> list[str]:
    return ["taskset", "-c", f"0-{cores - 1}", *cmd] if cores < (os.cpu_count() or 1) else cmd


def job_floor(probe: dict[str, float], cache: str, in_b: int, out_b: int) -> float:
    """The larger of the floors that apply: the reads at the read speed (cold, or a job that only reads),
    the writes at the write speed (overlapped); cold, also the reads and writes together at the concurrent
    probe's speed (``rw_gbs``: on a disk whose reads and writes share its bandwidth, the larger one). Warm
    reads come from the page cache (issue 42: "a warm job pays its writes at the probe's write speed"), and
    a job that only reads or only writes shares the disk with nothing: the concurrent floor is for a cold
    job that does both."""
    cold = cache.startswith("cold")
    reads = in_b / (probe["read_gbs"] * 1e9) if cold or not out_b else 0.0  # a warm writer reads the cache
    floor = max(reads, out_b / (probe["write_gbs"] * 1e9))
    if cold and in_b and out_b and probe.get("rw_gbs"):
        floor = max(floor, (in_b + out_b) / (probe["rw_gbs"] * 1e9))
    return floor


def run_job(ctx: Ctx, job: Job, cores: int, cache: str, n: int) -> None:
    a = ctx.args
    res = []
    for i in range(n):
        if a.settle:  # the disk as the probe finds it: the last run's writes on the disk, then idle
            os.sync()
            time.sleep(a.settle)
        if job.out is not None:
            shutil.rmtree(job.out, ignore_errors=True) if job.out.is_dir() else job.out.unlink(
                missing_ok=True
            )
        if cache == "cold":
            drop_caches()
        elif cache == "cold-inputs":
            evict(job.inputs)
        elif i == 0:  # the page cache (125 GB here) keeps the inputs between the runs of one job
            warm(job.inputs)
        r = measure(pinned(job.cmd, cores), ok_rc=job.ok_rc, env=env_for(cores))
        out_b = size_of(job.out) if job.out is not None else 0
        rec = {
            "job": job.name,
            "input": job.input,
            "cores": cores,
            "cache": cache,
            "run": i,
            "wall_s": round(r.wall, 3),
            "rss_mb": round(r.rss_mb),
            "rc": r.rc,
            "out_gb": out_b / 1e9,
            "io": r.io,
        }
        print("SCALE " + json.dumps(rec), flush=True)
        if r.rc not in job.ok_rc:
            print(r.tail, flush=True)
        res.append((r, out_b))
    ok = [(r, b) for r, b in res if r.rc in job.ok_rc]
    if not ok:
        return
    wall = statistics.median(r.wall for r, _ in ok)
    out_b = job.out_bytes if job.out_bytes is not None else ok[-1][1]
    in_b = job.in_bytes or sum(size_of(p) for p in job.inputs)
    floor = job_floor(ctx.probe, cache, in_b, out_b)
    row = {
        "job": job.name,
        "input": job.input,
        "cores": cores,
        "cache": cache,
        "runs": [round(r.wall, 2) for r, _ in ok],
        "wall_s": round(wall, 2),
        "rss_mb": round(max(r.rss_mb for r, _ in ok)),
        "in_gb": round(in_b / 1e9, 2),
        "out_gb": round(out_b / 1e9, 2),
        "floor_s": round(floor, 2),
        "of_floor": round(floor / wall, 2),
    }
    print("SCALESUM " + json.dumps(row), flush=True)
    ctx.rows.append(row)
    (Path(a.out) / "scale.json").write_text(json.dumps({"probe": ctx.probe, "rows": ctx.rows}, indent=1))


def profile(ctx: Ctx, job: Job) -> None:
    if job.out is not None:
        shutil.rmtree(job.out, ignore_errors=True) if job.out.is_dir() else job.out.unlink(missing_ok=True)
    warm(job.inputs)
    name = "".join(c if c.isalnum() else "-" for c in f"{job.input}-{job.name}")
    dest = Path(ctx.args.out) / f"prof-{name}.txt"
    t0 = time.perf_counter()
    subprocess.run(
        [PYSPY, "record", "-r", "50", "--idle", "-t", "-f", "raw", "-o", str(dest), "--", *job.cmd],
        env=env_for(16),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        check=False,
    )
    print(f"PROFILE {name}: {time.perf_counter() - t0:.1f} s -> {dest.name}", flush=True)


def jobs_for(ctx: Ctx, ck: Path, label: str, ds_script: Path | None) -> list[Job]:
    a, d = ctx.args, Path(ctx.args.dir)
    mb = masters_bytes(ck)
    c32 = d / f"{label}-fp32.safetensors"
    jobs = [
        Job(
            "consolidate fp32",
            label,
            [*ZCKPT, "consolidate", str(ck), str(c32), "--dtype", "fp32", "--no-progress"],
            [ck],
            c32,
            in_bytes=mb,
            keep=True,
        ),
        Job(
            "consolidate default",
            label,
            [*ZCKPT, "consolidate", str(ck), str(d / f"{label}-def.safetensors"), "--no-progress"],
            [ck],
            d / f"{label}-def.safetensors",
            in_bytes=mb,
        ),
        Job("verify", label, [*ZCKPT, "verify", str(ck)], [ck], out_bytes=0),
        Job(
            "diff vs fp32 consolidation",
            label,
            [*ZCKPT, "diff", str(ck), str(c32), "--no-progress"],
            [ck, c32],
            in_bytes=2 * mb,
            out_bytes=0,
            ok_rc=(0, 1),
        ),
    ]
    if a.peers and ds_script is not None:
        jobs.append(
            Job(
                "zero_to_fp32 + sync",
                label,
                [PY, str(HERE / "then_sync.py"), str(ds_script), str(ck), str(d / f"{label}-z2f")],
                [ck],
                d / f"{label}-z2f",
                in_bytes=mb,
                peer=True,
            )
        )
    if a.peers and label == "dcp":
        jobs.append(
            Job(
                "dcp_to_torch_save",
                label,
                [PY, str(HERE / "dcp_to_torch_save.py"), str(ck), str(d / "dcp-torch.pt")],
                [ck],
                d / "dcp-torch.pt",
                in_bytes=mb,
                peer=True,
            )
        )
    return jobs


def run_set(ctx: Ctx, jobs: list[Job]) -> None:
    a = ctx.args
    jobs = [j for j in jobs if not a.only_jobs or j.name in a.only_jobs]
    for job in jobs:
        run_job(ctx, job, a.cores, "warm", a.peer_repeat if job.peer else a.repeat)
        if a.cold and not job.peer:
            run_job(ctx, job, a.cores, "cold", 1)
        if a.cold_inputs and not job.peer:
            run_job(ctx, job, a.cores, "cold-inputs", a.cold_inputs)
        if job.name in ("consolidate fp32", "verify") and job.input in a.scan_inputs:
            for c in a.cores_scan:
                run_job(ctx, job, c, "warm", 1)
        if job.name in a.profile:
            profile(ctx, job)
    for job in jobs:
        if job.out is not None and job.out.exists():
            shutil.rmtree(job.out) if job.out.is_dir() else job.out.unlink()
        for side in job.out.parent.glob(job.out.name + ".*") if job.out is not None else []:
            side.unlink()


def reshard_job(src: Path, dst: Path, label: str, extra: list[str]) -> Job:
    return Job(
        f"reshard {' '.join(extra)}".strip(),
        label,
        [*ZCKPT, "reshard", str(src), str(dst), *extra, "--no-progress"],
        [src],
        dst,
    )


_PACKAGES = """
import importlib, os, sys, sysconfig
import numpy, safetensors, torch, tqdm, zckpt.cli.app
for optional in ("isal", "rich", "typer._adapters"):  # typer imports _adapters (pydantic) to parse options
    try:
        importlib.import_module(optional)
    except ImportError:
        pass
stdlib = sysconfig.get_paths()["stdlib"]
found = set()
for name in list(sys.modules):
    top = sys.modules.get(name.split(".")[0])
    where = (list(getattr(top, "__path__", None) or []) or [getattr(top, "__file__", None) or ""])[0]
    if where and not where.startswith(stdlib):
        found.add(where)
found.update(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.path.isdir(p))
print(*sorted(found), sep="\\n")
"""
"""Run in a fresh interpreter: prints the folder (or file) of every top-level package a command's process
imports, outside the standard library, and every ``PYTHONPATH`` folder."""


def _uncompiled_sources() -> list[str]:
    """What to byte-compile before any timed run: an installed package has its bytecode compiled at install
    time, but this host's image ships torch without it and sets ``PYTHONDONTWRITEBYTECODE=1``, the wheels
    ``gpu_env.sh`` adds are installed ``--no-compile``, and a fresh copy of the repo has none, so every start
    compiled what it imported from source (~2.4 s of torch's in the H200 profile; typer's pydantic, a
    ``PYTHONPATH`` wheel, was missed until 2026-12-05). Every package a command's process imports (torch's,
    the command line's, typer's lazily imported pydantic) and every ``PYTHONPATH`` folder but the repo's."""
    got = subprocess.run([PY, "-c", _PACKAGES], capture_output=True, text=True, check=False).stdout
    repo = HERE.parent.resolve()
    return [d for d in got.splitlines() if d and Path(d).resolve() != repo]  # the repo: its zckpt/ only


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--parts", default="probe,make,w1,w8,dcp")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--cores-scan", type=lambda v: [int(x) for x in v.split(",") if x], default=[])
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--cold-inputs", type=int, default=0, metavar="N",
                    help="also N runs with only the job's inputs evicted from the page cache")  # fmt: skip
    ap.add_argument("--peer-repeat", type=int, default=1)
    ap.add_argument(
        "--only-jobs",
        type=lambda v: [x.strip() for x in v.split(",") if x.strip()],
        default=[],
        help="run only these jobs (names as in the table) on each input",
    )
    ap.add_argument(
        "--scan-inputs",
        type=lambda v: v.split(","),
        default=["ds-w8"],
        help="inputs whose consolidate fp32 and verify also run at each --cores-scan count",
    )
    ap.add_argument("--reshard-repeat", type=int, default=0, help="runs of the reshard rows (0: --repeat)")
    ap.add_argument("--peers", action="store_true")
    ap.add_argument(
        "--settle", type=float, default=0.0, help="sync, then idle SEC before the probe and each run"
    )
    ap.add_argument("--profile", type=lambda v: [x.strip() for x in v.split(",") if x.strip()], default=[])
    ap.add_argument("--size", default="1.5b")
    ap.add_argument("--micro", type=int, default=4, help="micro-batch of the run that makes the save")
    a = ap.parse_args()
    parts = a.parts.split(",")
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    pj = d / "probe.json"
    if "probe" in parts or not pj.exists():
        if a.settle:
            os.sync()
            time.sleep(a.settle)
        subprocess.run(
            [PY, str(HERE / "disk_probe.py"), str(d / "probe"), "--depths", "1", "--json", str(pj)],
            check=True,
        )
    ctx = Ctx(a, json.loads(pj.read_text()))
    dirs = _uncompiled_sources()
    t0 = time.perf_counter()
    subprocess.run(
        [PY, "-m", "compileall", "-q", "-j", "0", str(HERE.parent / "zckpt"), *dirs],
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    print(
        f"compileall: {time.perf_counter() - t0:.1f} s; "
        f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE')}",
        flush=True,
    )
    t0 = time.perf_counter()
    subprocess.run([*ZCKPT, "--help"], check=True, stdout=subprocess.DEVNULL)
    print(f"START-UP zckpt --help: {time.perf_counter() - t0:.2f} s", flush=True)
    ds1, w8, dcp = d / "ds-w1", d / "ds-w8", d / "dcp"
    if "make" in parts and not (ds1 / "latest").exists():
        t0 = time.perf_counter()
        subprocess.run(
            [
                PY,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "1",
                str(HERE / "ckpt_bench.py"),
                "--impl",
                "deepspeed",
                "--size",
                a.size,
                "--micro",
                str(a.micro),
                "--steps",
                "2",
                "--save-only",
                "--dir",
                str(ds1),
            ],
            check=True,
            env=dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1"),
        )
        print(f"MADE {ds1}: {size_of(ds1) / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", flush=True)
    script = ds1 / "zero_to_fp32.py"
    if "w1" in parts:
        run_set(ctx, jobs_for(ctx, ds1, "ds-w1", script))
    if "w8" in parts:
        if not (w8 / "latest").exists():
            job = reshard_job(ds1, w8, "ds-w1", ["--world", "8"])
            run_job(
                ctx, job, a.cores, "warm", max(1, a.reshard_repeat or a.repeat)
            )  # the last run's output stays: the world-8 copy
            if "reshard --world 8" in a.profile:
                profile(ctx, job)  # its output stays too
        run_set(ctx, jobs_for(ctx, w8, "ds-w8", script))
    if "dcp" in parts:
        src = w8 if (w8 / "latest").exists() else ds1
        if not (dcp / ".metadata").exists():
            job = reshard_job(src, dcp, src.name, ["--world", "8", "--to", "dcp"])
            run_job(ctx, job, a.cores, "warm", max(1, a.reshard_repeat or a.repeat))  # the last output stays
            if job.name in a.profile:
                profile(ctx, job)  # its output stays: the DCP copy
        if "keep-w8" not in parts:
            shutil.rmtree(w8, ignore_errors=True)
        if "drop-w1" in parts:  # the 64 GB disk: the DCP copy, its fp32 consolidation and torch's .pt
            shutil.rmtree(ds1, ignore_errors=True)
        run_set(ctx, jobs_for(ctx, dcp, "dcp", None))
    lines = [
        "| job | input | cores | cache | wall s (median) | runs | peak RSS MB | in GB | out GB | floor s "
        "| of floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ctx.rows:
        lines.append(
            f"| {r['job']} | {r['input']} | {r['cores']} | {r['cache']} | {r['wall_s']} | "
            f"{' '.join(map(str, r['runs']))} | {r['rss_mb']} | {r['in_gb']} | {r['out_gb']} | "
            f"{r['floor_s']} | {r['of_floor']} |"
        )
    table = "\n".join(lines)
    print(f"probe: {ctx.probe}\n{table}", flush=True)
    (Path(a.out) / "scale.md").write_text(f"probe: {json.dumps(ctx.probe)}\n\n{table}\n")


if __name__ == "__main__":
    main()
