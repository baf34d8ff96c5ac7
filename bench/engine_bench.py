"""Engine step-time benchmark: the same GPT, config and data under plain PyTorch (no sharding: the
ceiling at world 1), the embedded engine and real DeepSpeed, on CPU/gloo or CUDA/NCCL.

    python bench/engine_bench.py --impl plain  --size 355m --device cuda
    torchrun --nproc_per_node 2 bench/engine_bench.py --impl engine --size tiny --device cpu
    python bench/engine_bench.py --impl engine --size 355m --device cuda --offload

Prints one JSON line: step time (median of the timed steps), tokens/s, MFU (bf16 dense peak of the GPU),
peak memory per rank (GPU allocator and host RSS), and the per-step losses (so runs can be compared).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "demo"))
from gpt import GPT, GPTConfig  # noqa: E402

SIZES = {
    "tiny": GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, n_embd=64),
    "small": GPTConfig(vocab_size=8192, block_size=256, n_layer=6, n_head=8, n_embd=512),
    "355m": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "1b": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1792),
    "1.5b": GPTConfig(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    "3b": GPTConfig(vocab_size=50304, block_size=1024, n_layer=36, n_head=20, n_embd=2560),
}
PEAK_FLOPS = {"cuda": 989e12, "cpu": float("nan")}


def _count(cfg: GPTConfig) -> int:
    """Parameters of ``GPT(cfg)`` (tied head counted once), without building it."""
    e, f = cfg.n_embd, 4 * cfg.n_embd
    block = 2 * 2 * e + (3 * e * e + 3 * e) + (e * e + e) + (f * e + f) + (e * f + e)
    return cfg.vocab_size * e + cfg.block_size * e + cfg.n_layer * block + 2 * e


def _no_mark(_phase: str) -> None:
    pass


def _site(frames: list) -> str:
    """The first frame outside torch's own code (the model, the engine, DeepSpeed, this script)."""
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" not in name or "/deepspeed/" in name:
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    return "(torch internals)" if frames else "(no stack)"


def mem_trace(train_step, x: torch.Tensor, y: torch.Tensor, impl: str) -> None:
    """One more step with the CUDA allocator recorded: the peak of each phase, and what is live at the
    step's peak beyond what was allocated before it (grouped by the line that allocated it)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    peaks: dict[str, float] = {}

    def mark(phase: str) -> None:
        torch.cuda.synchronize()
        peaks[phase] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        torch.cuda.reset_peak_memory_stats()

    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        train_step(x, y, mark)
        mark("step")
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = snap["device_traces"][torch.cuda.current_device()]
    cur = top = top_i = 0
    held: set[int] = set()  # blocks allocated before the recording count from their free on
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            cur += e["size"]
            held.add(e["addr"])
        elif e["action"] in ("free_requested", "free_completed") and (
            e["addr"] in held or e["action"] == "free_requested"
        ):
            held.discard(e["addr"])
            cur -= e["size"]
        if cur > top:
            top, top_i = cur, i
    live: dict[int, tuple[int, list]] = {}
    for e in events[: top_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
        elif e["action"] in ("free_requested", "free_completed"):
            live.pop(e["addr"], None)
    sites: dict[str, int] = {}
    for size, frames in live.values():
        sites[_site(frames)] = sites.get(_site(frames), 0) + size
    print(f"MEMPHASES {impl} " + json.dumps({"before_step_gib": round(base / 2**30, 3), **peaks,
          "peak_above_before_gib": round(top / 2**30, 3)}), flush=True)  # fmt: skip
    for site, size in sorted(sites.items(), key=lambda kv: -kv[1])[:14]:
        print(f"MEMSITE {impl} {size / 2**30:8.3f} GiB  {site}", flush=True)


def ds_config(args: argparse.Namespace) -> dict:
    zero: dict = {"stage": args.stage, "overlap_comm": True, "contiguous_gradients": True,
                  "reduce_bucket_size": args.reduce_bucket, "stage3_prefetch_bucket_size": 5e8,
                  "stage3_param_persistence_threshold": 1e5}  # fmt: skip
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if args.stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif args.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["plain", "engine", "deepspeed"], required=True)
    ap.add_argument("--size", choices=list(SIZES), default="tiny")
    ap.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16")
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--layers", type=int, default=None, help="override the size's n_layer")
    ap.add_argument("--embd", type=int, default=None, help="override n_embd (n_head becomes embd // 128)")
    ap.add_argument("--heads", type=int, default=None, help="override n_head")
    ap.add_argument(
        "--init",
        choices=["eager", "meta"],
        default="eager",
        help="meta: build without materialising the model (engine: meta device, materialised per module at "
        "initialize; DeepSpeed: zero.Init, partitioned at construction onto the offload device)",
    )
    ap.add_argument("--reduce-bucket", type=float, default=5e8, help="reduce_bucket_size (elements)")
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="print rank 0's profile of the timed steps")
    ap.add_argument(
        "--mem-trace",
        action="store_true",
        help="CUDA: record the allocator during one more step after the timed ones; print the peak of each "
        "phase and the allocations live at the step's peak, by the line that made them",
    )
    args = ap.parse_args()

    cfg = SIZES[args.size]
    if args.layers or args.embd:
        embd = args.embd or cfg.n_embd
        layers = args.layers or cfg.n_layer
        cfg = dataclasses.replace(cfg, n_layer=layers, n_embd=embd, n_head=max(1, embd // 128))
    if args.heads:
        cfg = dataclasses.replace(cfg, n_head=args.heads)
    dev = torch.device(args.device)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    if args.init == "meta" and args.impl == "engine":
        with torch.device("meta"):
            model = GPT(cfg)
    elif args.init == "meta" and args.impl == "deepspeed":
        model = None  # built under deepspeed.zero.Init below, once the process group exists
    else:
        model = GPT(cfg)
    n_params = _count(cfg)
    if args.impl == "plain":
        model.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
        amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
        scaler = torch.amp.GradScaler(enabled=args.dtype == "fp16")

        def train_step(x: torch.Tensor, y: torch.Tensor, mark=_no_mark) -> torch.Tensor:
            with torch.autocast(args.device, dtype=amp or torch.float32, enabled=amp is not None):
                loss = model(x, y)
            mark("forward")
            scaler.scale(loss).backward()
            mark("backward")
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return loss
    else:
        if args.impl == "deepspeed" and args.device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        ds = importlib.import_module(args.impl)
        if args.impl == "deepspeed" and args.device == "cpu":
            # DeepSpeed loads a shared-memory comm op even with DS_BUILD_OPS=0; plain gloo is what we compare
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        ds.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
        if dist.is_initialized():
            world, rank = dist.get_world_size(), dist.get_rank()
        if model is None:
            where, pin = ("cpu", True) if args.offload else (None, False)
            with ds.zero.Init(config_dict_or_path=ds_config(args), remote_device=where, pin_memory=pin):
                model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        eng, _, _, _ = ds.initialize(model=model, optimizer=opt, config=ds_config(args))

        def train_step(x: torch.Tensor, y: torch.Tensor, mark=_no_mark) -> torch.Tensor:
            loss = eng(x, y)
            mark("forward")
            eng.backward(loss)
            mark("backward")
            eng.step()
            return loss

    g = torch.Generator().manual_seed(1 + rank)
    times, losses = [], []
    prof = torch.profiler.profile(record_shapes=True, with_stack=True) if args.profile else None
    faults0 = 0
    gc_time = [0.0, 0.0]  # time in Python's cyclic GC during the timed steps; start of the current pass

    def on_gc(phase: str, _info: dict) -> None:
        if phase == "start":
            gc_time[1] = time.perf_counter()
        elif faults0:
            gc_time[0] += time.perf_counter() - gc_time[1]

    gc.callbacks.append(on_gc)
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if prof is not None:
                prof.__enter__()
        x = torch.randint(0, cfg.vocab_size, (args.micro, cfg.block_size), generator=g).to(dev)
        y = torch.randint(0, cfg.vocab_size, (args.micro, cfg.block_size), generator=g).to(dev)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = train_step(x, y)
        lv = loss.item()  # syncs
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(round(lv, 5))
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / args.steps
    if prof is not None:
        prof.__exit__(None, None, None)
        if rank == 0:
            table = prof.key_averages(group_by_stack_n=6).table(sort_by="self_cpu_time_total", row_limit=15)
            print(table, flush=True)
    step = statistics.median(times)
    tokens = args.micro * cfg.block_size * world
    flops = (6 * n_params + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size) * tokens
    out = {
        "impl": args.impl, "size": args.size, "params": n_params, "device": args.device, "world": world,
        "dtype": args.dtype, "stage": args.stage if args.impl != "plain" else None, "offload": args.offload,
        "micro": args.micro, "step_s": round(step, 4), "tokens_per_s": round(tokens / step, 1),
        "mfu": round(flops / step / world / PEAK_FLOPS[args.device], 4),
        "gpu_peak_gib": (
            round(torch.cuda.max_memory_allocated() / 2**30, 2) if args.device == "cuda" else None
        ),
        "host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "minor_faults_per_step": round(faults),
        "gc_s_per_step": round(gc_time[0] / args.steps, 4),
        "losses": losses,
    }  # fmt: skip
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    if args.mem_trace and args.device == "cuda":
        x = torch.randint(0, cfg.vocab_size, (args.micro, cfg.block_size), generator=g).to(dev)
        try:
            mem_trace(train_step, x, x.roll(1, 1), args.impl)
        except Exception as e:  # a diagnostic: never lose the run for it
            print(f"MEMTRACE failed: {type(e).__name__}: {e}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
