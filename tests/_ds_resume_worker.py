"""Worker of tests/test_reshard_deepspeed.py, run by the dev venv's ``torchrun --standalone`` (real
DeepSpeed).

Trains fixtures/make_fixtures.py's toy model with a *global* batch that is the same whatever the world size
(rank r of W takes rows [r*G/W, (r+1)*G/W) of step s's global batch), so losses can be compared across world
sizes. ``--spec`` JSON: stage, dtype, world, groups, sub_group_size, global_batch, first, last (steps
[first, last)), load (folder to ``load_checkpoint`` before training, or null), save (folder to
``save_checkpoint`` after, or at step ``save_at``), model ("toy" or "engine_tiny"), out (JSON file rank 0
writes: {"losses": [...], "loaded": ...}).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import make_fixtures as mf  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    spec = json.loads(ap.parse_args().spec)
    import deepspeed
    import torch
    import torch.distributed as dist

    mf.patch_cpu_fp16()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == spec["world"], (world, spec)
    if spec.get("model") == "engine_tiny":  # the engine tests' model, optimizer, config and data
        from tests import _engine_ref as er

        model = er.make_model(seed=11)
        opt = er.optimizer(model)
        cfg = er.config(spec["stage"])
    else:
        case = mf.case(
            "resume",
            spec["stage"],
            spec["dtype"],
            world,
            groups=spec["groups"],
            sub_group_size=spec.get("sub_group_size"),
            batch=spec["global_batch"] // world,
        )
        torch.manual_seed(case["seed"])
        model = mf.build_toy(case["toy"])
        groups, _ = mf.param_groups(model, case)
        opt = torch.optim.AdamW(groups, lr=case["lr"], betas=(0.9, 0.95), eps=1e-8)
        cfg = mf.ds_config(case)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=copy.deepcopy(cfg))
    loaded = None
    if spec.get("load"):
        path, client = engine.load_checkpoint(spec["load"])
        loaded = {"path": path, "global_steps": engine.global_steps, "note": (client or {}).get("note")}
    losses = []
    for step in range(spec["first"], spec["last"]):
        if spec.get("save") and spec.get("save_at") == step:
            engine.save_checkpoint(spec["save"], client_state={"note": "resume-test"})
        if spec.get("model") == "engine_tiny":
            ids, tgt = er.batch(step)
        else:
            g = torch.Generator().manual_seed(777 + step)
            ids = torch.randint(
                0, case["toy"]["vocab"], (spec["global_batch"], case["toy"]["seq"]), generator=g
            )
            tgt = torch.randint(
                0, case["toy"]["vocab"], (spec["global_batch"], case["toy"]["seq"]), generator=g
            )
        per = ids.shape[0] // world
        loss = engine(ids[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per])
        engine.backward(loss)
        engine.step()
        red = loss.detach().float().clone()
        dist.all_reduce(red)
        losses.append(float(red) / world)
    if spec.get("save") and spec.get("save_at") is None:
        engine.save_checkpoint(spec["save"], client_state={"note": "resume-test"})
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps({"losses": losses, "loaded": loaded}))
    dist.barrier()
    dist.destroy_process_group()
    # leave without interpreter finalization: a gloo worker thread may still be dropping a finished
    # collective's tensors then, which aborts the process (SIGABRT) after the work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
