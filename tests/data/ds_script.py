"""A training script written for DeepSpeed's API (client AdamW, WarmupLR and clipping from the config, a tied
and a frozen parameter). It runs unchanged on the embedded engine: ``import engine as deepspeed``.

    torchrun --nproc_per_node 2 --standalone tests/data/ds_script.py --stage 3 --out losses.json
"""

from __future__ import annotations

import argparse
import importlib
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQ, BATCH, STEPS = 29, 10, 6, 12, 5
LR = 0.02


def ds_config(stage: int) -> dict:
    return {
        "train_batch_size": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.3,
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": LR,
                "warmup_num_steps": 2,
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.fixed = nn.Linear(DIM, DIM, bias=False)
        self.fixed.weight.requires_grad_(False)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + torch.relu(self.proj(h)) + 0.1 * self.fixed(h)
        return F.cross_entropy(self.out(h).reshape(-1, VOCAB), y.reshape(-1))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(
        0, VOCAB, (BATCH, SEQ), generator=g
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="engine")
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    deepspeed = importlib.import_module(args.impl)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01
    )
    model_engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=model.parameters(), config=ds_config(args.stage)
    )
    losses = []
    per = BATCH // world
    for step in range(STEPS):
        x, y = data(step)
        loss = model_engine(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        model_engine.backward(loss)
        model_engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "lr": scheduler.get_last_lr()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
