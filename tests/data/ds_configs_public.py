"""Generator of ``tests/data/ds_configs_public.json``: public DeepSpeed configs as the HF Trainer hands
them to ``deepspeed.initialize``, and what DeepSpeed 0.19.8 made of each at world size 2.

Each corpus entry: ``name``, ``source`` (GitHub URL at the commit read), ``raw`` (the file's JSON), ``filled``
(the dict ``deepspeed.initialize`` receives from the Trainer: every ``"auto"`` filled by transformers'
``HfTrainerDeepSpeedConfig.trainer_config_process``/``trainer_config_finalize`` and accelerate's
``DeepSpeedPlugin.set_mixed_precision`` + ``_prepare_deepspeed`` defaults, with ``TrainingArguments``
per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=1e-4, warmup_steps=2,
max_steps=10, bf16, or fp16 where the file enables fp16 itself; a model config with hidden_size 64; world
size 2), and
``deepspeed`` (what DeepSpeed did with ``filled`` on 2 gloo CPU ranks: ``deepspeed.initialize`` and one
training step of a small MLP, or the exception it raised; fp16 is refused by DeepSpeed's CPU accelerator, so
those entries record that) and ``deepspeed_config`` (what ``DeepSpeedConfig(filled)`` resolves at world 2, or
its refusal: the parse-level oracle of ``tests/test_engine_config.py``).

Steps (``.venv-ds``: DeepSpeed 0.19.8 + transformers + accelerate; ``.venv`` for the engine):

    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 .venv-ds/bin/python tests/data/ds_configs_public.py fill RAW_DIR
    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 .venv-ds/bin/python tests/data/ds_configs_public.py record  # ~6 min
    .venv/bin/python tests/data/ds_configs_public.py engine OUT.json   # the same run on the engine

``RAW_DIR`` holds ``NAME.json`` files and ``SOURCES`` (lines ``NAME OWNER/REPO PATH COMMIT``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "ds_configs_public.json"
WORLD = 2
MB, GAS, LR, WARMUP, STEPS, HIDDEN = 2, 1, 1e-4, 2, 10, 64


def _fp16_requested(raw: dict[str, Any]) -> bool:
    return (raw.get("fp16") or {}).get("enabled") is True


def fill(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` as the Trainer (transformers + accelerate) hands it to ``deepspeed.initialize`` at world 2."""
    from accelerate.utils import DeepSpeedPlugin
    from transformers import LlamaConfig, TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    class Args(TrainingArguments):
        @property
        def world_size(self) -> int:  # the Trainer's view on 2 ranks (no process group here)
            return WORLD

    fp16 = _fp16_requested(raw)
    args = Args(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=MB,
                gradient_accumulation_steps=GAS, learning_rate=LR, warmup_steps=WARMUP, max_steps=STEPS,
                report_to=[])  # fmt: skip
    # set after construction: TrainingArguments refuses bf16/fp16 on a CPU machine; on a GPU it takes them
    args.fp16, args.bf16 = fp16, not fp16
    hf = HfTrainerDeepSpeedConfig(copy.deepcopy(raw))
    hf.trainer_config_process(args)
    model = type("M", (), {"config": LlamaConfig(hidden_size=HIDDEN)})()
    # a ValueError lists numbers that differ from TrainingArguments (a user passes matching arguments);
    # every "auto" is filled before the check raises
    with contextlib.suppress(ValueError):
        hf.trainer_config_finalize(args, model, STEPS)
    plugin = DeepSpeedPlugin(hf_ds_config=hf)
    plugin.set_mixed_precision("fp16" if fp16 else "bf16")
    cfg = plugin.deepspeed_config
    if "optimizer" not in cfg:  # the Trainer builds its own AdamW (deepspeed_optim_sched)
        cfg["zero_allow_untested_optimizer"] = True
    kwargs = {"gradient_clipping": 1.0, "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
              "train_micro_batch_size_per_gpu": MB,
              "train_batch_size": MB * plugin.get_value("gradient_accumulation_steps") * WORLD}  # fmt: skip
    plugin.deepspeed_config_process(must_match=False, **kwargs)  # accelerate's _prepare_deepspeed
    return cfg


def _run_one(cfg: dict[str, Any], ds: Any) -> dict[str, Any]:
    """``initialize`` + one step of a small MLP, called as the Trainer calls it; what decides training."""
    import torch
    from torch import nn
    from transformers import get_linear_schedule_with_warmup

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    kw: dict[str, Any] = {"model": model, "config_params": copy.deepcopy(cfg)}
    if "optimizer" in cfg:
        kw["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
        if "scheduler" not in cfg:
            kw["lr_scheduler"] = lambda o: get_linear_schedule_with_warmup(o, WARMUP, STEPS)
    else:
        kw["optimizer"] = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    try:
        eng, opt, _, sched = ds.initialize(**kw)
    except Exception as e:  # noqa: BLE001 - recorded: what a user would see
        return {"refused": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    out: dict[str, Any] = {
        "train_batch_size": eng.train_batch_size(),
        "micro_batch": eng.train_micro_batch_size_per_gpu(),
        "gas": eng.gradient_accumulation_steps(),
        "zero_stage": int(eng.zero_optimization_stage()),
        "fp16": bool(eng.fp16_enabled()),
        "bf16": bool(eng.bfloat16_enabled()),
        "gradient_clipping": float(eng.gradient_clipping()),
        "scheduler": type(sched).__name__ if sched is not None else None,
    }
    g = opt.param_groups[0]
    out["group"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                    if k in ("lr", "betas", "eps", "weight_decay")}  # fmt: skip
    dtype = next(iter(eng.module.parameters())).dtype
    try:
        x = torch.randn(MB, 8, generator=torch.Generator().manual_seed(1))
        loss = eng(x.to(dtype)).float().pow(2).mean()
        eng.backward(loss)
        eng.step()
        out["loss"] = round(float(loss), 4)
        out["lr_after_step"] = float(opt.param_groups[0]["lr"])
    except Exception as e:  # noqa: BLE001
        out["step_failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    if hasattr(eng, "destroy"):
        eng.destroy()
    return out


def _worker(rank: int, world: int, cfgs: list[dict[str, Any]], which: str) -> list[dict[str, Any]]:
    import logging

    logging.disable(logging.WARNING)
    if which == "deepspeed":
        import deepspeed
        import deepspeed.comm.torch as dct

        dct.build_shm_op = lambda: (
            None
        )  # no JIT-built shared-memory op on CPU (as tests/test_engine_hf_trainer)
        ds: Any = deepspeed
    else:
        import engine as ds
    return [_run_one(c, ds) for c in cfgs]


def run(cfgs: list[dict[str, Any]], which: str) -> list[dict[str, Any]]:
    sys.path.insert(0, str(HERE.parent))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from _dist import run as spawn

    results = spawn(_worker, WORLD, cfgs, which)
    assert results[0] == results[1] or all("refused" in r for r in results[0]), "ranks disagree"
    return results[0]


def ds_parse(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed 0.19.8's ``DeepSpeedConfig`` on ``cfg`` at world 2: what it resolves, or its refusal."""
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        c = DeepSpeedConfig(copy.deepcopy(cfg))
    except Exception as e:  # noqa: BLE001
        return {"refused": f"{type(e).__name__}: {' | '.join(str(e).splitlines()[:3])[:300]}"}
    z = c.zero_config
    return {
        "batch": [c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps],
        "stage": int(z.stage),
        "offload_optimizer": getattr(z.offload_optimizer, "device", None),
        "offload_param": getattr(z.offload_param, "device", None),
        "optimizer": [c.optimizer_name, c.optimizer_params],
        "scheduler": [c.scheduler_name, c.scheduler_params],
        "fp16": c.float16_config.enabled,
        "bf16": c.bfloat16_config.enabled,
        "gradient_clipping": c.gradient_clipping,
    }


def _parse_all(cfgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``ds_parse`` for each config in one process: a 1-rank gloo group, DeepSpeed told the world is 2."""
    import deepspeed.comm as dist
    import deepspeed.runtime.config as rc
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
    dist.init_distributed("gloo", auto_mpi_discovery=False)
    rc.dist.get_world_size = lambda *a, **k: WORLD  # what DeepSpeedConfig reads the world size from
    return [ds_parse(c) for c in cfgs]


def main(argv: list[str]) -> None:
    if argv[0] == "fill":
        raw_dir = Path(argv[1])
        entries = []
        for line in (raw_dir / "SOURCES").read_text().splitlines():
            name, repo, path, commit = line.split()
            raw = json.loads((raw_dir / f"{name}.json").read_text())
            src = f"https://github.com/{repo}/blob/{commit}/{path}"
            entries.append({"name": name, "source": src, "raw": raw, "filled": fill(raw)})
        CORPUS.write_text(_dump(entries))
    elif argv[0] == "record":
        entries = json.loads(CORPUS.read_text())
        for e, r in zip(entries, run([e["filled"] for e in entries], "deepspeed"), strict=True):
            e["deepspeed"] = r
        for e, r in zip(entries, _parse_all([e["filled"] for e in entries]), strict=True):
            e["deepspeed_config"] = r
        CORPUS.write_text(_dump(entries))
    elif argv[0] == "parse":  # only the DeepSpeedConfig part of ``record`` (seconds, not minutes)
        entries = json.loads(CORPUS.read_text())
        for e, r in zip(entries, _parse_all([e["filled"] for e in entries]), strict=True):
            e["deepspeed_config"] = r
        CORPUS.write_text(_dump(entries))
    elif argv[0] == "engine":
        entries = json.loads(CORPUS.read_text())
        res = run([e["filled"] for e in entries], "engine")
        Path(argv[1]).write_text(
            json.dumps([{"name": e["name"], "engine": r} for e, r in zip(entries, res, strict=True)])
        )
    else:
        raise SystemExit(__doc__)


def _dump(entries: list[dict[str, Any]]) -> str:
    """One line per entry (a compact, diffable file)."""
    return "[\n" + ",\n".join(json.dumps(e, sort_keys=False) for e in entries) + "\n]\n"


if __name__ == "__main__":
    main(sys.argv[1:])
