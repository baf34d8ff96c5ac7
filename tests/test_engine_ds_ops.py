"""DeepSpeed's optimizer, schedule and activation-checkpointing imports on the engine:
``deepspeed.ops.adam`` (``FusedAdam``, ``DeepSpeedCPUAdam``), ``deepspeed.runtime.lr_schedules`` and
``deepspeed.checkpointing``.

Oracles:

- Adam classes: real DeepSpeed cannot run them on this machine (``FusedAdam`` needs CUDA, ``DeepSpeedCPUAdam``
  a JIT-built op), so the oracle is the math its kernels implement: ``torch.optim.AdamW``/``Adam`` with the
  mapped hyper-parameters (step for step, ==), and the first step worked out by hand from the kernel
  formula. Signatures are DeepSpeed 0.19.8's (committed below; with ``.venv-ds``, read from it).
- Training: world 2, ZeRO-1/2/3, ``FusedAdam``/``DeepSpeedCPUAdam`` (optimizer offload) as client optimizer,
  a script-built ``WarmupLR`` as ``lr_scheduler=``, and a model whose middle block goes through
  ``deepspeed.checkpointing.checkpoint``: the losses and weights of the single-process plain-PyTorch
  reference (``_engine_ref.reference``: AdamW, no checkpointing).
- ``checkpoint``'s gradients: those of the unchecked model (dropout included); with ``.venv-ds``, real
  DeepSpeed's ``deepspeed.checkpointing.checkpoint`` gives the same gradients (and the same ``None``
  parameter gradients when no input requires grad).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run
from _engine_ref import BETAS, EPS, MAX_LR, WARMUP, WD, Tiny, config, full_params, make_model, reference
from torch import nn

from engine import checkpointing
from engine.config import ConfigError, parse_config
from engine.optim.adam import DeepSpeedCPUAdam, FusedAdam, FusedLamb
from engine.optim.scheduler import LRRangeTest

ROOT = Path(__file__).resolve().parents[1]
DS_PYTHON = ROOT / ".venv-ds" / "bin" / "python"
STEPS = 6

DS_SIGNATURES = {  # inspect.signature of DeepSpeed 0.19.8's classes: (name, default) after self
    "FusedAdam": [["params", None], ["lr", 0.001], ["bias_correction", True], ["betas", [0.9, 0.999]],
                  ["eps", 1e-08], ["adam_w_mode", True], ["weight_decay", 0.0], ["amsgrad", False],
                  ["set_grad_none", True]],
    "DeepSpeedCPUAdam": [["model_params", None], ["lr", 0.001], ["bias_correction", True],
                         ["betas", [0.9, 0.999]], ["eps", 1e-08], ["weight_decay", 0], ["amsgrad", False],
                         ["adamw_mode", True], ["fp32_optimizer_states", True]],
}  # fmt: skip


def _signature(cls: type) -> list[list[Any]]:
    out = []
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind is inspect.Parameter.KEYWORD_ONLY:  # the engine's extras (foreach/fused) come after
            break
        d = None if p.default is inspect.Parameter.empty else p.default
        out.append([p.name, list(d) if isinstance(d, tuple) else d])
    return out


def test_adam_signatures_are_deepspeeds() -> None:
    assert _signature(FusedAdam) == DS_SIGNATURES["FusedAdam"]
    assert _signature(DeepSpeedCPUAdam) == DS_SIGNATURES["DeepSpeedCPUAdam"]


def _params(seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(5, 3, generator=g)), nn.Parameter(torch.randn(4, generator=g))]


def _grads(step: int, params: list[nn.Parameter]) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("cls", [FusedAdam, DeepSpeedCPUAdam])
def test_adam_classes_step_as_torch_adam(cls: type, decoupled: bool) -> None:
    mode = {"adam_w_mode" if cls is FusedAdam else "adamw_mode": decoupled}
    hp = {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    ours, theirs = _params(0), _params(0)
    opt = cls(ours, **hp, **mode)
    ref = (torch.optim.AdamW if decoupled else torch.optim.Adam)(theirs, **hp)
    p0, g0 = ours[0].detach().clone(), None
    for step in range(5):
        _grads(step, ours)
        _grads(step, theirs)
        g0 = ours[0].grad.clone() if step == 0 else g0
        opt.step()
        ref.step()
        if step == 0:  # DeepSpeed's kernel, first step (m/(1-b1) = g, sqrt(v/(1-b2)) = |g|), by hand
            assert g0 is not None
            lr, wd, eps = hp["lr"], hp["weight_decay"], hp["eps"]
            g = g0 if decoupled else g0 + wd * p0
            want = p0 - lr * g / (g.abs() + eps) - (lr * wd * p0 if decoupled else 0)
            torch.testing.assert_close(ours[0].detach(), want, rtol=1e-6, atol=1e-7)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b), (cls, decoupled, step)
    assert opt.state_dict()["state"][0].keys() == ref.state_dict()["state"][0].keys()
    opt.zero_grad()
    assert ours[0].grad is None


def test_refusals_name_the_option() -> None:
    with pytest.raises(RuntimeError, match="does not support the AMSGrad"):
        FusedAdam(_params(0), amsgrad=True)
    with pytest.raises(NotImplementedError, match=r"bias_correction=False"):
        FusedAdam(_params(0), bias_correction=False)
    with pytest.raises(NotImplementedError, match=r"DeepSpeedCPUAdam\(bias_correction=False\)"):
        DeepSpeedCPUAdam([{"params": _params(0), "bias_correction": False}])
    half = [nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    half[0].grad = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="torch.bfloat16 params"):
        FusedAdam(half).step()
    with pytest.raises(NotImplementedError, match="FusedLamb"):
        FusedLamb(_params(0), lr=0.1)
    opt = DeepSpeedCPUAdam(_params(0), fp32_optimizer_states=False)  # fp32 params: states fp32 either way
    assert opt.fp32_optimizer_states is False and opt.adam_w_mode is True


def test_lr_range_test_hand_values() -> None:
    opt = torch.optim.SGD(_params(0), lr=1.0)
    s = LRRangeTest(opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_step_rate=2.0)
    assert opt.param_groups[0]["lr"] == 0.01
    seq = []
    for _ in range(8):
        s.step()
        seq.append(opt.param_groups[0]["lr"])
    assert seq[0] == pytest.approx(0.01 * (1 + 2 * 1 / 4)) and seq[7] == pytest.approx(0.01 * 5)
    opt2 = torch.optim.SGD(_params(0), lr=1.0)
    stair = LRRangeTest(opt2, 0.01, 4, 2.0, lr_range_test_staircase=True)
    got = []
    for _ in range(8):
        stair.step()
        got.append(opt2.param_groups[0]["lr"])
    assert got[:3] == [0.01] * 3 and got[3] == pytest.approx(0.03) and got[7] == pytest.approx(0.05)


# ---- activation checkpointing ----------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self, ckpt: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.drop, self.ckpt = nn.Linear(6, 9), nn.Linear(9, 6), nn.Dropout(0.3), ckpt

    def block(self, h: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.b(self.drop(torch.relu(self.a(h))))
        return z * (scale if scale is not None else 1.0), z.sum()

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        out = checkpointing.checkpoint(self.block, x, scale=scale) if self.ckpt else self.block(x, scale)
        return out[0].square().mean() + out[1]


def _net_grads(ckpt: bool, x_grad: bool) -> list[torch.Tensor | None]:
    net = _Net(ckpt)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).requires_grad_(x_grad)
    torch.manual_seed(5)
    loss = net(x, torch.tensor(0.5))
    if not loss.requires_grad:
        return [None for _ in net.parameters()]
    loss.backward()
    return [p.grad for p in net.parameters()] + [x.grad]


def test_checkpoint_gives_the_gradients_of_the_unchecked_model(tmp_path: Path) -> None:
    plain, ckpt = _net_grads(False, True), _net_grads(True, True)
    for a, b in zip(plain, ckpt, strict=True):
        assert a is not None and b is not None and torch.equal(a, b)  # dropout mask replayed
    # reentrant, as DeepSpeed's CheckpointFunction: no input requiring grad, no parameter gradients
    with pytest.warns(UserWarning, match="requires_grad"):
        assert _net_grads(True, False) == [None] * 4
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 2, "activation_checkpointing": {"cpu_checkpointing": True,
                              "partition_activations": True, "number_checkpoints": 2}}))  # fmt: skip
    assert not checkpointing.is_configured()
    try:
        checkpointing.configure(None, deepspeed_config=str(cfg), partition_activations=False)
        assert checkpointing.is_configured() and checkpointing.options["checkpoint_in_cpu"] is True
        assert checkpointing.options["partition_activations"] is False  # the keyword overrides the file
        for a, b in zip(plain, _net_grads(True, True), strict=True):
            assert a is not None and b is not None and torch.equal(a, b)  # inputs saved on the host
        with pytest.raises(NotImplementedError, match="model parallelism"):
            checkpointing.configure(type("Mpu", (), {"get_model_parallel_world_size": lambda self: 2})())
        with pytest.raises(ValueError, match="partitioned activations"):
            checkpointing.configure(None, contiguous_checkpointing=True)
    finally:
        checkpointing.configure(None)
        checkpointing.deepspeed_checkpointing_enabled = False
    assert parse_config(str(cfg), world_size=1).train_batch_size == 2  # the block is accepted
    with pytest.raises(ConfigError, match="did you mean cpu_checkpointing"):
        parse_config(
            {"train_batch_size": 1, "activation_checkpointing": {"cpu_checkpoint": True}}, world_size=1
        )


_DS_SCRIPT = r"""
from __future__ import annotations
import json, sys, inspect, torch
from typing import Any
from torch import nn
from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam
import deepspeed
checkpointing = deepspeed.checkpointing
src = json.loads(sys.stdin.read())
exec(src["code"])
sig = {c.__name__: _signature(c) for c in (FusedAdam, DeepSpeedCPUAdam)}
grads = [[None if g is None else g.tolist() for g in _net_grads(True, xg)] for xg in (True, False)]
print(json.dumps({"sig": sig, "grads": grads}))
"""


@pytest.mark.slow
@pytest.mark.deepspeed
def test_signatures_and_checkpoint_match_real_deepspeed() -> None:
    env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu"}
    env.pop("PYTHONPATH", None)
    code = "\n".join(inspect.getsource(f) for f in (_signature, _Net, _net_grads))
    proc = subprocess.run([str(DS_PYTHON), "-c", _DS_SCRIPT], input=json.dumps({"code": code}),
                          capture_output=True, text=True, timeout=300, env=env, cwd=tempfile.gettempdir(),
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["sig"] == DS_SIGNATURES
    mine = [[None if g is None else g.tolist() for g in _net_grads(True, xg)] for xg in (True, False)]
    assert got["grads"] == mine


def test_imports_resolve_under_the_launcher(tmp_path: Path) -> None:
    code = (
        "import deepspeed, engine\n"
        "from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam\n"
        "from deepspeed.ops.adam.fused_adam import FusedAdam as F\n"
        "from deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam as C\n"
        "from deepspeed.ops.lamb import FusedLamb\n"
        "from deepspeed.runtime.lr_schedules import WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest\n"
        "import deepspeed.runtime.lr_schedules, deepspeed.checkpointing\n"
        "from deepspeed.runtime.activation_checkpointing import checkpointing\n"
        "assert F is FusedAdam is engine.optim.adam.FusedAdam and C is DeepSpeedCPUAdam\n"
        "assert deepspeed.runtime.lr_schedules.WarmupLR is WarmupLR is engine.optim.scheduler.WarmupLR\n"
        "assert deepspeed.checkpointing is checkpointing is engine.checkpointing\n"
        "assert deepspeed.ops.adam.FusedAdam is FusedAdam\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    (tmp_path / "imports.py").write_text(code)
    cmd = [sys.executable, "-m", "engine.run", str(tmp_path / "imports.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir(), env=env, timeout=99)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok"]


# ---- training at world 2 ---------------------------------------------------------------------------
class _CkptTiny(Tiny):
    """``Tiny`` with its middle block through ``deepspeed.checkpointing.checkpoint`` (same init and math)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from deepspeed import checkpointing as ck

        h = self.emb(x)
        h = h + ck.checkpoint(lambda t: self.l2(torch.tanh(self.norm(self.l1(t)))), h)
        h = h + (0.5 * self.frozen(h) * self.scale).to(h.dtype)
        logits = self.head(h).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _ckpt_model() -> Tiny:
    torch.manual_seed(0)
    return _CkptTiny()


def _ds_train(rank: int, world: int, cfg: dict[str, Any], opt_cls: Any, *, script_sched: bool = False,
              make: Any = make_model) -> dict[str, Any]:  # fmt: skip
    import engine.run

    engine.run.activate()  # `import deepspeed` is the engine in this worker, as under `python -m engine.run`
    import deepspeed
    from _engine_ref import train
    from deepspeed.runtime.lr_schedules import WarmupLR

    model = make()
    opt = opt_cls([p for p in model.parameters() if p.requires_grad], lr=MAX_LR, betas=BETAS, eps=EPS,
                  weight_decay=WD)  # fmt: skip
    sched = None
    if script_sched:
        cfg = {k: v for k, v in cfg.items() if k != "scheduler"}
        sched = WarmupLR(opt, warmup_min_lr=0, warmup_max_lr=MAX_LR, warmup_num_steps=WARMUP,
                         warmup_type="linear")  # fmt: skip
    eng, _, _, got_sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    assert type(eng.optimizer.optimizer) is opt_cls and (sched is None or got_sched is sched)
    _, losses = train(rank, world, cfg, STEPS, engine_=eng)
    return {"losses": losses, "params": full_params(eng)}


def _dist_checks(rank: int, world: int) -> dict[str, Any]:
    import engine.run

    engine.run.activate()
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    out = {f"fused-s{s}": _ds_train(rank, world, config(s), FusedAdam) for s in (1, 2, 3)}
    out["cpuadam-offload-s2"] = _ds_train(rank, world, config(2, offload_optimizer={"device": "cpu"}),
                                          DeepSpeedCPUAdam)  # fmt: skip
    out["script-sched-s2"] = _ds_train(rank, world, config(2), FusedAdam, script_sched=True)
    for s in (1, 3):
        out[f"ckpt-s{s}"] = _ds_train(rank, world, config(s), FusedAdam, make=_ckpt_model)
    out["bf16-s3"] = _ds_train(rank, world, config(3, "bf16", gas=2), FusedAdam)["losses"]
    return out


@pytest.mark.dist
def test_world2_training_matches_plain_pytorch() -> None:
    ref = reference(STEPS)
    res = run(_dist_checks, 2)
    assert res[0] == res[1], "ranks disagree"
    for key, val in res[0].items():
        if key == "bf16-s3":
            assert val == pytest.approx(ref["losses"], rel=3e-2)
            continue
        assert val["losses"] == pytest.approx(ref["losses"], rel=1e-6), key
        for name, want in ref["params"].items():
            assert val["params"][name] == pytest.approx(want, rel=1e-5, abs=1e-6), (key, name)
