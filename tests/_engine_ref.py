"""Shared pieces of the engine tests: a small awkward model, its data, the DeepSpeed config, the
single-process plain-PyTorch reference (the oracle), and an engine training loop usable on any rank.

The model has awkward shapes (7, 13, 15: uneven partitions at world 2 and 3), a tied weight (the head reuses
the embedding matrix), a frozen layer, and a float and an int buffer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D, H, T = 13, 7, 15, 5
BATCH = 12
MAX_LR, WARMUP = 0.05, 3
CLIP = 0.5
BETAS, EPS, WD = (0.9, 0.99), 1e-8, 0.01


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.l1 = nn.Linear(D, H)
        self.norm = nn.LayerNorm(H)
        self.l2 = nn.Linear(H, D)
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor([0.75, 1.25, 1.0, 0.5, 1.5, 1.0, 0.9]))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.l2(torch.tanh(self.norm(self.l1(h))))
        h = h + (0.5 * self.frozen(h) * self.scale).to(h.dtype)  # an fp32 buffer stays fp32 (DeepSpeed)
        logits = self.head(h).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def make_model(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (BATCH, T), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, T), generator=g)
    return x, y


def warmup_lr(k: int) -> float:
    """DeepSpeed WarmupLR (linear, min 0) as seen by optimizer step ``k`` (0-based): the scheduler is stepped
    after each applied update, and construction writes the min rate, so step k uses iteration k - 1."""
    if k == 0:
        return 0.0
    it = k - 1
    return MAX_LR * (it / WARMUP if it < WARMUP else 1.0)


def config(stage: int, precision: str = "fp32", gas: int = 1, **zero: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": BATCH,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0,
                "warmup_max_lr": MAX_LR,
                "warmup_num_steps": WARMUP,
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 50,
            "allgather_bucket_size": 60,
            "stage3_prefetch_bucket_size": 40,
            "stage3_param_persistence_threshold": 10,
            **zero,
        },
        "steps_per_print": 10**9,
    }
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 4, "hysteresis": 2}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def optimizer(model: nn.Module) -> torch.optim.AdamW:
    """The tests' AdamW over ``model``'s trainable params (the reference's hyper-parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=MAX_LR, betas=BETAS, eps=EPS, weight_decay=WD)


def reference(steps: int, make: Callable[[], nn.Module] = make_model) -> dict[str, Any]:
    """Single-process plain PyTorch over the global batch: AdamW, clip_grad_norm_, WarmupLR."""
    model = make()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(model)
    losses = []
    for k in range(steps):
        for g in opt.param_groups:
            g["lr"] = warmup_lr(k)
        x, y = batch(k)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().reshape(-1).tolist() for n, p in model.state_dict().items()},
    }


def train(
    rank: int,
    world: int,
    cfg: dict[str, Any],
    steps: int,
    *,
    first: int = 0,
    model: nn.Module | None = None,
    engine_: Any = None,
) -> tuple[Any, list[float]]:
    """Train ``steps`` optimizer steps (from step ``first``) on the engine; return (engine, mean losses)."""
    import torch.distributed as dist

    import engine

    if engine_ is None:
        model = model if model is not None else make_model()
        engine_, _, _, _ = engine.initialize(model=model, optimizer=optimizer(model), config=cfg)
    gas = cfg["gradient_accumulation_steps"]
    mb = BATCH // (world * gas)
    losses = []
    for k in range(first, first + steps):
        x, y = batch(k)
        total = torch.zeros(())
        for g in range(gas):
            lo = (rank * gas + g) * mb
            loss = engine_(x[lo : lo + mb], y[lo : lo + mb])
            engine_.backward(loss)
            engine_.step()
            total += loss.detach().float()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / (world * gas))
    return engine_, losses


def full_params(eng: Any) -> dict[str, list[float]]:
    """Every model tensor as a flat list, gathered (params) or as held (buffers)."""
    import engine

    with engine.zero.GatheredParameters(list(eng.module.parameters())):
        return {n: t.detach().float().reshape(-1).tolist() for n, t in eng.module.state_dict().items()}


def rel_err(a: list[float], b: list[float]) -> float:
    num = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))
    den = math.sqrt(sum(y * y for y in b)) or 1.0
    return num / den
