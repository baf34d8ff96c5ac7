"""Train the demo GPT with a DeepSpeed-API script. Runs on the embedded engine by default
(`import engine as deepspeed`); `--impl deepspeed` runs the very same code on real DeepSpeed.

    torchrun --nproc_per_node 4 docs/demo/train.py --steps 40 --save out
    torchrun --nproc_per_node 2 docs/demo/train.py --steps 10 --load out --save out2
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from gpt import EVAL_STEP, GPT, GPTConfig, encoded_corpus, global_batch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="engine", help="engine (default) or deepspeed")
    ap.add_argument("--config", default=str(Path(__file__).with_name("ds_config.json")))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save", default=None, help="checkpoint folder to save into at the end")
    ap.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    ap.add_argument("--load", default=None, help="checkpoint folder to resume from")
    args = ap.parse_args()

    deepspeed = importlib.import_module(args.impl)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    config = json.loads(Path(args.config).read_text())
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if args.load:
        path, client = eng.load_checkpoint(args.load)
        if rank == 0:
            ours = {k: client[k] for k in ("data_step", "eval_loss") if k in client}  # not DeepSpeed's
            print(f"resumed from {path} at step {eng.global_steps} on {world} ranks (saved with it: {ours})")

    data = encoded_corpus()
    batch = config["train_batch_size"]
    per_rank = batch // world
    t0 = time.time()
    first = eng.global_steps
    for step in range(first, first + args.steps):
        x, y = global_batch(data, step, batch, cfg.block_size)
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = eng(x[sl], y[sl])
        eng.backward(loss)
        eng.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step + 1:4d}  loss {mean.item() / world:.4f}  lr {eng.get_lr()[0]:.2e}  "
                  f"{time.time() - t0:5.1f}s", flush=True)  # fmt: skip
        if args.save and args.save_every and (step + 1) % args.save_every == 0:
            eng.save_checkpoint(args.save, client_state={"data_step": step + 1})

    eng.eval()
    with torch.no_grad():
        x, y = global_batch(data, EVAL_STEP, 32, cfg.block_size)
        ev = eng(x, y).item()
    if rank == 0:
        print(f"engine eval loss {ev:.6f}")
    if args.save:
        eng.save_checkpoint(args.save, client_state={"data_step": eng.global_steps, "eval_loss": ev})
        if rank == 0:
            print(f"saved {args.save} at step {eng.global_steps}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
