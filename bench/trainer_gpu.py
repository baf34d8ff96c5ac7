#!/usr/bin/env python3
"""Issue 39 on the lent GPU host: the same HF Trainer script, ZeRO-3 bf16 on one GPU, on real DeepSpeed 0.19.8
and on the engine (``-m engine.run``), with a ~1B Llama-architecture model from a random ``LlamaConfig``.

    bash bench/gpu_trainer.sh            # on the GPU host: both runs, then bench/trainer_gpu.py --report
    torchrun --standalone --nproc-per-node 1 [-m engine.run] bench/trainer_gpu.py --out run.json --dir D

One run trains ``--steps`` steps (synthetic tokens, seeded: both runs see the same batches), saves
``checkpoint-N`` at the last step through the Trainer (``save_checkpoint``), then ``trainer.save_model()``
(ZeRO-3: the 16-bit weights gathered). Rank 0 writes ``--out``: the implementation, each step's loss and wall
time, the checkpoint save's time (from the end of the step to the Trainer's ``on_save``: DeepSpeed's
``save_checkpoint`` plus the Trainer's own small files), ``save_model``'s time, and the GPU's peak allocated
memory. ``--report A.json B.json`` prints the comparison table (Markdown).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

CONFIG = {
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "reduce_bucket_size": "auto",
        "sub_group_size": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "gradient_clipping": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "steps_per_print": 100000,
    "wall_clock_breakdown": False,
}


def run(a: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    seq, batch = a.seq, a.batch
    cuda = torch.cuda.is_available()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(1234)
            self.x = torch.randint(0, a.vocab, (n, seq), generator=g)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.x[i], "labels": self.x[i]}

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.losses: dict[int, float] = {}
            self.step_s: list[float] = []
            self.save_s: list[float] = []
            self._t = self._end = 0.0

        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
            sync()
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            sync()
            self._end = time.perf_counter()
            self.step_s.append(self._end - self._t)

        def on_save(self, args, state, control, **kw):  # noqa: ANN001
            self.save_s.append(time.perf_counter() - self._end)

        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001
            if logs and "loss" in logs:
                self.losses[state.global_step] = logs["loss"]

    cfg_path = f"{a.dir}/ds_config.json"
    with open(cfg_path, "w") as f:
        json.dump(CONFIG, f)
    args = TrainingArguments(
        output_dir=f"{a.dir}/out",
        deepspeed=cfg_path,
        bf16=True,
        max_steps=a.steps,
        save_steps=a.steps,
        save_strategy="steps",
        logging_steps=1,
        per_device_train_batch_size=batch,
        learning_rate=3e-4,
        warmup_steps=2,
        weight_decay=0.01,
        max_grad_norm=1.0,
        seed=42,
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
        use_cpu=not cuda,  # the smoke run on a machine without a GPU
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=a.vocab,
            hidden_size=a.hidden,
            intermediate_size=a.inter,
            num_hidden_layers=a.layers,
            num_attention_heads=a.heads,
            num_key_value_heads=a.heads,
            max_position_embeddings=seq,
            tie_word_embeddings=False,
        )
    )
    params = sum(p.numel() for p in model.parameters())
    rec = Record()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(a.steps * batch), callbacks=[rec])
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    sync()
    os.sync()  # the checkpoint's writes are not save_model's
    t0 = time.perf_counter()
    trainer.save_model(f"{a.dir}/model")
    save_model_s = time.perf_counter() - t0
    os.sync()  # what save_model left in the page cache, on the disk: durable as the engine's (it fsyncs)
    save_model_sync_s = time.perf_counter() - t0
    import deepspeed

    out = {
        "impl": deepspeed.__version__,
        "params": params,
        "losses": rec.losses,
        "step_s": rec.step_s,
        "save_s": rec.save_s,
        "train_s": train_s,
        "save_model_s": save_model_s,
        "save_model_sync_s": save_model_sync_s,
        "peak_alloc_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
        "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9 if cuda else 0.0,
    }
    if trainer.is_world_process_zero():
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


def report(paths: list[str]) -> None:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    print("| | " + " | ".join(r["impl"] for r in runs) + " |")
    print("|---|" + "---|" * len(runs))
    rows = [
        ("params", lambda r: f"{r['params'] / 1e9:.3f} B"),
        ("step s (median, steps 3..)", lambda r: f"{statistics.median(r['step_s'][2:]):.3f}"),
        ("steps s (all)", lambda r: " ".join(f"{x:.2f}" for x in r["step_s"])),
        ("peak GPU allocated GB", lambda r: f"{r['peak_alloc_gb']:.2f}"),
        ("peak GPU reserved GB", lambda r: f"{r['peak_reserved_gb']:.2f}"),
        ("checkpoint save s (step end to on_save)", lambda r: " ".join(f"{x:.2f}" for x in r["save_s"])),
        ("save_model s", lambda r: f"{r['save_model_s']:.2f}"),
        ("save_model + sync s", lambda r: f"{r.get('save_model_sync_s', float('nan')):.2f}"),
        ("train s (incl. save)", lambda r: f"{r['train_s']:.1f}"),
    ]
    for name, f in rows:
        print(f"| {name} | " + " | ".join(f(r) for r in runs) + " |")
    a, b = runs[0]["losses"], runs[1]["losses"] if len(runs) > 1 else {}
    if b:
        print("\n| step | " + " | ".join(r["impl"] for r in runs) + " | rel diff |\n|---|---|---|---|")
        for k in sorted(a, key=int):
            x, y = a[k], b.get(k, float("nan"))
            print(f"| {k} | {x:.4f} | {y:.4f} | {abs(x - y) / abs(x):.2e} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", nargs="+")
    ap.add_argument("--out")
    ap.add_argument("--dir", default="/tmp/trainer-gpu")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    a = ap.parse_args()
    if a.report:
        report(a.report)
    else:
        run(a)


if __name__ == "__main__":
    main()
