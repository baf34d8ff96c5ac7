"""Fault-tolerant training for ``tests/test_fault_tolerance.py``, run under ``torchrun --max-restarts 1``.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/_ft_worker.py CKPT_DIR RESULT.json STEPS

The recipe: resume from ``latest`` at start (``load_checkpoint`` returns ``(None, None)`` when there is none),
take the step counter from the engine, draw each step's batch from the step number only (so a restarted run
sees exactly the batches it would have seen), and save after every step. ``FT_KILL_STEP=k`` makes rank
``FT_KILL_RANK`` (default 1) SIGKILL itself in the middle of step ``k`` (after backward, before the optimizer
step), on the first attempt only (``TORCHELASTIC_RESTART_COUNT == 0``); torchrun then restarts every rank.
Every attempt first trains the same loop uninterrupted in a fresh folder (the oracle), then the
fault-tolerant run; rank 0 writes ``{"attempt", "run", "uninterrupted"}`` to RESULT.json at the end, each
``{"start_step", "losses", "params"}``.

``FT_ASYNC=1`` saves asynchronously (``checkpoint.writer.decoupled``): then rank ``FT_KILL_RANK`` SIGKILLs
itself right after ``save_checkpoint`` of step ``k`` returned, while its background writer is still writing
(stretched by ``ZCKPT_TEST_WRITE_DELAY``; the rank checks that the write is in flight and says so in
``<CKPT_DIR>.killed-mid-write``), so ``latest`` must still name the previous step's checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _slow_writes  # noqa: E402
from _engine_ref import BATCH, batch, config, full_params, make_model  # noqa: E402

import engine as deepspeed  # noqa: E402

_slow_writes.install()  # the killed rank stretches its background write (ZCKPT_TEST_WRITE_DELAY)


def train(ckpt_dir: str, steps: int, kill_step: int = -1, kill_rank: int = 1) -> dict[str, object]:
    """The fault-tolerant loop: resume from ``latest`` if any, one batch per step number, save every step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    asynchronous = os.environ.get("FT_ASYNC") == "1"
    cfg = config(3)
    if asynchronous:
        cfg["checkpoint"] = {"writer": {"decoupled": True}}
    model = make_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05, weight_decay=0.01)
    eng, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    eng.load_checkpoint(ckpt_dir)  # (None, None) on a fresh start
    start = eng.global_steps
    mb = BATCH // world
    losses = []
    for k in range(start, steps):
        x, y = batch(k)  # the batch depends on the step only
        loss = eng(x[rank * mb : (rank + 1) * mb], y[rank * mb : (rank + 1) * mb])
        eng.backward(loss)
        kill = k == kill_step and rank == kill_rank
        if kill and not asynchronous:
            os.kill(os.getpid(), signal.SIGKILL)
        eng.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if kill:
            os.environ["ZCKPT_TEST_WRITE_DELAY"] = "2"
        eng.save_checkpoint(ckpt_dir, tag=f"global_step{eng.global_steps}")
        if kill:
            assert eng.checkpointer is not None and eng.checkpointer.busy
            Path(f"{ckpt_dir}.killed-mid-write").write_text(f"global_step{eng.global_steps}")
            os.kill(os.getpid(), signal.SIGKILL)
    out = {"start_step": start, "losses": losses, "params": full_params(eng)}
    eng.destroy()  # an asynchronous save in flight is published before the process group goes
    return out


def main() -> None:
    ckpt_dir, result, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_step = int(os.environ.get("FT_KILL_STEP", "-1")) if attempt == 0 else -1
    deepspeed.init_distributed(dist_backend="gloo")
    # the oracle: the same loop, uninterrupted, from scratch in a fresh folder (on every attempt)
    ref = train(f"{ckpt_dir}-uninterrupted-{attempt}", steps)
    run = train(ckpt_dir, steps, kill_step, int(os.environ.get("FT_KILL_RANK", "1")))
    if dist.get_rank() == 0:
        result.write_text(json.dumps({"attempt": attempt, "run": run, "uninterrupted": ref}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
