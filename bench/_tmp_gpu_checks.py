"""Temporary (perf helper): CUDA offload checks with gradient accumulation + a profile of the offload step."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "demo"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _engine_ref as R

import engine


def train(cfg, steps, gas):
    model = R.make_model()
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=R.MAX_LR,
        betas=R.BETAS,
        eps=R.EPS,
        weight_decay=R.WD,
    )
    eng, _, _, _ = engine.initialize(model=model, optimizer=opt, config=cfg)
    losses = []
    for k in range(steps):
        x, y = R.batch(k)
        mb = R.BATCH // gas
        tot = 0.0
        for g in range(gas):
            loss = eng(x[g * mb : (g + 1) * mb].cuda(), y[g * mb : (g + 1) * mb].cuda())
            eng.backward(loss)
            eng.step()
            tot += loss.item()
        losses.append(tot / gas)
    return eng, losses


ref = R.reference(6)
for stage in (1, 2, 3):
    for gas in (1, 2):
        zero = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        eng, losses = train(R.config(stage, gas=gas, **zero), 6, gas)
        full = R.full_params(eng)
        err = max(R.rel_err(full[n], w) for n, w in ref["params"].items())
        lerr = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
        print(
            f"offload stage {stage} gas {gas}: param rel err {err:.2e} loss rel err {lerr:.2e}",
            "OK" if err < 1e-5 and lerr < 1e-5 else "FAIL",
            flush=True,
        )

if "--profile" in sys.argv:
    import argparse

    from engine_bench import SIZES, ds_config
    from gpt import GPT

    args = argparse.Namespace(stage=3, offload=True, micro=8, dtype="bf16")
    c = SIZES["355m"]
    torch.manual_seed(0)
    model = GPT(c)
    eng, _, _, _ = engine.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=ds_config(args)
    )
    x = torch.randint(0, c.vocab_size, (8, c.block_size), device="cuda")

    def step():
        loss = eng(x, x)
        eng.backward(loss)
        eng.step()
        return loss.item()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    for phase in range(2):
        t = [time.perf_counter()]
        loss = eng(x, x)
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        eng.backward(loss)
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        eng.step()
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        print("fwd %.4f bwd %.4f step %.4f" % tuple(b - a for a, b in zip(t, t[1:])), flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=40))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=40))
