#!/usr/bin/env python3
"""Build the large benchmark inputs: real DeepSpeed ZeRO-2/3 checkpoints of GPT-style models (CPU, gloo).

Run with the dev venv (real DeepSpeed lives only there); ``bench/run.py`` calls it for you:

    .venv-ds/bin/python bench/make_inputs.py                 # the default set -> bench/data/<name>/
    .venv-ds/bin/python bench/make_inputs.py --only gpt400m_z3_w2 --list

Each input is one ``torchrun --standalone`` launch re-entering this file (``--worker SPEC``), reusing
``fixtures/make_fixtures.py``'s DeepSpeed helpers (config builder, CPU fp16 capability patch). An input
whose folder holds ``done.json`` is cached and skipped. Models are built under ``deepspeed.zero.Init``
for ZeRO-3 so no rank ever holds the whole fp32 model. Training is bf16 with torch AdamW, batch 1 x 16
tokens, ``steps`` steps; ``save_steps`` lists the steps after which a checkpoint is saved (``0`` = before
any step: fp32 masters but no Adam moments yet, used for the 1B point where Adam state would not fit in
this machine's RAM at world 2).

``gpt400m_dcp_w2`` is a torch DCP checkpoint instead (main venv, torch only): the same 400M GPT trained one
AdamW step under real FSDP2 (``fully_shard`` per block and the root, CPU/gloo, world 2, spawned ranks on a
``file://`` store), saved as accelerate's FSDP2 ``SHARDED_STATE_DICT`` path does:
``checkpoint_0/pytorch_model_fsdp_0/`` (``{"model": msd}``) and ``checkpoint_0/optimizer_0/``
(``{"optimizer": osd}``), so torch's ``dcp_to_torch_save`` and ``accelerate merge-weights`` can both run
on the model half. ``.venv/bin/python bench/make_inputs.py --only gpt400m_dcp_w2``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DATA = HERE / "data"
sys.path.insert(0, str(REPO / "fixtures"))

import make_fixtures as mf  # noqa: E402  (fixtures helper: DeepSpeed config + CPU patches)

# name -> model shape, ZeRO stage, world, save_steps
MODELS = {
    "gpt16m": {"vocab": 50304, "dim": 256, "layers": 4, "seq": 16},
    "gpt100m": {"vocab": 50304, "dim": 768, "layers": 9, "seq": 16},
    "gpt400m": {"vocab": 50304, "dim": 1024, "layers": 28, "seq": 16},
    "gpt1b": {"vocab": 50304, "dim": 2048, "layers": 20, "seq": 16},
    "gpt48l": {"vocab": 4096, "dim": 256, "layers": 48, "seq": 16},  # many small tensors: per-item costs
}
INPUTS = {
    "gpt16m_z3_w2": {"model": "gpt16m", "stage": 3, "world": 2, "save_steps": [1]},  # bench/s3_bench.py
    "gpt100m_z3_w2": {"model": "gpt100m", "stage": 3, "world": 2, "save_steps": [1]},
    "gpt400m_z3_w2": {"model": "gpt400m", "stage": 3, "world": 2, "save_steps": [1, 2]},
    "gpt400m_z3_w4": {"model": "gpt400m", "stage": 3, "world": 4, "save_steps": [1]},
    "gpt400m_z2_w2": {"model": "gpt400m", "stage": 2, "world": 2, "save_steps": [1]},
    "gpt1b_z3_w2": {"model": "gpt1b", "stage": 3, "world": 2, "save_steps": [0]},
}
DEFAULT = [n for n in INPUTS if n != "gpt16m_z3_w2"]  # the object-store bench builds its own
DCP_INPUTS = {
    "gpt400m_dcp_w2": {"model": "gpt400m", "world": 2},
    "gpt48l_dcp_w4": {"model": "gpt48l", "world": 4},
}
"""Built with the main venv (torch's FSDP2 + DCP), not DeepSpeed."""


def n_params(shape: dict[str, int]) -> int:
    v, d, n, t = shape["vocab"], shape["dim"], shape["layers"], shape["seq"]
    per_layer = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return v * d + t * d + n * per_layer + 2 * d


# ---- launcher ---------------------------------------------------------------------------------------
def build(name: str, *, force: bool = False) -> Path:
    out = DATA / name
    if (out / "done.json").is_file() and not force:
        return out
    spec = dict(INPUTS[name], name=name, shape=MODELS[INPUTS[name]["model"]])
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ, DS_BUILD_OPS="0", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0")  # fmt: skip
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--standalone", f"--nproc_per_node={spec['world']}", str(Path(__file__).resolve()),
           "--worker", json.dumps(spec), "--out", str(out)]  # fmt: skip
    t0 = time.time()
    log = DATA / f".{name}.log"
    with open(log, "w") as fh:
        p = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=str(REPO))
    if p.returncode != 0 or not (out / "done.json").is_file():
        raise SystemExit(f"building {name} failed (rc {p.returncode}); log: {log}")
    log.unlink()
    print(f"built {name} in {time.time() - t0:.0f}s ({mf.dir_size(out) / 1e9:.2f} GB)", flush=True)
    return out


# ---- worker (inside torchrun) -------------------------------------------------------------------------
def gpt(shape: dict[str, int]):  # type: ignore[no-untyped-def]
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    V, D, L, T = shape["vocab"], shape["dim"], shape["layers"], shape["seq"]
    H = max(1, D // 64)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

        def forward(self, x):  # type: ignore[no-untyped-def]
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
            x = x + self.proj(a)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(D)
            self.head = nn.Linear(D, V, bias=False)
            self.head.weight = self.wte.weight  # tied

        def forward(self, ids, tgt):  # type: ignore[no-untyped-def]
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))[None]
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.float().reshape(-1, V), tgt.reshape(-1))

    return GPT()


def worker(spec: dict, out: Path) -> None:  # type: ignore[type-arg]
    import deepspeed
    import deepspeed.comm.torch as ds_comm_torch
    import torch
    import torch.distributed as dist

    mf.patch_cpu_fp16()
    ds_comm_torch.build_shm_op = lambda: None  # as in make_fixtures: plain gloo, no shm op
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234)
    cfg = mf.ds_config(mf.case(spec["name"], spec["stage"], "bf16", spec["world"], batch=1, lr=1e-4))
    cfg["scheduler"]["params"]["warmup_num_steps"] = 1
    if spec["stage"] == 3:
        with deepspeed.zero.Init(config_dict_or_path=copy.deepcopy(cfg)):
            model = gpt(spec["shape"])
    else:
        model = gpt(spec["shape"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=copy.deepcopy(cfg))
    T, V = spec["shape"]["seq"], spec["shape"]["vocab"]
    steps = max(spec["save_steps"])
    if 0 in spec["save_steps"]:
        engine.save_checkpoint(str(out), tag="global_step0")
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(step * 10 + rank)
        ids = torch.randint(0, V, (1, T), generator=g)
        loss = engine(ids, torch.randint(0, V, (1, T), generator=g))
        engine.backward(loss)
        engine.step()
        if step in spec["save_steps"]:
            engine.save_checkpoint(str(out), tag=f"global_step{step}")
    dist.barrier()
    if rank == 0:
        tags = [f"global_step{s}" for s in spec["save_steps"]]
        info = {"params": n_params(spec["shape"]), "spec": spec, "tags": tags,
                "deepspeed": deepspeed.__version__}  # fmt: skip
        (out / "done.json").write_text(json.dumps(info, indent=1))
    dist.barrier()


# ---- the DCP input (FSDP2, torch only) ----------------------------------------------------------------
def build_dcp(name: str, *, force: bool = False) -> Path:
    import tempfile

    import torch.multiprocessing as tmp_mp

    out = DATA / name
    if (out / "done.json").is_file() and not force:
        return out
    spec = dict(DCP_INPUTS[name], name=name, shape=MODELS[DCP_INPUTS[name]["model"]])
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="zdcp-") as tmp:
        tmp_mp.spawn(dcp_worker, args=(spec, str(out), f"{tmp}/store"), nprocs=spec["world"], join=True)
    layout = "accelerate (FSDP2 SHARDED_STATE_DICT)"
    info = {"params": n_params(spec["shape"]), "spec": spec, "layout": layout, "folder": "checkpoint_0",
            "seconds": round(time.time() - t0, 1)}  # fmt: skip
    (out / "done.json").write_text(json.dumps(info, indent=1))
    print(f"built {name} in {time.time() - t0:.0f}s ({mf.dir_size(out) / 1e9:.2f} GB)", flush=True)
    return out


def dcp_worker(rank: int, spec: dict, out: str, store: str) -> None:  # type: ignore[type-arg]
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=spec["world"])
    torch.manual_seed(1234)
    model = gpt(spec["shape"])
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    T, V = spec["shape"]["seq"], spec["shape"]["vocab"]
    g = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(0, V, (1, T), generator=g)
    model(ids, torch.randint(0, V, (1, T), generator=g)).backward()
    opt.step()
    root = Path(out) / "checkpoint_0"
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(root / "pytorch_model_fsdp_0"))
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(root / "optimizer_0"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="input names (default: the DeepSpeed ones)")
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(json.loads(a.worker), Path(a.out))
        return
    names = a.only or DEFAULT
    for n in names:
        spec = INPUTS.get(n) or DCP_INPUTS[n]
        if a.list:
            print(f"{n:16} {n_params(MODELS[spec['model']]) / 1e6:8.1f}M params  {spec}")
            continue
        if n in DCP_INPUTS:
            build_dcp(n, force=a.force)
        else:
            build(n, force=a.force)


if __name__ == "__main__":
    main()
