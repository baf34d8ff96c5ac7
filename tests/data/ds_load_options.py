"""A DeepSpeed script that resumes with ``load_checkpoint``'s options: ``load_module_only=True``,
``load_optimizer_states=False``, ``load_lr_scheduler_states=False`` (and both), beside a plain resume.
Written for DeepSpeed; on the engine it runs unchanged under ``python -m engine.run``.

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=P \\
        python tests/data/ds_load_options.py --ckpt DIR --out out.json

One process (world 1), ZeRO-2, Adam with a linear WarmupLR. Three steps are trained and saved with a
``client_state``; then, per scenario, a fresh engine trains one step on other data (so "left as it was" and
"restored" differ from "fresh"), loads with the scenario's options, and trains two more steps. ``--out`` gets,
per scenario: the counters, lr and scheduler state right after the load, the client_state's own keys, and the
losses, lrs and weight sum of the steps after it (they show whether Adam's moments were restored).
"""

import argparse
import json

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 0.001,
            "warmup_max_lr": 0.01,
            "warmup_num_steps": 8,
            "warmup_type": "linear",
        },
    },
    "zero_optimization": {"stage": 2},
}
SCENARIOS = {
    "default": {},
    "module_only": {"load_module_only": True},
    "no_optimizer": {"load_optimizer_states": False},
    "no_scheduler": {"load_lr_scheduler_states": False},
    "neither": {"load_optimizer_states": False, "load_lr_scheduler_states": False},
}


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def fresh() -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    return eng


def train(eng: deepspeed.DeepSpeedEngine, batches: list[int]) -> list[dict[str, float]]:
    out = []
    for i in batches:
        x, y = batch(i)
        loss = F.cross_entropy(eng(x), y)
        eng.backward(loss)
        eng.step()
        out.append({"loss": loss.item(), "lr": eng.get_lr()[0]})
    return out


def weight_sum(eng: deepspeed.DeepSpeedEngine) -> float:
    return sum(p.detach().double().sum().item() for p in eng.module.parameters())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    deepspeed.init_distributed()
    first = fresh()
    record: dict = {"saved": train(first, [0, 1, 2])}
    first.save_checkpoint(args.ckpt, tag="t3", client_state={"epoch": 7})
    for name, options in SCENARIOS.items():
        eng = fresh()
        train(eng, [50])
        path, client = eng.load_checkpoint(args.ckpt, tag="t3", **options)
        record[name] = {
            "loaded": path is not None,
            "client_epoch": client.get("epoch"),
            "global_steps": eng.global_steps,
            "global_samples": eng.global_samples,
            "skipped_steps": eng.skipped_steps,
            "lr": eng.get_lr(),
            "scheduler": eng.lr_scheduler.state_dict(),
            "after": train(eng, [3, 4]),
            "weight_sum": weight_sum(eng),
        }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
