"""Save time of the engine's two checkpoint layouts: native (the default) against DeepSpeed's own
(``"checkpoint": {"format": "deepspeed"}``), on the same engine state, synchronous and asynchronous
(``checkpoint.writer.decoupled``), on CPU/gloo ranks (``torch.multiprocessing.spawn``, ``file://`` store).

    python bench/ds_layout_bench.py [--size small] [--world 2] [--stages 2 3] [--repeat 3] [--dir /tmp/x]

The model is bench/engine_bench.py's GPT (``small``: 23.2M params; a save is 267 MB in either layout),
bf16, AdamW. Per (stage, mode, layout): the median over ``--repeat`` saves of rank 0's time blocked in
``save_checkpoint`` and of the time until the save is published (``wait_for_checkpoint``); saves alternate
between the layouts so both see the same page-cache and load conditions. Prints one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _rank(rank: int, world: int, store: str, a: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from engine_bench import GPT, SIZES

    import engine
    from engine.checkpoint import ds_layout, save

    rows = []
    for stage in a.stages:
        for decoupled in (False, True):
            torch.manual_seed(0)
            model = GPT(SIZES[a.size])
            cfg = {
                "train_micro_batch_size_per_gpu": 1,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": stage},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                "checkpoint": {"writer": {"decoupled": decoupled}},
            }
            eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            x = torch.randint(0, SIZES[a.size].vocab_size, (1, 32))
            loss = eng(x, x)
            eng.backward(loss)
            eng.step()  # the optimizer has its moments: a full save
            times: dict[str, list[tuple[float, float]]] = {"native": [], "deepspeed": []}
            for i in range(a.repeat):
                for layout, fn in (("native", save), ("deepspeed", ds_layout.save)):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn(eng, f"{a.dir}/{layout}", tag=f"t{i}")
                    blocked = time.perf_counter() - t0
                    eng.wait_for_checkpoint()
                    times[layout].append((blocked, time.perf_counter() - t0))
            eng.destroy()
            for layout, ts in times.items():
                rows.append({"stage": stage, "mode": "async" if decoupled else "sync", "layout": layout,
                             "blocked_s": statistics.median(t[0] for t in ts),
                             "published_s": statistics.median(t[1] for t in ts),
                             "runs": [[round(b, 3), round(p, 3)] for b, p in ts]})  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ds-layout-bench-") as tmp:
        a.dir = a.dir or tmp
        out = f"{tmp}/rows.json"
        mp.spawn(_rank, args=(a.world, f"{tmp}/store", a, out), nprocs=a.world, join=True)
        for row in json.loads(Path(out).read_text()):
            print(json.dumps({"size": a.size, "world": a.world, **row}))


if __name__ == "__main__":
    main()
