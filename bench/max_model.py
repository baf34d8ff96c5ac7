#!/usr/bin/env python3
"""The largest GPT one GPU trains with params and optimizer offloaded to host RAM (issue 7, item 4).

Climbs a ladder of model sizes (GPT, d_model ``--embd``, ``n_layer`` from ``--layers``), one fresh process
per attempt (``bench/engine_bench.py --offload --init meta``: nothing is ever materialised whole; the engine
builds on the meta device, DeepSpeed under ``zero.Init``), and stops at the first size that fails. An attempt
fits when it finishes its timed steps; it fails on a CUDA or host out-of-memory error, or when the host's
available memory drops below ``--reserve-gib`` (a watchdog kills the attempt before the kernel's OOM killer
picks a victim), or past ``--timeout`` seconds. Prints one JSON line per attempt and a summary line.

    python bench/max_model.py --impl engine --layers 16 24 32 40
    python bench/max_model.py --impl deepspeed --layers 16 24 32
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


def settle(baseline: float, slack_gib: float = 2.0, limit_s: float = 180.0) -> None:
    """Wait until the host has its memory back from the previous attempt (a killed process's pinned
    pages take a while to be freed), so every attempt starts with the same free RAM."""
    t0 = time.perf_counter()
    while mem_available_gib() < baseline - slack_gib and time.perf_counter() - t0 < limit_s:
        time.sleep(1)


def attempt(impl: str, layers: int, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
        str(HERE / "engine_bench.py"), "--impl", impl, "--size", "355m", "--layers", str(layers),
        "--embd", str(args.embd), "--dtype", "bf16", "--offload", "--init", "meta",
        "--micro", str(args.micro), "--steps", str(args.steps), "--warmup", "1",
    ]  # fmt: skip
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    start_avail = min_avail = mem_available_gib()
    why = ""
    out: list[bytes] = []
    os.set_blocking(p.stdout.fileno(), False)  # type: ignore[union-attr]
    while p.poll() is None:
        chunk = p.stdout.read()  # type: ignore[union-attr]
        if chunk:
            out.append(chunk)
        avail = mem_available_gib()
        min_avail = min(min_avail, avail)
        if avail < args.reserve_gib:
            why = f"host RAM exhausted (MemAvailable {avail:.1f} GiB)"
        elif time.perf_counter() - t0 > args.timeout:
            why = f"timeout after {args.timeout} s"
        if why:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            break
        time.sleep(0.2)
    rest = p.stdout.read()  # type: ignore[union-attr]
    if rest:
        out.append(rest)
    text = b"".join(out).decode(errors="replace")
    result = next((json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")), None)
    if result is None and not why:
        oom = [ln for ln in text.splitlines() if "OutOfMemory" in ln or "out of memory" in ln.lower()]
        errs = [ln.strip() for ln in text.splitlines() if "Error" in ln and "elastic" not in ln]
        why = oom[-1].strip()[-200:] if oom else f"exit {p.returncode}: " + " | ".join(errs[-3:])[-600:]
    rec = {
        "impl": impl, "layers": layers, "embd": args.embd, "fits": result is not None,
        "params": result["params"] if result else None, "wall_s": round(time.perf_counter() - t0, 1),
        "start_host_available_gib": round(start_avail, 1), "min_host_available_gib": round(min_avail, 1),
        "why": why or None,
    }  # fmt: skip
    if result:
        rec.update(
            {k: result[k] for k in ("step_s", "tokens_per_s", "gpu_peak_gib", "host_peak_rss_gib", "losses")}
        )
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=["engine", "deepspeed"], required=True)
    ap.add_argument(
        "--layers", type=int, nargs="+", required=True, help="ladder of n_layer values, ascending"
    )
    ap.add_argument("--embd", type=int, default=4096)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--reserve-gib", type=float, default=3.0)
    args = ap.parse_args()
    largest = None
    baseline = mem_available_gib()
    for layers in args.layers:
        settle(baseline)
        rec = attempt(args.impl, layers, args)
        print(json.dumps(rec), flush=True)
        if not rec["fits"]:
            break
        largest = rec
    summary = {
        "impl": args.impl,
        "largest_params": largest["params"] if largest else None,
        "largest_layers": largest["layers"] if largest else None,
        "host_ram_gib": round(_total_gib(), 1),
    }
    print("SUMMARY " + json.dumps(summary), flush=True)


def _total_gib() -> float:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) / 2**20


if __name__ == "__main__":
    main()
