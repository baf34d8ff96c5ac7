#!/usr/bin/env python3
"""Issue 18's overhead check: ``zckpt diff A B`` against ``zckpt diff A B --plot FILE`` on a ~468M-param pair.

The real DeepSpeed inputs of ``bench/make_inputs.py`` (gpt400m: 404M params) take the dev venv and most of an
hour to build on a shared 2-core machine, so this builds its own pair: a GPT of the bench's shape (d 1024,
vocab 50304, 33 blocks ``blocks.N.{ln1,qkv,proj,ln2,fc,out}``, tied head: 467.2M params, 1.87 GB fp32 per
side), written one tensor at a time through zckpt's own safetensors ``StreamWriter``. B is A plus a
fine-tune-like update (relative size growing with depth, one block's MLP moved 10x more than its
neighbours), so every chunk takes diff's full float64 path (no bit-identical fast path).

    .venv/bin/python bench/plot_overhead.py --build            # -> bench/data/plot468m/{a,b}.safetensors
    .venv/bin/python bench/plot_overhead.py --repeat 5         # alternate plain / --plot .png / --plot .html

Each run is its own process (``python -m zckpt.cli.app diff A B --no-progress [--plot F]``), runs alternate
so that machine load hits them alike; per variant the median and best wall time and the peak RSS
(``wait4``'s ``ru_maxrss``) are printed as a Markdown table, with the paired overhead (each round's run
minus that round's plain diff: median and range, steadier than a difference of medians when the load of a
shared machine drifts) and the in-process split (diff vs drawing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DATA = HERE / "data" / "plot468m"
V, D, T, LAYERS = 50304, 1024, 16, 33
ANOMALY = 20


def _specs() -> list[tuple[str, tuple[int, ...], float]]:
    """(name, shape, relative update size of B) in file order."""
    out: list[tuple[str, tuple[int, ...], float]] = [
        ("wte.weight", (V, D), 5e-4),
        ("wpe.weight", (T, D), 5e-4),
    ]
    for i in range(LAYERS):
        eps = 1e-3 * (1 + i / LAYERS)
        shapes = {"ln1.weight": (D,), "ln1.bias": (D,), "qkv.weight": (3 * D, D), "qkv.bias": (3 * D,),
                  "proj.weight": (D, D), "proj.bias": (D,), "ln2.weight": (D,), "ln2.bias": (D,),
                  "fc.weight": (4 * D, D), "fc.bias": (4 * D,), "out.weight": (D, 4 * D),
                  "out.bias": (D,)}  # fmt: skip
        for name, shape in shapes.items():
            big = i == ANOMALY and name.startswith(("fc.", "out."))
            out.append((f"blocks.{i}.{name}", shape, eps * (10 if big else 1) / (10 if "ln" in name else 1)))
    return out + [("ln_f.weight", (D,), 1e-4), ("ln_f.bias", (D,), 1e-4)]


def build() -> None:
    import torch

    from zckpt.codecs.safetensors import StreamWriter

    DATA.mkdir(parents=True, exist_ok=True)
    specs = _specs()
    n = sum(torch.Size(s).numel() for _, s, _ in specs)
    print(f"{n / 1e6:.1f}M params -> {DATA}", flush=True)
    head = [(name, torch.float32, shape) for name, shape, _ in specs]
    a = StreamWriter(DATA / "a.safetensors", head, {"format": "pt"})
    b = StreamWriter(DATA / "b.safetensors", head, {"format": "pt"})
    g = torch.Generator().manual_seed(18)
    for name, shape, eps in specs:
        x = torch.randn(shape, generator=g) * 0.02
        if "ln" in name and name.endswith("weight"):
            x += 1.0
        a.write(name, x)
        b.write(name, x + torch.randn(shape, generator=g) * (eps * float(x.norm()) / x.numel() ** 0.5))
    a.commit()
    b.commit()
    print("built", flush=True)


def _run(args: list[str]) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds user+sys, peak RSS MiB) of one CLI run."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "zckpt.cli.app", *args], env=env, stdout=subprocess.DEVNULL)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1):
        raise SystemExit(f"{args}: exit {code}")
    return wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024


def _in_process() -> tuple[float, float, float]:
    """(diff s, .png s, .html s) in one process: the split of the overhead."""
    sys.path.insert(0, str(REPO))
    from zckpt.ops.diff import diff

    t0 = time.perf_counter()
    r = diff(DATA / "a.safetensors", DATA / "b.safetensors", progress=False)
    t1 = time.perf_counter()
    r.plot(DATA / "split.png")
    t2 = time.perf_counter()
    r.plot(DATA / "split.html")
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def measure(repeat: int) -> None:
    base = [str(DATA / "a.safetensors"), str(DATA / "b.safetensors"), "--no-progress"]
    variants = {"diff": base, "diff --plot .png": [*base, "--plot", str(DATA / "p.png")],
                "diff --plot .html": [*base, "--plot", str(DATA / "p.html")]}  # fmt: skip
    _run(["diff", *base])  # page cache warm-up
    runs: dict[str, list[tuple[float, float, float]]] = {k: [] for k in variants}
    for _ in range(repeat):
        for k, args in variants.items():
            runs[k].append(_run(["diff", *args]))
    ref_wall = statistics.median(w for w, _, _ in runs["diff"])
    ref_cpu = statistics.median(c for _, c, _ in runs["diff"])
    head = ("variant", "median wall s", "best wall s", "walls s", "median CPU s",
            "peak RSS MiB: median (max)", "wall vs plain", "CPU vs plain",
            "paired wall overhead s: median (range)")  # fmt: skip
    print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
    for k, rs in runs.items():
        walls = [w for w, _, _ in rs]
        med, cpu = statistics.median(walls), statistics.median(c for _, c, _ in rs)
        paired = [w - p for w, (p, _, _) in zip(walls, runs["diff"], strict=True)]
        print(f"| `{k}` | {med:.2f} | {min(walls):.2f} | {' '.join(f'{w:.2f}' for w in walls)} | {cpu:.2f} | "
              f"{statistics.median(r for _, _, r in rs):.0f} ({max(r for _, _, r in rs):.0f}) | "
              f"{100 * (med / ref_wall - 1):+.1f}% | "
              f"{100 * (cpu / ref_cpu - 1):+.1f}% | {statistics.median(paired):+.3f} "
              f"({min(paired):+.2f} .. {max(paired):+.2f}) |")  # fmt: skip
    d, png, html = _in_process()
    print(
        f"\nin one process: diff {d:.2f} s, then .plot(png) {png:.3f} s (Pillow's import included), "
        f".plot(html) {html:.3f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="store_true", help="write the input pair (once)")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    if a.build or not (DATA / "b.safetensors").is_file():
        build()
    if not a.build:
        measure(a.repeat)


if __name__ == "__main__":
    main()
