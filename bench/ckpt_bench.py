"""Checkpoint benchmark (issue 16): on one GPT, config and data, the step time, the training-blocked time of
a save, the total save time, the load time and the checkpoint's size -- the engine (synchronous and
asynchronous saves) and DeepSpeed (synchronous and decoupled).

    python bench/ckpt_bench.py --impl engine --size 1.5b --micro 4 --dir /path/on/the/disk
    python bench/ckpt_bench.py --impl deepspeed --size 355m --dir ... (DeepSpeed installed)
    python bench/ckpt_bench.py --impl engine --size tiny --device cpu --dir /tmp/ck   (a dry run)

Engine: one engine built with ``checkpoint.writer.decoupled``; a synchronous save (the background writer
set aside for it), then an asynchronous save of the same state (training steps run while it is written,
each timed), the files of the two compared (the manifests' digests of every rank file), ``zckpt verify`` on
the asynchronous one (``--verify``), ``--steady N`` more asynchronous saves, each after a few steps (steady
state: the snapshot buffer is reused), then a load of the last after dropping the page cache (one per value of
``--load-depths``, reads in flight, with ``--sync-only``'s load too). DeepSpeed: one engine built with
``checkpoint.writer.decoupled`` (type ``fast`` when its async-I/O op builds here, else ``python``); a
synchronous save through its default ``TorchCheckpointEngine`` (swapped in for it) with the ``sync`` that
makes it durable timed separately, a load of it after dropping the page cache, then a decoupled save
(the next step waits for its commit). Checkpoints are deleted as soon as they are measured (disk space).

One line ``CKPT {json}`` per measurement and ``CKPTSUM {json}`` at the end (rank 0).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_bench import (  # noqa: E402
    GPT,  # noqa: E402
    SIZES,
    ds_config,
)

OUT: dict[str, Any] = {}
ARGS = argparse.Namespace(drop_caches=False)


def emit(what: str, **kw: Any) -> None:
    rec = {"what": what, **{k: round(v, 4) if isinstance(v, float) else v for k, v in kw.items()}}
    OUT[what] = rec
    print("CKPT " + json.dumps(rec), flush=True)


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def drop_caches() -> bool:
    """``sync`` + drop the page cache (root), so a load reads the disk; False where that is not allowed or
    not asked for (``--drop-caches``)."""
    os.sync()
    if not ARGS.drop_caches:
        return False
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def build(args: argparse.Namespace, decoupled_type: str) -> tuple[Any, Callable[[], float]]:
    """The engine (``--impl``) over the GPT of ``--size`` with a writer block, and a timed-step function."""
    cfg = SIZES[args.size]
    torch.manual_seed(0)
    dev = torch.device(args.device)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    if args.impl == "deepspeed":  # its checkpoint writer reads what the deepspeed launcher sets: one machine
        os.environ.setdefault("CROSS_SIZE", "1")
        os.environ.setdefault("CROSS_RANK", "0")
        # DeepSpeed 0.19.8 reloads its own files with torch.load's default, weights_only=True, which refuses
        # its ZeroStageEnum; these files are the ones this process just wrote
        os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    if args.impl == "deepspeed" and args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ds = importlib.import_module(args.impl)
    if args.impl == "deepspeed" and args.device == "cpu":
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    ds.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    model = GPT(cfg)
    conf = ds_config(args)
    conf["checkpoint"] = {"writer": {"decoupled": True, "type": decoupled_type}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    eng, _, _, _ = ds.initialize(model=model, optimizer=opt, config=conf)
    g = torch.Generator().manual_seed(1)

    def step() -> float:
        x = torch.randint(0, cfg.vocab_size, (args.micro, cfg.block_size), generator=g).to(dev)
        y = torch.randint(0, cfg.vocab_size, (args.micro, cfg.block_size), generator=g).to(dev)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        loss.item()
        return time.perf_counter() - t0

    return eng, step


def baseline(step: Callable[[], float], args: argparse.Namespace) -> float:
    for _ in range(args.warmup):
        step()
    s = statistics.median([step() for _ in range(args.steps)])
    emit("step", step_s=s)
    return s


# ---- the engine ------------------------------------------------------------------------------------
def engine_async(eng: Any, step: Callable[[], float], d: Path, tag: str, base: float) -> dict[str, Any]:
    """An asynchronous save, training on while it is written; the figures of it."""
    blocked, _ = timed(lambda: eng.save_checkpoint(str(d), tag=tag))
    during = []
    while eng.checkpointer.busy:
        during.append(step())
    t_wait, _ = timed(eng.wait_for_checkpoint)
    st = eng.checkpoint_stats
    w = st["write"]
    gb = w["bytes"] / 1e9
    return dict(
        blocked_s=blocked,
        total_s=st["total_s"],
        write_s=w["wall_s"],
        gb=gb,
        write_gbs=gb / max(w["wall_s"], 1e-9),
        hash_s=w["hash_s"],
        device_write_s=w["device_write_s"],
        fsync_s=w["fsync_s"],
        direct=w["direct"],
        copied_gb=w["copied_bytes"] / 1e9,
        steps_during=len(during),
        steps_during_s=[round(s, 4) for s in during],
        step_after_s=during[0] if during else None,
        step_during_median_s=statistics.median(during) if during else None,
        step_after_over_base=(during[0] / base) if during else None,
        wait_after_steps_s=t_wait,
        staging_gib=st["staging_bytes"] / 2**30,
        staging_alloc_s=st["staging_alloc_s"],
        checkpoint_gb=du(d / tag) / 1e9,
    )


def run_engine(args: argparse.Namespace) -> None:
    t_init, (eng, step) = timed(lambda: build(args, "fast"))
    emit(
        "init",
        s=t_init,
        staging_gib=eng.checkpointer.staging.nbytes / 2**30,
        staging_alloc_s=eng.checkpointer.staging.alloc_s,
    )
    base = baseline(step, args)
    d = Path(args.dir)
    saver, eng.checkpointer = eng.checkpointer, None  # a synchronous save of the same engine
    t_sync, _ = timed(lambda: eng.save_checkpoint(str(d), tag="sync"))
    eng.checkpointer = saver
    w = eng.checkpoint_stats["write"]
    emit(
        "engine sync save",
        s=t_sync,
        gb=du(d / "sync") / 1e9,
        write_gbs=w["bytes"] / 1e9 / t_sync,
        hash_s=w["hash_s"],
        device_write_s=w["device_write_s"],
        fsync_s=w["fsync_s"],
        direct=w["direct"],
    )
    if args.sync_only:
        engine_load(eng, step, d, "sync", args.load_depths)
        return
    emit("engine async save (first)", **engine_async(eng, step, d, "async", base))
    ms, ma = (json.loads((d / t / "manifest.json").read_text()) for t in ("sync", "async"))
    emit(
        "engine async vs sync",
        identical_files=ms["files"] == ma["files"],
        manifest_keys_differing=sorted(k for k in ms if k not in ("tag",) and ms[k] != ma[k]),
    )
    if args.verify:
        from zckpt.ops.verify import verify

        t_v, rep = timed(lambda: verify(d, tag="async"))
        emit("zckpt verify async", ok=rep.ok, s=t_v)
    shutil.rmtree(d / "sync")
    shutil.rmtree(d / "async")
    last = "async"
    for i in range(args.steady):  # the snapshot buffers are reused from here on
        for _ in range(3):
            step()
        tag = f"async{i + 2}"
        emit("engine async save (steady)", n=i + 1, **engine_async(eng, step, d, tag, base))
        if i + 1 < args.steady:
            shutil.rmtree(d / tag)
        last = tag
    engine_load(eng, step, d, last, args.load_depths)


def engine_load(eng: Any, step: Callable[[], float], d: Path, tag: str, depths: list[int]) -> None:
    """A load after dropping the page cache; with ``--load-depths``, one per number of reads in flight."""
    reads = importlib.import_module("engine.checkpoint.reads")
    for depth in depths or [reads.DEPTH]:
        reads.DEPTH = depth
        dropped = drop_caches()
        t_load, _ = timed(lambda: eng.load_checkpoint(str(d), tag=tag))
        gb = du(d / tag) / 1e9
        emit(
            "engine load",
            s=t_load,
            gb=gb,
            read_gbs=gb / t_load,
            caches_dropped=dropped,
            step_after_s=step(),
            stats=eng.load_stats,
        )
    eng.destroy()
    shutil.rmtree(d, ignore_errors=True)


# ---- DeepSpeed -------------------------------------------------------------------------------------
def ds_writer_type() -> str:
    """``fast`` where DeepSpeed's async-I/O op can be built here, else ``python``."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return "fast" if AsyncIOBuilder().is_compatible(verbose=False) else "python"
    except Exception:  # noqa: BLE001 - any failure: the plain writer
        return "python"


def run_deepspeed(args: argparse.Namespace) -> None:
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    kind = ds_writer_type()
    t_init, (eng, step) = timed(lambda: build(args, kind))
    emit("init", s=t_init, decoupled_writer_type=kind)
    base = baseline(step, args)
    d = Path(args.dir)
    dec, eng.checkpoint_engine = eng.checkpoint_engine, TorchCheckpointEngine(eng._config)
    t_sync, _ = timed(lambda: eng.save_checkpoint(str(d), tag="sync"))
    t_flush, _ = timed(os.sync)
    eng.checkpoint_engine = dec
    gb = du(d / "sync") / 1e9
    emit("deepspeed sync save", s=t_sync, sync_after_s=t_flush, gb=gb, write_gbs=gb / (t_sync + t_flush))
    dropped = drop_caches()
    t_load, _ = timed(lambda: eng.load_checkpoint(str(d), tag="sync"))
    emit("deepspeed load", s=t_load, gb=gb, read_gbs=gb / t_load, caches_dropped=dropped, step_after_s=step())
    shutil.rmtree(d / "sync")
    blocked, _ = timed(lambda: eng.save_checkpoint(str(d), tag="dec"))
    after = [step() for _ in range(3)]
    t_flush, _ = timed(os.sync)
    emit(
        "deepspeed decoupled save",
        blocked_s=blocked,
        step_after_s=after[0],
        steps_after=after,
        step_after_over_base=after[0] / base,
        sync_after_s=t_flush,
        gb=du(d / "dec") / 1e9,
        writer_type=kind,
    )
    shutil.rmtree(d, ignore_errors=True)
    eng.destroy()


def save_only(args: argparse.Namespace) -> None:
    """A real DeepSpeed checkpoint to measure converters on: ``--steps`` steps, then one synchronous save
    through DeepSpeed's default ``TorchCheckpointEngine`` into ``--dir`` (kept), fsynced."""
    t_init, (eng, step) = timed(lambda: build(args, "python"))
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    eng.checkpoint_engine = TorchCheckpointEngine(eng._config)
    steps = [step() for _ in range(args.steps)]
    t_save, _ = timed(lambda: eng.save_checkpoint(args.dir))
    t_sync, _ = timed(os.sync)
    print(
        "CKPT "
        + json.dumps(
            {
                "what": "deepspeed save-only",
                "init_s": t_init,
                "steps_s": steps,
                "save_s": t_save,
                "sync_s": t_sync,
                "gb": du(Path(args.dir)) / 1e9,
            }
        ),
        flush=True,
    )
    eng.destroy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["engine", "deepspeed"], required=True)
    ap.add_argument("--size", choices=list(SIZES), default="tiny")
    ap.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16")
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--reduce-bucket", type=float, default=5e8)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dir", required=True, help="checkpoint folder (on the disk under test; deleted)")
    ap.add_argument("--verify", action="store_true", help="zckpt verify the asynchronous checkpoint")
    ap.add_argument("--sync-only", action="store_true", help="engine: a synchronous save and its load only")
    ap.add_argument("--steady", type=int, default=1, help="engine: how many steady-state async saves")
    ap.add_argument(
        "--load-depths",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[],
        help="engine: load once per value, with that many reads in flight (e.g. 3,1,2)",
    )
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each load (root)")
    ap.add_argument(
        "--save-only",
        action="store_true",
        help="DeepSpeed: train --steps steps, save one synchronous checkpoint into --dir and keep it "
        "(an input for bench/scale.py)",
    )
    args = ap.parse_args()
    ARGS.drop_caches = args.drop_caches
    if args.save_only:
        save_only(args)
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    try:
        (run_engine if args.impl == "engine" else run_deepspeed)(args)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
        print("CKPTSUM " + json.dumps({"impl": args.impl, "size": args.size, "results": OUT}), flush=True)
        subprocess.run(["df", "-h", str(Path(args.dir).parent)], check=False)


if __name__ == "__main__":
    main()
