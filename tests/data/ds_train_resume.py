"""A DeepSpeed training script in the style of DeepSpeedExamples' ``cifar10_deepspeed.py``: argparse with
``deepspeed.add_config_arguments`` (``--deepspeed --deepspeed_config ds_config.json``), the data loader from
``initialize(training_data=...)``, gradient accumulation, the optimizer and scheduler from the JSON config,
``deepspeed.comm`` / ``get_accelerator`` / ``deepspeed.utils.logger``, a checkpoint with a ``client_state``
at the end of each epoch, and ``--resume`` from ``latest``. Written for DeepSpeed; on the engine it runs
unchanged under ``torchrun ... -m engine.run`` (``import deepspeed`` is then the engine).

    torchrun --nproc_per_node 2 --standalone tests/data/ds_train_resume.py --deepspeed \\
        --deepspeed_config cfg.json --ckpt DIR --epochs 2 --out out.json [--resume] [--stop-after-epoch 0]

Rank 0 writes ``--out``: per optimizer step the mean loss over ranks, lr, global grad norm; the counters and
accessors at the end; what ``load_checkpoint`` returned (with ``--resume``).
"""

import argparse
import json
import os

import deepspeed
import deepspeed.comm as dist
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger
from torch import nn

N_SAMPLES, N_FEATURES, N_CLASSES = 64, 8, 4


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(N_FEATURES, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, N_FEATURES, generator=g)
    y = (x[:, :N_CLASSES].argmax(dim=1) + (x[:, -1] > 1).long()) % N_CLASSES
    return torch.utils.data.TensorDataset(x, y)


def read_latest(ckpt: str) -> str:
    with open(os.path.join(ckpt, "latest")) as f:
        return f.read().strip()


def get_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="classifier")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--local_rank", type=int, default=-1, help="local rank passed from distributed launcher"
    )
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--stop-after-epoch", type=int, default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = get_args()
    deepspeed.init_distributed()
    torch.manual_seed(42)
    model = Classifier()
    parameters = filter(lambda p: p.requires_grad, model.parameters())
    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=parameters, training_data=dataset()
    )
    device = get_accelerator().device_name(model_engine.local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()

    record = {"steps": [], "load": None}
    start_epoch = 0
    if args.resume:
        load_path, client_state = model_engine.load_checkpoint(args.ckpt)
        start_epoch = client_state["epoch"] + 1
        record["load"] = {
            "path_tail": os.path.relpath(load_path, args.ckpt).split(os.sep),
            "client_state": client_state,
            "global_steps": model_engine.global_steps,
            "global_samples": model_engine.global_samples,
            "lr": model_engine.get_lr(),
        }
        logger.info(f"resumed from {load_path} at epoch {start_epoch}")

    for epoch in range(start_epoch, args.epochs):
        model_engine.train()
        running = []
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(device), labels.to(device)
            loss = F.cross_entropy(model_engine(inputs), labels)
            model_engine.backward(loss)
            boundary = model_engine.is_gradient_accumulation_boundary()
            model_engine.step()
            running.append(loss.item())
            if boundary:
                mean = torch.tensor(sum(running) / len(running))
                dist.all_reduce(mean)
                record["steps"].append(
                    {
                        "global_steps": model_engine.global_steps,
                        "loss": mean.item() / world,
                        "lr": model_engine.get_lr()[0],
                        "grad_norm": float(model_engine.get_global_grad_norm()),
                        "applied": model_engine.was_step_applied(),
                    }
                )
                running = []
        client_state = {"epoch": epoch, "last_loss": record["steps"][-1]["loss"], "tag": f"e{epoch}"}
        model_engine.save_checkpoint(args.ckpt, client_state=client_state)
        if args.stop_after_epoch is not None and epoch == args.stop_after_epoch:
            break

    record["final"] = {
        "global_steps": model_engine.global_steps,
        "global_samples": model_engine.global_samples,
        "micro_steps": model_engine.micro_steps,
        "lr": model_engine.get_lr(),
        "train_batch_size": model_engine.train_batch_size(),
        "micro_batch": model_engine.train_micro_batch_size_per_gpu(),
        "gas": model_engine.gradient_accumulation_steps(),
        "stage": model_engine.zero_optimization_stage(),
        "fp16": model_engine.fp16_enabled(),
        "bf16": model_engine.bfloat16_enabled(),
        "len_loader": len(trainloader),
        "args_local_rank": args.local_rank,
        "local_rank": model_engine.local_rank,
        "global_rank": model_engine.global_rank,
        "dp_world_size": model_engine.dp_world_size,
        "sched_last_lr": lr_scheduler.get_last_lr(),
        "optimizer_lr": [g["lr"] for g in optimizer.param_groups],
        "latest": read_latest(args.ckpt),
        "weight_sum": sum(p.detach().float().sum().item() for p in model_engine.module.parameters()),
    }
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
