#!/usr/bin/env python3
"""``make bench``: zckpt beside DeepSpeed's converters and the copy floor, on the same large inputs.

Builds (or reuses) the inputs of ``bench/make_inputs.py`` under ``bench/data/`` through the dev venv,
then runs every row as its own subprocess, side by side in this one invocation: zckpt consolidate
(fp32/bf16, single/sharded), DeepSpeed ``zero_to_fp32.py`` / ``zero_to_torch.py``, zckpt reshard beside
``ds_to_universal``, zckpt diff and verify, and for each operation the copy floor (``bench/floor.py``:
torch start-up + reading exactly the needed byte ranges + writing the output's byte count, fsynced).

Per row: wall time (best of ``--repeat`` runs; all runs listed), peak RSS of the process tree (the
larger of ``wait4``'s ``ru_maxrss`` and the polled sum of the tree's VmRSS), bytes read/written
(``/proc/self/io`` deltas, which include reaped children: ``rchar``/``wchar`` count read()/write()
syscalls, not mmap faults; ``read_bytes``/``write_bytes`` count storage I/O), and the ratios
floor_time / time ("fraction of floor", target >= 0.7) and time / DeepSpeed's time.

The ``engine`` group needs no inputs: ``bench/engine_bench.py`` under ``torchrun --standalone
--nproc_per_node 2`` on CPU/gloo (``OMP_NUM_THREADS=1``, one rank per core) for plain PyTorch, the engine
and DeepSpeed ZeRO-3 (its own venv's torchrun), at micro-batch 1 and 4, in ``--engine-repeat`` rounds run
round-robin; per config the best (lowest) median step time, tokens/s, peak RSS per rank, the ratios to
DeepSpeed (target <= 0.8; best and per round) and to plain PyTorch, and whether the engine's per-step
losses agree with DeepSpeed's. These rows go into their own table in the same section.

``make bench`` runs the first line below (warm cache, every group), then the cold-cache line.

    .venv/bin/python bench/run.py                      # every group, warm page cache
    .venv/bin/python bench/run.py --cache cold --only consolidate scale --repeat 1 --ds-repeat 1 --no-build
    .venv/bin/python bench/run.py --only consolidate   # groups: consolidate reshard diff verify scale engine
    .venv/bin/python bench/run.py --only engine --no-build --no-record --engine-repeat 1
    .venv/bin/python bench/run.py --only dcp             # 400M FSDP2 DCP: zckpt vs dcp_to_torch_save
    .venv/bin/python bench/run.py --only dcp-items       # ~10k small DCP items: per-item costs
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DATA = HERE / "data"
OUT = DATA / "out"
VPY = str(REPO / ".venv/bin/python")
DSPY = str(REPO / ".venv-ds/bin/python")
ZCKPT = [VPY, "-m", "zckpt.cli.app"]
GROUPS = ("consolidate", "reshard", "diff", "verify", "scale", "engine", "dcp", "dcp-items")
DCP_INPUT = "gpt400m_dcp_w2"
DCP_CKPT = f"{DCP_INPUT}/checkpoint_0"  # accelerate's pair: pytorch_model_fsdp_0/ + optimizer_0/
ITEMS_INPUT = "gpt48l_dcp_w4"  # 48 narrow layers under FSDP2 at world 4: ~10k items of a few KB to 1 MB
ITEMS_CKPT = f"{ITEMS_INPUT}/checkpoint_0"
ENV = dict(os.environ, DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", TOKENIZERS_PARALLELISM="false")
# engine group: CPU/gloo at world 2, one single-threaded rank per core
ENGINE_WORLD, ENGINE_STEPS, ENGINE_WARMUP, ENGINE_MICROS = 2, 10, 2, (1, 4)
ENGINE_ENV = {"OMP_NUM_THREADS": "1"}  # on top of ENV; shown in the recorded commands
PLAIN, ENGINE, DEEPSPEED = "plain PyTorch", "engine ZeRO-3", "DeepSpeed ZeRO-3"

sys.path.insert(0, str(REPO))


# ---- measuring one subprocess ------------------------------------------------------------------------
def _io() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        k, v = line.split(":")
        out[k] = int(v)
    return out


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/children") as f:
                kids.extend(int(c) for c in f.read().split())
    except OSError:
        pass
    return kids


def _tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo.extend(_children(p))
    return seen


def _rss_kb(pid: int, key: str = "VmRSS") -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class Run:
    wall: float
    rss_mb: float
    io: dict[str, int]
    rc: int
    tail: str = ""
    result: dict[str, Any] | None = None  # the last "RESULT {json}" line of the output (engine_bench)
    child_peak_mb: list[float] = field(default_factory=list)  # VmHWM of each direct child (torchrun: ranks)


def measure(cmd: list[str], *, ok_rc: tuple[int, ...] = (0,), env: dict[str, str] | None = None) -> Run:
    before = _io()
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env or ENV, cwd=str(REPO))
    peak_tree = 0
    child_hwm: dict[int, int] = {}
    import threading

    buf: list[bytes] = []
    reader = threading.Thread(target=lambda: buf.append(p.stdout.read()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        peak_tree = max(peak_tree, sum(_rss_kb(q) for q in _tree(p.pid)))
        for q in _children(p.pid):  # the high-water mark is monotonic: the last poll before exit is ~exact
            child_hwm[q] = max(child_hwm.get(q, 0), _rss_kb(q, "VmHWM"))
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    reader.join()
    after = _io()
    rss = max(peak_tree, ru.ru_maxrss) / 1024
    io = {k: after[k] - before[k] for k in ("rchar", "wchar", "read_bytes", "write_bytes")}
    text = b"".join(buf).decode(errors="replace")
    result = None
    for line in text.splitlines():
        if "RESULT {" in line:
            with contextlib.suppress(ValueError):
                result = json.loads(line[line.index("RESULT {") + len("RESULT ") :])
    kids = [v / 1024 for v in child_hwm.values() if v]
    return Run(wall, rss, io, p.returncode, text[-2000:], result, kids)


def files_of(path: Path) -> list[Path]:
    return sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in files_of(path)) if path.exists() else 0


def warm(paths: list[Path]) -> None:
    """Pull the inputs into the page cache (for warm-cache rows)."""
    for p in paths:
        for f in files_of(p):
            with open(f, "rb", buffering=0) as fh:
                while fh.read(64 << 20):
                    pass


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict(paths: list[Path]) -> int:
    """Drop the cached pages of every file under ``paths`` (``posix_fadvise(POSIX_FADV_DONTNEED)``; dirty
    pages are written back first): the next run reads these inputs from the disk while the tools' own files
    (the interpreter, torch's libraries) stay cached, as on a machine that runs Python every day and converts
    a checkpoint written elsewhere. No root needed. Returns the bytes evicted."""
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*"))) if f.is_file()]
    total = 0
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


# ---- rows --------------------------------------------------------------------------------------------
@dataclass
class Row:
    group: str
    name: str
    input: str
    cmd: list[str]
    out: Path | None = None
    floor_of: str | None = None  # the floor row this row is compared with
    ds_of: str | None = None  # the DeepSpeed row this row is compared with
    ok_rc: tuple[int, ...] = (0,)
    keep: bool = False  # keep the output (another row reads it)
    runs: list[Run] = field(default_factory=list)
    out_bytes: int = 0
    note: str = ""
    prepare: Callable[[], None] | None = None  # run before the first measurement (floor plans)
    env: dict[str, str] = field(default_factory=dict)  # extra environment on top of ENV

    def ok(self, run: Run) -> bool:
        return run.rc in self.ok_rc and (self.group != "engine" or run.result is not None)

    @property
    def best(self) -> Run | None:
        """The fastest successful run: lowest wall time, or for engine rows lowest median step time."""
        ok = [r for r in self.runs if self.ok(r)]
        if not ok:
            return None
        return min(ok, key=step_s if self.group == "engine" else (lambda r: r.wall))


def step_s(run: Run) -> float:
    """An engine run's median step time (engine_bench's ``step_s``)."""
    return float(run.result["step_s"]) if run.result else float("inf")


def needed_reads(ckpt_path: Path, *, tag: str | None = None, optim: bool = False) -> list[list[object]]:
    """The byte ranges zckpt needs for the model tensors (and optimizer states): merged, in file order."""
    from zckpt.formats import open_checkpoint

    ck = open_checkpoint(ckpt_path, tag=tag)
    try:
        ents = list(ck.model_entries())
        if optim:
            ents += [ck.entry(k) for k in ck.optim_keys()]
        spans = sorted({(p.file, p.byte_offset, p.nbytes) for e in ents for p in e.pieces if p.value is None})
    finally:
        ck.close()
    merged: list[list[object]] = []
    for f, off, n in spans:
        last = merged[-1] if merged else None
        if last and last[0] == f and int(last[1]) + int(last[2]) >= off:  # type: ignore[call-overload]
            last[2] = max(int(last[1]) + int(last[2]), off + n) - int(last[1])  # type: ignore[call-overload]
        else:
            merged.append([f, off, n])
    return merged


def floor_row(group: str, name: str, inp: str, plan_fn: Callable[[], tuple[list[list[object]], int]]) -> Row:
    """A copy-floor row; its plan (byte ranges to read, bytes to write) is made just before it runs."""
    slug = "".join(c if c.isalnum() else "_" for c in f"{inp}-{name}")
    plan = OUT / f".plan-{slug}.json"
    out = OUT / f"{slug}.bin"

    def prepare() -> None:
        reads, write_bytes = plan_fn()
        plan.write_text(json.dumps({"reads": reads, "write_bytes": write_bytes, "out": str(out)}))

    return Row(group, name, inp, [VPY, str(HERE / "floor.py"), str(plan)], out=out, prepare=prepare)


def is_deepspeed(row: Row) -> bool:
    """A DeepSpeed converter row (run ``--ds-repeat`` times); engine rows all run ``--repeat`` times."""
    return row.cmd[0] == DSPY


def run_row(row: Row, repeat: int, cache: str, inputs: list[Path]) -> None:
    if row.prepare is not None:
        row.prepare()
    for _ in range(repeat):
        if row.out is not None and row.out.exists():
            shutil.rmtree(row.out) if row.out.is_dir() else row.out.unlink()
            for side in row.out.parent.glob(row.out.name + ".*"):
                side.unlink()
        if cache == "cold":
            drop_caches()
        else:
            warm(inputs)
        r = measure(row.cmd, ok_rc=row.ok_rc, env=dict(ENV, **row.env))
        row.runs.append(r)
        if row.out is not None:
            row.out_bytes = size_of(row.out)
        if not row.ok(r):
            what = f"exited {r.rc}" if r.rc not in row.ok_rc else "printed no RESULT line"
            print(f"  !! {row.name} {what}: {r.tail.strip().splitlines()[-3:]}", flush=True)
            break
    if row.out is not None and row.out.exists() and not row.keep:
        shutil.rmtree(row.out) if row.out.is_dir() else row.out.unlink()
        for side in row.out.parent.glob(row.out.name + ".*"):
            side.unlink()


# ---- the plan --------------------------------------------------------------------------------------------
def build_inputs(names: list[str]) -> None:
    """DeepSpeed inputs through the dev venv; the DCP input (FSDP2, torch only) through the main venv."""
    torch_only = {DCP_INPUT, ITEMS_INPUT}
    ds = [n for n in names if n not in torch_only]
    for py, these in ((DSPY, ds), (VPY, [n for n in names if n in torch_only])):
        if these:
            cmd = [py, str(HERE / "make_inputs.py"), "--only", *these]
            subprocess.run(cmd, check=True, env=ENV, cwd=str(REPO))


def plan_rows(groups: set[str], workers: int | None) -> list[Row]:
    w = ["--workers", str(workers)] if workers else []
    rows: list[Row] = []
    z3, z2, z3w4 = DATA / "gpt400m_z3_w2", DATA / "gpt400m_z2_w2", DATA / "gpt400m_z3_w4"
    npy = lambda p: str(p / "zero_to_fp32.py")  # noqa: E731
    if "consolidate" in groups:
        for ck in (z3, z2):
            n = ck.name
            c32 = OUT / f"{n}-fp32.safetensors"
            rows += [
                Row(
                    "consolidate",
                    "zckpt consolidate fp32 single",
                    n,
                    [*ZCKPT, "consolidate", str(ck), str(c32), "--dtype", "fp32", "--no-progress", *w],
                    out=c32,
                    floor_of="floor fp32",
                    ds_of="zero_to_fp32 fp32 .bin",
                    keep=(ck == z3),
                ),
                Row(
                    "consolidate",
                    "zckpt consolidate fp32 2GB shards",
                    n,
                    [
                        *ZCKPT,
                        "consolidate",
                        str(ck),
                        str(OUT / f"{n}-fp32-sh"),
                        "--dtype",
                        "fp32",
                        "--max-shard-size",
                        "2GB",
                        "--no-progress",
                        *w,
                    ],
                    out=OUT / f"{n}-fp32-sh",
                    floor_of="floor fp32",
                    ds_of="zero_to_fp32 fp32 .bin",
                ),
                Row(
                    "consolidate",
                    "zckpt consolidate bf16 single",
                    n,
                    [
                        *ZCKPT,
                        "consolidate",
                        str(ck),
                        str(OUT / f"{n}-bf16.safetensors"),
                        "--dtype",
                        "bf16",
                        "--no-progress",
                        *w,
                    ],
                    out=OUT / f"{n}-bf16.safetensors",
                    floor_of="floor bf16",
                    ds_of="zero_to_torch bf16 .bin",
                ),
                Row(
                    "consolidate",
                    "zero_to_fp32 fp32 .bin",
                    n,
                    [DSPY, npy(ck), str(ck), str(OUT / f"{n}-ds32")],
                    out=OUT / f"{n}-ds32",
                ),
                Row(
                    "consolidate",
                    "zero_to_torch bf16 .bin",
                    n,
                    [
                        DSPY,
                        str(ck / "zero_to_torch.py"),
                        str(ck),
                        str(OUT / f"{n}-dsbf16"),
                        "--dtype",
                        "bf16",
                    ],
                    out=OUT / f"{n}-dsbf16",
                ),
            ]
            if ck == z3:
                rows.append(
                    Row(
                        "consolidate",
                        "zero_to_fp32 fp32 safetensors",
                        n,
                        [DSPY, npy(ck), str(ck), str(OUT / f"{n}-dsst"), "--safe_serialization"],
                        out=OUT / f"{n}-dsst",
                        ok_rc=(0,),
                    )
                )
    if "scale" in groups:
        for n in ("gpt100m_z3_w2", "gpt1b_z3_w2"):  # the 400M point is the consolidate group's
            ck = DATA / n
            if not ck.exists():
                continue
            c = OUT / f"{n}-scale.safetensors"
            rows += [
                Row(
                    "scale",
                    "zckpt consolidate fp32 single",
                    n,
                    [*ZCKPT, "consolidate", str(ck), str(c), "--dtype", "fp32", "--no-progress", *w],
                    out=c,
                    floor_of="floor fp32",
                    ds_of="zero_to_fp32 fp32 .bin",
                ),
                Row(
                    "scale",
                    "zero_to_fp32 fp32 .bin",
                    n,
                    [DSPY, npy(ck), str(ck), str(OUT / f"{n}-ds32")],
                    out=OUT / f"{n}-ds32",
                ),
            ]
    if "reshard" in groups:
        for ck, world in ((z3, 4), (z3w4, 3)):
            n = ck.name
            rows += [
                Row(
                    "reshard",
                    f"zckpt reshard -> w{world}",
                    n,
                    [
                        *ZCKPT,
                        "reshard",
                        str(ck),
                        str(OUT / f"{n}-w{world}"),
                        "--world",
                        str(world),
                        "--no-progress",
                        *w,
                    ],
                    out=OUT / f"{n}-w{world}",
                    floor_of="floor reshard",
                    ds_of="ds_to_universal",
                ),
                Row(
                    "reshard",
                    "ds_to_universal",
                    n,
                    [
                        DSPY,
                        "-m",
                        "deepspeed.checkpoint.ds_to_universal",
                        "--input_folder",
                        str(ck / "global_step1"),
                        "--output_folder",
                        str(OUT / f"{n}-univ"),
                        "--num_extract_workers",
                        "2",
                        "--num_merge_workers",
                        "2",
                    ],
                    out=OUT / f"{n}-univ",
                ),
            ]
        rows.append(
            Row(
                "reshard",
                "zckpt reshard -> native w2",
                z3.name,
                [
                    *ZCKPT,
                    "reshard",
                    str(z3),
                    str(OUT / "native-w2"),
                    "--world",
                    "2",
                    "--to",
                    "native",
                    "--no-progress",
                    *w,
                ],
                out=OUT / "native-w2",
                floor_of="floor reshard",
                keep=True,
            )
        )
        rows.append(
            Row(
                "reshard",
                "zckpt consolidate native fp32",
                "native-w2",
                [
                    *ZCKPT,
                    "consolidate",
                    str(OUT / "native-w2"),
                    str(OUT / "native-fp32.safetensors"),
                    "--dtype",
                    "fp32",
                    "--no-progress",
                    *w,
                ],
                out=OUT / "native-fp32.safetensors",
                floor_of="floor fp32",
            )
        )
    if "diff" in groups:
        c32 = OUT / "gpt400m_z3_w2-fp32.safetensors"
        rows += [
            Row(
                "diff",
                "zckpt diff ckpt vs consolidated",
                z3.name,
                [*ZCKPT, "diff", str(z3), str(c32), "--no-progress"],
                floor_of="floor diff ckpt/consolidated",
            ),
            Row(
                "diff",
                "zckpt diff step1 vs step2",
                z3.name,
                [
                    *ZCKPT,
                    "diff",
                    str(z3),
                    str(z3),
                    "--tag-a",
                    "global_step1",
                    "--tag-b",
                    "global_step2",
                    "--no-progress",
                ],
                ok_rc=(0, 1),
                floor_of="floor diff step1/step2",
            ),
        ]
    if "verify" in groups:
        rows.append(
            Row("verify", "zckpt verify", z3.name, [*ZCKPT, "verify", str(z3)], floor_of="floor verify")
        )
    if "dcp" in groups:
        rows += dcp_rows(w)
    if "dcp-items" in groups:
        rows += dcp_items_rows(w)
    for r in rows:  # DeepSpeed's converters do not fsync: charge them the flush zckpt and the floor pay
        if is_deepspeed(r) and r.group != "engine":
            r.cmd = [DSPY, str(HERE / "then_sync.py"), *r.cmd[1:]]
    if "engine" in groups:
        rows += engine_rows()
    return rows


def dcp_rows(w: list[str]) -> list[Row]:
    """A 400M FSDP2 DCP checkpoint with AdamW state: zckpt beside torch's dcp_to_torch_save and accelerate's
    merge-weights, both of which load every tensor of the folder they are given into memory first. They run on
    the model folder (what they are for: one loadable model); zckpt gets the pair's parent (it reads the
    optimizer folder's metadata too, and writes the model only)."""
    ck = DATA / DCP_CKPT
    model = ck / "pytorch_model_fsdp_0"
    o = lambda s: OUT / f"{DCP_INPUT}-{s}"  # noqa: E731
    zc = [*ZCKPT, "consolidate", str(ck)]
    return [
        Row("dcp", "zckpt consolidate fp32 single", DCP_CKPT,
            [*zc, str(o("fp32.safetensors")), "--dtype", "fp32", "--no-progress", *w],
            out=o("fp32.safetensors"), floor_of="floor fp32", ds_of="dcp_to_torch_save (model)"),
        Row("dcp", "zckpt consolidate bf16 single", DCP_CKPT,
            [*zc, str(o("bf16.safetensors")), "--dtype", "bf16", "--no-progress", *w],
            out=o("bf16.safetensors"), floor_of="floor bf16", ds_of="dcp_to_torch_save (model)"),
        Row("dcp", "dcp_to_torch_save (model)", DCP_CKPT,
            [VPY, str(HERE / "dcp_to_torch_save.py"), str(model), str(o("torch.pt"))], out=o("torch.pt")),
        Row("dcp", "accelerate merge-weights (model)", DCP_CKPT,
            [DSPY, "-m", "accelerate.commands.merge", str(model), str(o("acc"))], out=o("acc")),
        Row("dcp", "zckpt reshard --to dcp w3 (model+optim)", DCP_CKPT,
            [*ZCKPT, "reshard", str(ck), str(o("w3")), "--world", "3", "--to", "dcp", "--no-progress", *w],
            out=o("w3"), floor_of="floor reshard"),
    ]  # fmt: skip


def dcp_items_rows(w: list[str]) -> list[Row]:
    """A DCP checkpoint of many small items (48 layers, FSDP2 world 4, AdamW): what each command costs per
    item (opening ~10k archives and a ~2 MB .metadata), beside torch's dcp_to_torch_save of the model."""
    ck = DATA / ITEMS_CKPT
    o = lambda s: OUT / f"{ITEMS_INPUT}-{s}"  # noqa: E731
    return [
        Row("dcp-items", "zckpt consolidate fp32 single", ITEMS_CKPT,
            [*ZCKPT, "consolidate", str(ck), str(o("fp32.safetensors")), "--dtype", "fp32", "--no-progress",
             *w], out=o("fp32.safetensors"), ds_of="dcp_to_torch_save (model)"),
        Row("dcp-items", "dcp_to_torch_save (model)", ITEMS_CKPT,
            [VPY, str(HERE / "dcp_to_torch_save.py"), str(ck / "pytorch_model_fsdp_0"), str(o("torch.pt"))],
            out=o("torch.pt")),
        Row("dcp-items", "zckpt verify", ITEMS_CKPT, [*ZCKPT, "verify", str(ck), *w]),
        Row("dcp-items", "zckpt reshard --to dcp w8 (model+optim)", ITEMS_CKPT,
            [*ZCKPT, "reshard", str(ck), str(o("w8")), "--world", "8", "--to", "dcp", "--no-progress", *w],
            out=o("w8")),
    ]  # fmt: skip


def engine_rows() -> list[Row]:
    """plain PyTorch, the engine and DeepSpeed ZeRO-3 on the same GPT, config and data, CPU/gloo."""
    rows: list[Row] = []
    for micro in ENGINE_MICROS:
        common = ["--device", "cpu", "--size", "small", "--dtype", "fp32", "--micro", str(micro),
                  "--steps", str(ENGINE_STEPS), "--warmup", str(ENGINE_WARMUP)]  # fmt: skip
        launch = ["--standalone", "--nproc_per_node", str(ENGINE_WORLD), str(HERE / "engine_bench.py")]
        for name, venv, impl in ((PLAIN, ".venv", "plain"), (ENGINE, ".venv", "engine"),
                                 (DEEPSPEED, ".venv-ds", "deepspeed")):  # fmt: skip
            cmd = [str(REPO / venv / "bin/torchrun"), *launch, "--impl", impl, *common]
            rows.append(Row("engine", name, f"GPT small fp32, micro {micro}", cmd, env=dict(ENGINE_ENV)))
    return rows


def add_floors(rows: list[Row]) -> list[Row]:
    """Insert, before the first row needing it, the floor row for each (input, floor) pair."""
    out: list[Row] = []
    done: set[tuple[str, str]] = set()
    for r in rows:
        key = (r.input, r.floor_of or "")
        if r.floor_of and key not in done:
            done.add(key)
            out.append(_floor_for(r))
        out.append(r)
    return out


def _floor_for(r: Row) -> Row:
    inp = OUT / r.input if r.input == "native-w2" else DATA / r.input
    kind = r.floor_of or ""

    def whole_tag(path: Path) -> list[list[object]]:
        tagdir = path / (path / "latest").read_text().strip() if (path / "latest").exists() else path
        return [[str(f), 0, f.stat().st_size] for f in files_of(tagdir)]

    def plan() -> tuple[list[list[object]], int]:
        if kind in ("floor fp32", "floor bf16"):
            reads = needed_reads(inp)
            n = sum(int(x[2]) for x in reads)  # type: ignore[call-overload]
            return reads, n if kind == "floor fp32" else n // 2
        if kind == "floor reshard":
            reads = whole_tag(inp)
            return reads, sum(int(x[2]) for x in reads)  # type: ignore[call-overload]
        if kind == "floor diff ckpt/consolidated":
            return needed_reads(inp) + needed_reads(OUT / "gpt400m_z3_w2-fp32.safetensors"), 0
        if kind == "floor diff step1/step2":
            return needed_reads(inp, tag="global_step1") + needed_reads(inp, tag="global_step2"), 0
        if kind == "floor verify":
            return whole_tag(inp), 0
        raise ValueError(kind)

    return floor_row(r.group, kind, r.input, plan)


# ---- report ------------------------------------------------------------------------------------------
def machine() -> dict[str, str]:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        "?",
    )
    mem = next(
        int(ln.split()[1])
        for ln in Path("/proc/meminfo").read_text().splitlines()
        if ln.startswith("MemTotal")
    )
    du = shutil.disk_usage(DATA)
    dev = subprocess.run(["df", "--output=source", str(DATA)], capture_output=True, text=True).stdout.split()[
        -1
    ]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "zckpt", "engine", "bench", ":!bench/RESULTS.md"],
                           capture_output=True, text=True, cwd=REPO).stdout.strip()  # fmt: skip
    # (RESULTS.md itself is appended by make bench's first section before the second one runs)
    return {
        "cpu": f"{cpu}, nproc {os.cpu_count()}",
        "ram": f"{mem / 2**20:.1f} GiB",
        "disk": f"{dev}, {du.total / 1e9:.0f} GB ({du.free / 1e9:.0f} GB free)",
        "commit": commit.strip() + (" + uncommitted changes in zckpt/, engine/ or bench/" if dirty else ""),
        "python": platform.python_version(),
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def _header(*cols: str) -> list[str]:
    """A markdown table's header and separator lines."""
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def table(rows: list[Row], cache: str) -> str:
    by = {(r.input, r.name): r for r in rows}
    lines = _header(
        "group", "input", "row", "wall s (best)", "runs s", "peak RSS MB", "rchar GB", "wchar GB",
        "read_bytes GB", "write_bytes GB", "out GB", "floor/this", "this/DeepSpeed",
    )  # fmt: skip
    for r in rows:
        b = r.best
        runs = " ".join(f"{x.wall:.1f}" + ("" if x.rc in r.ok_rc else f"(rc{x.rc})") for x in r.runs)
        if b is None:
            lines.append(f"| {r.group} | {r.input} | {r.name} | FAILED | {runs} | | | | | | | | {r.note} |")
            continue
        fl = by.get((r.input, r.floor_of or ""))
        ds = by.get((r.input, r.ds_of or ""))
        frac = f"{fl.best.wall / b.wall:.2f}" if fl and fl.best else ""
        vs = f"{b.wall / ds.best.wall:.2f}" if ds and ds.best else ""
        lines.append(
            f"| {r.group} | {r.input} | {r.name} | {b.wall:.1f} | {runs} | {b.rss_mb:.0f} | "
            f"{_gb(b.io['rchar'])} | {_gb(b.io['wchar'])} | {_gb(b.io['read_bytes'])} | "
            f"{_gb(b.io['write_bytes'])} | {_gb(r.out_bytes) if r.out else ''} | {frac} | {vs} |"
        )
    return "\n".join(lines)


def engine_table(rows: list[Row]) -> tuple[str, list[str]]:
    """The engine rows' table, and one note per config on the engine's and DeepSpeed's losses."""
    by = {(r.input, r.name): r for r in rows}
    lines = _header(
        "config", "impl", "step s (best)", "runs step s", "tokens/s", "peak RSS/rank GiB (max of ranks)",
        "rank 0 RSS GiB (own)", "tree peak RSS GiB", "wall s", "this/DeepSpeed (best)", "this/plain (best)",
        "this/DeepSpeed per round (median)",
    )  # fmt: skip
    for r in rows:
        b = r.best
        runs = " ".join(f"{step_s(x):.3f}" if r.ok(x) else f"(rc{x.rc})" for x in r.runs)
        if b is None or b.result is None:
            lines.append(f"| {r.input} | {r.name} | FAILED | {runs} | | | | | | | | |")
            continue
        ratio = {}
        for other in (DEEPSPEED, PLAIN):
            o = by.get((r.input, other))
            ob = o.best if o is not None and o is not r else None
            ratio[other] = f"{step_s(b) / step_s(ob):.2f}" if ob is not None else ""
        rank = f"{max(b.child_peak_mb) / 1024:.2f}" if b.child_peak_mb else ""
        bold = "**" if r.name == ENGINE else ""
        res = b.result
        lines.append(
            f"| {r.input} | {r.name} | {bold}{step_s(b):.3f}{bold} | {runs} | {res['tokens_per_s']:.0f} | "
            f"{rank} | {res['host_peak_rss_gib']:.2f} | {b.rss_mb / 1024:.2f} | {b.wall:.1f} | "
            f"{ratio[DEEPSPEED]} | {ratio[PLAIN]} | {_per_round(r, by.get((r.input, DEEPSPEED)))} |"
        )
    notes = []
    for inp in dict.fromkeys(r.input for r in rows):
        eng, ds, pl = (by.get((inp, n)) for n in (ENGINE, DEEPSPEED, PLAIN))
        if eng is None or ds is None:
            continue
        el = [x.result["losses"] for x in eng.runs if eng.ok(x) and x.result]
        dl = [x.result["losses"] for x in ds.runs if ds.ok(x) and x.result]
        if not el or not dl:
            continue
        same_len = len({len(x) for x in el + dl}) == 1
        d = max(abs(a - b) for e in el for s in dl for a, b in zip(e, s, strict=False))
        agree = same_len and round(d, 7) <= 1e-5  # printed to 5 decimals: one unit of the last digit
        first = [f"{n} {b.result['losses'][0]:.5f}" for n, x in ((PLAIN, pl), (ENGINE, eng), (DEEPSPEED, ds))
                 if x is not None and (b := x.best) is not None and b.result]  # fmt: skip
        notes.append(
            f"{inp}: per-step losses (rank 0, all {len(el[0])} steps incl. warm-up, every run) of the engine "
            f"and DeepSpeed {'**agree**' if agree else '**DIFFER**'} within engine_bench's printed precision "
            f"(5 decimals; max |Δ| {d:.1e}); "
            f"step-0 loss {', '.join(first)}."
        )
    return "\n".join(lines), notes


def _per_round(r: Row, ds: Row | None) -> str:
    """``r``'s step time over DeepSpeed's in each round (runs paired by index), then their median in bold."""
    if ds is None or ds is r:
        return ""
    pairs = [step_s(a) / step_s(b) for a, b in zip(r.runs, ds.runs, strict=False)
             if r.ok(a) and ds.ok(b) and a.result and b.result]  # fmt: skip
    if not pairs:
        return ""
    return " ".join(f"{x:.2f}" for x in pairs) + f" (**{statistics.median(pairs):.2f}**)"


def record(rows: list[Row], cache: str, args: argparse.Namespace, notes: list[str]) -> str:
    m = machine()
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    files = [r for r in rows if r.group != "engine"]
    eng = [r for r in rows if r.group == "engine"]
    shown = ((r, [*(f"{k}={v}" for k, v in r.env.items()), *map(_rel, r.cmd)]) for r in rows)
    cmds = "\n".join(f"- {r.input} / {r.name}: `{shlex.join(c)}`" for r, c in shown)
    how = ("inputs read into the page cache before every run" if cache == "warm"
           else "caches dropped (sync; drop_caches=3) before every run")  # fmt: skip
    if cache == "warm" and not files:
        how = "the engine rows read no input files"
    text = (
        f"\n## {now} — {cache} page cache — `{shlex.join(['bench/run.py', *sys.argv[1:]])}`\n\n"
        f"Machine: {m['cpu']}; RAM {m['ram']}; disk {m['disk']}; Python {m['python']}; commit {m['commit']}; "
        f"load average at the end {m['load']} (other jobs share the 2 cores, so walls are noisy).\n"
        f"Page cache: **{cache}** ({how})."
    )
    if files:
        text += (
            f" Each zckpt/floor row ran {args.repeat}x, each DeepSpeed row {args.ds_repeat}x; "
            f"wall = best run, all runs listed. floor/this = fraction of the copy floor (target >= 0.7); "
            f"this/DeepSpeed = wall ratio to the matching DeepSpeed tool (target <= 0.5).\n\n"
            + table(files, cache)
            + "\n\n"
        )
    else:
        text += "\n\n"
    if eng:
        res = next((b.result for r in eng if (b := r.best) is not None and b.result), {})
        etab, enotes = engine_table(eng)
        text += (
            f"Engine (`bench/engine_bench.py` under `torchrun --standalone --nproc_per_node {ENGINE_WORLD}`, "
            f"CPU/gloo, `OMP_NUM_THREADS=1`: one rank per core; GPT `small` "
            f"({res.get('params', 0) / 1e6:.1f}M params), fp32, ZeRO-3 for the engine and DeepSpeed, plain = "
            f"each rank trains its own unsharded copy, no communication; same init, optimizer and data; "
            f"{ENGINE_STEPS} timed steps after {ENGINE_WARMUP} warm-up). Each config ran "
            f"{args.engine_repeat} rounds, round-robin (plain, engine, DeepSpeed, then the next round); "
            f"step s = a run's median step time (rank 0), best = lowest over the runs, all runs listed; "
            f"per round = this/DeepSpeed of each round's runs, and their median; "
            f"tokens/s of the best run (micro-batch x 256 tokens x {ENGINE_WORLD} ranks / step); "
            f"peak RSS/rank = the larger of the ranks' VmHWM (polled by run.py), rank 0 (own) = its "
            f"ru_maxrss as engine_bench reports it, tree = the polled peak of the summed VmRSS of torchrun "
            f"and its ranks; "
            f"wall = the whole torchrun command. this/DeepSpeed: target <= 0.8 for the engine.\n\n"
            + etab
            + "\n\n"
            + "".join(f"- {n}\n" for n in enotes)
        )
    text += (
        "".join(f"- {n}\n" for n in notes)
        + "\n<details><summary>Commands (from the repo root)</summary>\n\n"
        + cmds
        + "\n\n</details>\n"
    )
    return text


def _rel(s: str) -> str:
    return s.replace(str(REPO) + "/", "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=GROUPS, default=list(GROUPS))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--ds-repeat", type=int, default=1, help="runs of each DeepSpeed row (they are slow)")
    ap.add_argument("--engine-repeat", type=int, default=3, help="rounds of the engine group's runs")
    ap.add_argument("--cache", choices=("warm", "cold"), default="warm")
    ap.add_argument("--workers", type=int, default=None, help="pass --workers N to zckpt (default: its own)")
    ap.add_argument("--rows", nargs="*", default=None, help="only rows whose name contains one of these")
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to bench/RESULTS.md")
    ap.add_argument("--no-build", action="store_true", help="use only the inputs already built")
    args = ap.parse_args()
    groups = set(args.only)
    notes: list[str] = []
    need = {"gpt400m_z3_w2"} if groups - {"engine"} else set()  # the engine group needs no inputs
    need |= {"gpt400m_z2_w2"} if "consolidate" in groups else set()
    need |= {"gpt400m_z3_w4"} if "reshard" in groups else set()
    need |= {"gpt100m_z3_w2", "gpt1b_z3_w2"} if "scale" in groups else set()
    if "dcp" in groups:
        need = (need if groups - {"engine", "dcp"} else set()) | {DCP_INPUT}
        notes.append(
            "dcp group: this/DeepSpeed is the wall over the row's peer, torch's dcp_to_torch_save on the "
            "model folder (target <= 0.5 with peak RSS <= 512 MB); accelerate merge-weights is the same "
            "torch load, then a safetensors save."
        )
    if "dcp-items" in groups:
        need = (need if groups - {"engine", "dcp-items"} else set()) | {ITEMS_INPUT}
    if not args.no_build and need:
        build_inputs(sorted(need))
    OUT.mkdir(parents=True, exist_ok=True)
    if args.cache == "cold" and not drop_caches():
        notes.append("could not drop caches (not root?): runs are warm after the first")
    rows = plan_rows(groups, args.workers)
    if args.rows:
        rows = [r for r in rows if any(s in r.name for s in args.rows) or r.name.startswith("floor")]
    done: list[Row] = []
    eng_rows = [r for r in rows if r.group == "engine"]
    for k in range(args.engine_repeat if eng_rows else 0):
        # round-robin (plain, engine, DeepSpeed, ... then again): a slow spell of this shared machine hits
        # every implementation of a round alike, so each round's ratios stay meaningful
        for r in eng_rows:
            print(f"[engine round {k + 1}/{args.engine_repeat}] {r.input}: {r.name} ...", flush=True)
            run_row(r, 1, args.cache, [])
            last = r.runs[-1]
            if r.ok(last) and last.result is not None:
                gib = max(last.child_peak_mb or [0]) / 1024
                print(f"    {step_s(last):.3f} s/step  {gib:.2f} GiB/rank", flush=True)
    for r in add_floors([r for r in rows if r.group != "engine"]):
        inputs: list[Path] = []
        if r.group != "engine":
            if not (DATA / r.input).exists() and not (OUT / r.input).exists():
                continue
            inputs = [DATA / r.input if (DATA / r.input).exists() else OUT / r.input]
        if r.group == "diff":
            inputs.append(OUT / "gpt400m_z3_w2-fp32.safetensors")
        print(f"[{r.group}] {r.input}: {r.name} ...", flush=True)
        run_row(r, args.ds_repeat if is_deepspeed(r) else args.repeat, args.cache, inputs)
        b = r.best
        if b is None:
            print("    FAILED", flush=True)
        elif b.result is not None:
            rank, tps = max(b.child_peak_mb or [0]) / 1024, b.result["tokens_per_s"]
            print(f"    {step_s(b):.3f} s/step  {tps:.0f} tokens/s  {rank:.2f} GiB/rank", flush=True)
        else:
            print(f"    {b.wall:.1f}s  {b.rss_mb:.0f} MB", flush=True)
        if b is None and "safetensors" in r.name and "zero_to_fp32" in r.name:
            r.note = "DeepSpeed's safetensors path refuses tied weights (shared tensors)"
        done.append(r)
    text = record(done + eng_rows, args.cache, args, notes)
    print(text)
    if not args.no_record:
        res = HERE / "RESULTS.md"
        if not res.exists():
            res.write_text("# zckpt benchmarks\n\nAppended by `make bench` (`bench/run.py`); newest last.\n")
        with open(res, "a") as f:
            f.write(text)
    for p in OUT.glob(".plan-*"):
        p.unlink()


if __name__ == "__main__":
    main()
