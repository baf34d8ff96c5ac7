"""A DeepSpeed script that shows how buffers and ``load_checkpoint``'s return values behave (issue 39's
fidelity points). Written for DeepSpeed; on the engine it runs unchanged under ``python -m engine.run``.

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=P \\
        python tests/data/ds_fidelity.py --stage 3 --work DIR --out out.json
    ... --stage 3 --work DIR --load-only CKPT --out out.json   (a fresh engine loads CKPT, strict)

One process (world 1), bf16, AdamW with WarmupLR. The model has a persistent fp32 buffer (``pos_scale``), a
non-persistent one (``scratch``), an int64 one (``calls``), a frozen layer and a tied head. ``--out`` gets:
the implementation (``deepspeed.__version__``), buffer and param dtypes after ``initialize``, three losses,
the keys/dtypes of ``save_16bit_model``'s file, and for each ``load_checkpoint`` option set the returned path
(relative to the save folder) and ``client_state`` (keys in order; tensors as dtype/shape/sum).
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D = 11, 8
SCENARIOS = {
    "default": {},
    "no_optimizer": {"load_optimizer_states": False},
    "no_scheduler": {"load_lr_scheduler_states": False},
    "module_only": {"load_module_only": True},
}


def config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 2},
        },
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
    }


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.fc = nn.Linear(D, D)
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("pos_scale", torch.linspace(0.5, 1.5, D) + 1e-3)  # not exact in bf16
        self.register_buffer("scratch", torch.full((D,), 1.0009765625), persistent=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.emb(x)
        h = h + torch.tanh(self.fc(h))
        h = h + (0.5 * self.frozen(h) * self.pos_scale * self.scratch).to(h.dtype)
        logits = self.head(h).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + i)
    return torch.randint(0, VOCAB, (4, 5), generator=g), torch.randint(0, VOCAB, (4, 5), generator=g)


def fresh(stage: int) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    model = Net()
    params = [p for p in model.parameters() if p.requires_grad]
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config(stage))
    return eng


def summary(v):
    """A JSON picture of a client_state value (tensors by dtype, shape and sum)."""
    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype), "shape": list(v.shape), "sum": v.double().sum().item()}
    if isinstance(v, torch.Size):
        return list(v)
    if isinstance(v, dict):
        return {"dict": [[str(k), summary(x)] for k, x in v.items()]}
    if isinstance(v, (list, tuple)):
        return [summary(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return {"object": type(v).__name__}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--load-only", default=None)
    args = ap.parse_args()
    deepspeed.init_distributed()
    if args.load_only:  # a checkpoint written elsewhere (the engine's, resharded to DeepSpeed): strict load
        eng = fresh(args.stage)
        path, _ = eng.load_checkpoint(args.load_only)
        pos = dict(eng.module.named_buffers())["pos_scale"]
        rec = {
            "loaded": path is not None,
            "pos_scale": [str(pos.dtype), pos.double().sum().item()],
            "loss": eng(*batch(9)).item(),
        }
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
        return
    ckpt, model_dir = os.path.join(args.work, "ckpt"), os.path.join(args.work, "model16")
    eng = fresh(args.stage)
    rec: dict = {
        "deepspeed": deepspeed.__version__,
        "buffer_dtypes": {n: str(b.dtype) for n, b in eng.module.named_buffers()},
        "param_dtypes": sorted({str(p.dtype) for p in eng.module.parameters()}),
        "losses": [],
    }
    for i in range(3):
        loss = eng(*batch(i))
        eng.backward(loss)
        eng.step()
        rec["losses"].append(loss.item())
    rec["buffer_dtypes_after"] = {n: str(b.dtype) for n, b in eng.module.named_buffers()}
    eng.save_checkpoint(ckpt, tag="t3", client_state={"epoch": 7, "note": "x"})
    eng.save_16bit_model(model_dir, "model16.bin")
    sd = torch.load(os.path.join(model_dir, "model16.bin"), map_location="cpu", weights_only=True)
    rec["model16"] = {k: [str(v.dtype), list(v.shape)] for k, v in sd.items()}
    rec["model16_pos_scale_sum"] = sd["pos_scale"].double().sum().item()
    rec["loads"] = {}
    for name, options in SCENARIOS.items():
        e2 = fresh(args.stage)
        path, client = e2.load_checkpoint(ckpt, tag="t3", **options)
        rec["loads"][name] = {
            "path_tail": os.path.relpath(path, ckpt).split(os.sep),
            "client_keys": list(client),
            "client": {k: summary(v) for k, v in client.items() if k != "ds_version"},
            "ds_version": client.get("ds_version"),
            "next_loss": e2(*batch(3)).item(),
        }
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
