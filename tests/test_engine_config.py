"""engine.config: DeepSpeed JSON → typed config.

Oracles: hand-written expected values (the origin config's numbers, DeepSpeed's documented defaults and batch
arithmetic), and — when the dev venv exists — DeepSpeed 0.19.8's own config code (batch resolution, ZeRO /
fp16 models) run in that venv.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import subprocess
import warnings
from pathlib import Path

import pytest

from engine import config as C
from engine.config import ConfigError, EngineConfig, parse_config

DATA = Path(__file__).parent / "data"
ORIGIN = DATA / "origin_ds_config.json"
DS_PYTHON = Path(__file__).resolve().parents[1] / ".venv-ds" / "bin" / "python"


def _parse(d: dict, world: int = 1) -> EngineConfig:
    return parse_config({"train_batch_size": world, **d}, world_size=world)


def _err(d: dict | str | Path, match: str, world: int = 1) -> ConfigError:
    with pytest.raises(ConfigError, match=match) as info:
        parse_config(d, world_size=world)
    return info.value


# --------------------------------------------------------------------------------------------- origin


def test_origin_config_verbatim_with_deprecation_warnings() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = parse_config(ORIGIN, world_size=4)
    deprecations = sorted(str(w.message).split()[0] for w in caught if w.category is DeprecationWarning)
    assert deprecations == [
        "zero_optimization.cpu_offload",
        "zero_optimization.cpu_offload_params",
        "zero_optimization.cpu_offload_use_pin_memory",
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
    ]
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        8,
        2,
        1,
    )
    assert cfg.precision == "fp16" and cfg.zero_stage == 3
    assert cfg.offload_optimizer and cfg.offload_param
    z = cfg.zero_optimization
    assert z.offload_param == z.offload_optimizer == C.OffloadConfig(device="cpu", pin_memory=True)
    assert z.overlap_comm and z.contiguous_gradients
    assert z.sub_group_size == 100_000_000_000_000 and z.reduce_bucket_size == 1_000_000
    assert z.stage3_prefetch_bucket_size == 940_000 and z.stage3_param_persistence_threshold == 10_000
    assert z.stage3_max_live_parameters == z.stage3_max_reuse_distance == 1_000_000_000
    assert z.stage3_gather_16bit_weights_on_model_save is True
    f = cfg.fp16
    assert (
        f.enabled,
        f.loss_scale,
        f.loss_scale_window,
        f.initial_scale_power,
        f.hysteresis,
        f.min_loss_scale,
    ) == (True, 0.0, 1000, 16, 2, 1.0)
    assert f.dynamic_loss_scale
    o = cfg.optimizer
    assert o is not None and o.type == "AdamW" and o.adam_w_mode
    assert (o.lr, o.betas, o.eps, o.weight_decay) == (3e-5, (0.8, 0.999), 1e-8, 3e-7)
    assert cfg.scheduler == C.SchedulerConfig(
        type="WarmupLR", params={"warmup_min_lr": 0.0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500}
    )
    assert cfg.steps_per_print == 2000 and cfg.gradient_clipping == 1.0 and not cfg.wall_clock_breakdown
    assert cfg.to_dict() == json.loads(ORIGIN.read_text())
    cfg.to_dict()["fp16"]["enabled"] = False  # a copy: the config is unaffected
    assert cfg.to_dict()["fp16"]["enabled"] is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.gradient_clipping = 0.0  # type: ignore[misc]


def test_input_forms() -> None:
    text = ORIGIN.read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert parse_config(text, world_size=1) == parse_config(str(ORIGIN), world_size=1)
    _err(DATA / "nope.json", "does not exist")
    _err("{not json", "not valid JSON")
    with pytest.raises(ConfigError, match="world_size"):
        parse_config({"train_batch_size": 1}, world_size=0)


# ---------------------------------------------------------------------------------------- batch sizes


@pytest.mark.parametrize(
    ("given", "world", "want"),
    [
        (
            {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
            4,
            (32, 4, 2),
        ),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, (32, 4, 2)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 3, (45, 3, 5)),
        ({"train_batch_size": 12}, 3, (12, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 2}, 3, (6, 2, 1)),
        ({"train_batch_size": 1e1, "train_micro_batch_size_per_gpu": "5"}, 2, (10, 5, 1)),
    ],
)
def test_batch_resolution(given: dict, world: int, want: tuple[int, int, int]) -> None:
    cfg = parse_config(given, world_size=world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == want


def test_batch_errors_carry_deepspeed_text() -> None:
    e = _err(
        {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1},
        r"train_batch_size is not equal to micro_batch_per_gpu \* gradient_acc_step \* world_size "
        r"16 != 2 \* 1 \* 4",
        world=4,
    )
    assert e.key == "train_batch_size"
    _err(
        {"train_batch_size": 10}, r"10 != 3 \* 1 \* 3", world=3
    )  # DeepSpeed's floor division, then the check
    _err({"gradient_accumulation_steps": 2}, "Either train_batch_size or train_micro_batch_size_per_gpu")
    _err(
        {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 8},
        "gradient_accumulation_steps: resolved to 0",
    )
    _err({"train_micro_batch_size_per_gpu": 0}, "has to be greater than 0")
    _err({"train_batch_size": 2.5}, "expected an integer")


# ------------------------------------------------------------------------------- errors and leniency


def test_auto_placeholder_is_refused_with_its_path() -> None:
    e = _err({"train_micro_batch_size_per_gpu": "auto"}, "'auto' is an HF Trainer placeholder; give a number")
    assert e.key == "train_micro_batch_size_per_gpu"
    e = _err(
        {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"betas": "auto"}}}, "placeholder"
    )
    assert e.key == "optimizer.params.betas"


@pytest.mark.parametrize(
    ("d", "message"),
    [
        (
            {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": 5}},
            "zero_optimization.stage3_prefetch_bucket_sise: unknown key; "
            "did you mean stage3_prefetch_bucket_size?",
        ),
        ({"fp16": {"enabled": True, "loss_scale_windw": 10}}, "did you mean loss_scale_window?"),
        (
            {"optimizer": {"type": "AdamW", "params": {"beta": [0.9, 0.99]}}},
            "optimizer.params.beta: unknown key; did you mean betas?",
        ),
        (
            {"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}},
            "optimizer.params.betas: unknown key",
        ),
        ({"optimizer": {"type": "AdamX"}}, "optimizer.type: unknown value 'AdamX'; did you mean Adam?"),
        (
            {"scheduler": {"type": "WarmUpLR"}},
            "scheduler.type: unknown value 'WarmUpLR'; did you mean WarmupLR?",
        ),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max": 1}}}, "did you mean warmup_max_lr?"),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memry": True}}},
            "zero_optimization.offload_optimizer.pin_memry: unknown key; did you mean pin_memory?",
        ),
    ],
)
def test_unknown_keys_name_the_nearest(d: dict, message: str) -> None:
    e = _err({"train_batch_size": 1, **d}, message.replace("?", r"\?").replace(".", r"\."))
    assert e.key is not None and e.key in str(e)


@pytest.mark.parametrize(
    ("d", "key"),
    [
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}},
            "zero_optimization.offload_param.device",
        ),
        ({"pipeline": {"stages": 2}}, "pipeline"),
        ({"moe": {"enabled": True}}, "moe"),
        ({"tensorboard": {"enabled": True, "output_path": "x"}}, "tensorboard"),
        ({"flops_profiler": {"enabled": True}}, "flops_profiler"),
        ({"amp": {"enabled": True}}, "amp"),
        (
            {"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}},
            "zero_optimization.zero_quantized_gradients",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
            "zero_optimization.offload_optimizer.ratio",
        ),
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type"),
        ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad"),
        ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op"),
        ({"checkpoint": {"load_universal": True}}, "checkpoint.load_universal"),
    ],
)
def test_features_the_engine_lacks_are_refused(d: dict, key: str) -> None:
    e = _err({"train_batch_size": 1, **d}, "not supported by the engine")
    assert e.key == key and str(e).startswith(key)


def test_inactive_foreign_blocks_are_accepted() -> None:
    cfg = _parse(
        {
            "tensorboard": {"enabled": False, "output_path": "runs"},
            "activation_checkpointing": {
                "partition_activations": False,
                "cpu_checkpointing": False,
                "number_checkpoints": None,
            },
            "memory_breakdown": True,  # logging only
            "gradient_allreduce_op": "mean",
            "checkpoint": {"tag_validation": "Warn"},
            "zero_optimization": {
                "stage": 3,
                "stage3_model_persistence_threshold": 10,
                "load_from_fp32_weights": True,
                "offload_optimizer": {"device": "cpu", "nvme_path": None, "buffer_count": 4},
            },
        }
    )
    assert cfg.zero_stage == 3 and cfg.offload_optimizer


def test_precision_blocks() -> None:
    _err(
        {"train_batch_size": 1, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
        "bfloat16 and fp16 modes cannot be simultaneously enabled",
    )
    with pytest.warns(DeprecationWarning, match="bfloat16"):
        cfg = _parse({"bfloat16": {"enabled": True}})
    assert cfg.precision == "bf16" and cfg.bf16.check_grad_overflow
    assert _parse({}).precision == "fp32" and not _parse({}).fp16.dynamic_loss_scale
    static = _parse({"fp16": {"enabled": True, "loss_scale": 128}}).fp16
    assert static.loss_scale == 128.0 and not static.dynamic_loss_scale
    _err(
        {"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale_window": 0}}, "must be > 0 when dynamic"
    )
    _parse({"fp16": {"enabled": False, "loss_scale_window": 0}})  # only checked when dynamic, as DeepSpeed
    _err({"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale": -1}}, "must be >= 0")
    _err({"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale": True}}, "expected a number")


def test_deprecated_and_replacement_together_is_an_error() -> None:
    with pytest.warns(DeprecationWarning):
        _err(
            {
                "train_batch_size": 1,
                "zero_optimization": {
                    "stage": 3,
                    "cpu_offload": True,
                    "offload_optimizer": {"device": "cpu"},
                },
            },
            "cannot be given together with its replacement offload_optimizer",
        )


def test_pin_memory_mapping_and_offload_rules() -> None:
    with pytest.warns(DeprecationWarning):
        z = _parse(
            {
                "zero_optimization": {
                    "stage": 3,
                    "cpu_offload": True,
                    "cpu_offload_param": True,
                    "cpu_offload_use_pin_memory": False,
                }
            }
        ).zero_optimization
    assert z.offload_param == z.offload_optimizer == C.OffloadConfig(device="cpu", pin_memory=False)
    with pytest.warns(DeprecationWarning):
        z = _parse({"zero_optimization": {"stage": 2, "cpu_offload": False}}).zero_optimization
    assert z.offload_optimizer is None
    cfg = _parse({"zero_optimization": {"stage": 3, "offload_param": {"device": "none"}}})
    assert not cfg.offload_param and cfg.zero_optimization.offload_param is not None
    _err(
        {"train_batch_size": 1, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        "parameter offload needs stage 3",
    )


def test_zero_defaults_aliases_and_coercion() -> None:
    z = _parse({}).zero_optimization
    assert z == C.ZeroConfig()
    assert z.stage == 0 and not z.overlap_comm and z.reduce_bucket_size == 500_000_000
    assert _parse({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm  # stage-3 default
    assert not _parse(
        {"zero_optimization": {"stage": 3, "overlap_comm": "false"}}
    ).zero_optimization.overlap_comm
    z2 = _parse(
        {"zero_optimization": {"stage": "2", "prefetch_bucket_size": "5e8", "reduce_bucket_size": 2e8}}
    ).zero_optimization
    assert z2.stage3_prefetch_bucket_size == 500_000_000 and z2.reduce_bucket_size == 200_000_000
    _err({"train_batch_size": 1, "zero_optimization": {"stage": 4}}, r"stage: must be <= 3")
    _err({"train_batch_size": 1, "zero_optimization": {"reduce_bucket_size": 1.5}}, "expected an integer")
    _err({"train_batch_size": 1, "zero_optimization": {"reduce_bucket_size": True}}, "expected a number")
    _err(
        {
            "train_batch_size": 1,
            "zero_optimization": {"stage3_max_live_parameters": 1, "max_live_parameters": 2},
        },
        "give only one",
    )
    with pytest.warns(DeprecationWarning):
        assert _parse({"zero_optimization": True}).zero_stage == 1


def test_optimizer_block_semantics() -> None:
    adam = _parse({"optimizer": {"type": "adam", "params": {"lr": "1e-4", "weight_decay": 0.1}}}).optimizer
    assert adam is not None and adam.type == "Adam" and adam.adam_w_mode  # DeepSpeed: Adam means AdamW
    assert (adam.lr, adam.betas, adam.eps, adam.weight_decay) == (1e-4, (0.9, 0.999), 1e-8, 0.1)
    l2 = _parse({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}).optimizer
    assert l2 is not None and not l2.adam_w_mode and l2.weight_decay == 0.0
    forced = _parse({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}).optimizer
    assert forced is not None and forced.adam_w_mode
    torch_adamw = _parse({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}).optimizer
    assert torch_adamw is not None and torch_adamw.weight_decay == 0.01  # torch.optim.AdamW's default
    sgd = _parse(
        {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}}
    ).optimizer
    assert sgd is not None and (sgd.type, sgd.momentum, sgd.nesterov, sgd.dampening) == (
        "SGD",
        0.9,
        True,
        0.0,
    )
    assert sgd.params == {"lr": 0.1, "momentum": 0.9, "nesterov": True}
    _err(
        {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"nesterov": True}}},
        "Nesterov momentum",
    )
    _err(
        {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}},
        "please switch to using the deepspeed parameter 'gradient_clipping'",
    )
    _err({"train_batch_size": 1, "optimizer": {"params": {}}}, "optimizer.type: required")
    _err(
        {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}},
        "list of 2 numbers",
    )


def test_scheduler_block_semantics() -> None:
    s = _parse(
        {
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {"total_num_steps": 1e3, "warmup_num_steps": "10", "cos_min_ratio": 0},
            }
        }
    ).scheduler
    assert s is not None and s.params == {
        "total_num_steps": 1000,
        "warmup_num_steps": 10,
        "cos_min_ratio": 0.0,
    }
    s = _parse(
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": None, "warmup_min_lr": [0, 1e-5]}}}
    ).scheduler
    assert s is not None and s.params == {
        "warmup_max_lr": None,
        "warmup_min_lr": [0.0, 1e-5],
    }
    _err(
        {"train_batch_size": 1, "scheduler": {"type": "WarmupDecayLR", "params": {}}},
        "total_num_steps: required for WarmupDecayLR",
    )
    _err(
        {"train_batch_size": 1, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
        "expected 'log' or 'linear'",
    )
    _err(
        {"train_batch_size": 1, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
        "positive integer",
    )


def test_top_level_defaults() -> None:
    cfg = _parse({})
    assert cfg.gradient_clipping == 1.0  # DeepSpeed 0.19.8's default (it was 0.0 in older releases)
    assert cfg.steps_per_print is None and not cfg.prescale_gradients and cfg.gradient_predivide_factor == 1.0
    assert cfg.optimizer is None and cfg.scheduler is None and cfg.zero_force_ds_cpu_optimizer
    assert _parse({"gradient_clipping": 0}).gradient_clipping == 0.0
    _err({"train_batch_size": 1, "gradient_clipping": -1}, "must be >= 0")


def test_every_field_has_an_attribute_docstring() -> None:
    from engine.config import schema

    tree = ast.parse(inspect.getsource(schema))
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Config")}
    for cls_name in (
        "FP16Config",
        "BF16Config",
        "OffloadConfig",
        "ZeroConfig",
        "OptimizerConfig",
        "SchedulerConfig",
        "EngineConfig",
    ):
        body = classes[cls_name].body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), (
                    cls_name,
                    node.target,
                )
                assert isinstance(nxt.value.value, str) and nxt.value.value.strip()


# ---------------------------------------------------------------------------------- DeepSpeed oracle

_DS_SCRIPT = r"""
import json, sys, logging
logging.disable(logging.WARNING)
from deepspeed.runtime.config import DeepSpeedConfig, get_gradient_clipping
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.precision_config import DeepSpeedFP16Config
req = json.loads(sys.stdin.read())
batches = []
for given, world in req["batches"]:
    c = object.__new__(DeepSpeedConfig)
    c.world_size = world
    c.train_batch_size = given.get("train_batch_size")
    c.train_micro_batch_size_per_gpu = given.get("train_micro_batch_size_per_gpu")
    c.gradient_accumulation_steps = given.get("gradient_accumulation_steps")
    try:
        c._configure_train_batch_size()
        batches.append([c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps])
    except (AssertionError, ZeroDivisionError):
        batches.append(None)
RENAMED = {"prefetch_bucket_size": "stage3_prefetch_bucket_size",
           "param_persistence_threshold": "stage3_param_persistence_threshold",
           "max_live_parameters": "stage3_max_live_parameters",
           "max_reuse_distance": "stage3_max_reuse_distance",
           "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save"}
PLAIN = ["stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
         "allgather_bucket_size", "overlap_comm", "sub_group_size", "round_robin_gradients",
         "elastic_checkpoint", "ignore_unused_parameters"]


def off(o):
    return None if o is None else [getattr(o.device, "value", o.device), o.pin_memory]


zeros = []
for zd in req["zeros"]:
    z = DeepSpeedZeroConfig(**zd)
    row = {k: getattr(z, k) for k in PLAIN}
    row["stage"] = int(z.stage)
    row.update({ours: getattr(z, theirs) for theirs, ours in RENAMED.items()})
    row["offload_param"], row["offload_optimizer"] = off(z.offload_param), off(z.offload_optimizer)
    zeros.append(row)
f = DeepSpeedFP16Config()
fp16 = dict(enabled=f.enabled, auto_cast=f.auto_cast, loss_scale=f.loss_scale,
    initial_scale_power=f.initial_scale_power, loss_scale_window=f.loss_scale_window, hysteresis=f.hysteresis,
    consecutive_hysteresis=f.consecutive_hysteresis, min_loss_scale=f.min_loss_scale)
print(json.dumps(dict(batches=batches, zeros=zeros, fp16=fp16, clip=get_gradient_clipping({}))))
"""


@pytest.mark.slow
@pytest.mark.deepspeed
def test_matches_real_deepspeed_config() -> None:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    batches = []
    for world in (1, 2, 3, 4):
        for tb in (None, 6, 8, 12, 16):
            for mb in (None, 1, 2, 3):
                for gas in (None, 1, 2):
                    given = {k: v for k, v in zip(keys, (tb, mb, gas), strict=True) if v is not None}
                    if "train_batch_size" in given or "train_micro_batch_size_per_gpu" in given:
                        batches.append((given, world))
    origin_zero = json.loads(ORIGIN.read_text())["zero_optimization"]
    ds_origin_zero = {
        ("cpu_offload_param" if k == "cpu_offload_params" else k): v for k, v in origin_zero.items()
    }
    zeros = [
        {},
        {"stage": 1},
        {"stage": 3},
        ds_origin_zero,
        {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}, "overlap_comm": False},
    ]
    proc = subprocess.run(
        [str(DS_PYTHON), "-c", _DS_SCRIPT],
        input=json.dumps({"batches": batches, "zeros": zeros}),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = json.loads(proc.stdout.strip().splitlines()[-1])

    for (given, world), ds in zip(batches, want["batches"], strict=True):
        try:
            cfg = parse_config(given, world_size=world)
            got: list[int] | None = [
                cfg.train_batch_size,
                cfg.train_micro_batch_size_per_gpu,
                cfg.gradient_accumulation_steps,
            ]
        except ConfigError:
            got = None
        assert got == ds, (given, world)
    assert sum(b is None for b in want["batches"]) > 10 and sum(b is not None for b in want["batches"]) > 10

    for zd, ds in zip(zeros, want["zeros"], strict=True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            z = _parse({"zero_optimization": zd}).zero_optimization
        row: dict[str, object] = {k: getattr(z, k) for k in ds if not k.startswith("offload")}
        for name in ("offload_param", "offload_optimizer"):
            o = getattr(z, name)
            row[name] = None if o is None else [o.device, o.pin_memory]
        assert row == ds, zd
    assert dataclasses.asdict(C.FP16Config()) == want["fp16"]
    assert (
        EngineConfig(
            world_size=1, train_batch_size=1, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1
        ).gradient_clipping
        == want["clip"]
    )


def test_checkpoint_writer_block() -> None:
    """DeepSpeed 0.19's ``checkpoint.writer`` keys: parsed with its defaults and spellings, mapped onto the
    file writer's options; ``mock`` and ``socket``/``machine`` refused with the reason; typos named."""
    from engine.checkpoint.save import write_options

    cfg = _parse({})
    assert not cfg.checkpoint.writer.decoupled
    opts = write_options(cfg.checkpoint.writer)
    assert (opts.direct, opts.buf_bytes, opts.buffers, opts.in_flight) == (True, 64 << 20, 2, 1)
    w = _parse(
        {
            "checkpoint": {
                "tag_validation": "Fail",
                "use_node_local_storage": False,
                "writer": {"type": "PYTHON", "decoupled": True, "io_buffer_size": 1e6,
                           "io_buffer_double": False, "show_statistics": True, "data_parallel": "Replica",
                           "io_multiplier": 3},
            }
        }
    ).checkpoint.writer  # fmt: skip
    assert (w.type, w.decoupled, w.io_buffer_size, w.data_parallel, w.io_multiplier) == (
        "python", True, 1_000_000, "replica", 3)  # fmt: skip
    opts = write_options(w)
    assert not opts.direct and opts.buf_bytes == 245 * 4096 and opts.buffers == 3
    for writer, match in [
        ({"type": "mock"}, "a checkpoint that is not written"),
        ({"data_parallel": "socket"}, "its own partition file"),
        ({"decoupeld": True}, "did you mean decoupled"),
        ({"io_multiplier": 0}, "must be >= 1"),
    ]:
        _err({"train_batch_size": 1, "checkpoint": {"writer": writer}}, match)
    _err({"train_batch_size": 1, "checkpoint": {"writter": {}}}, "checkpoint.writter")


def test_checkpoint_format_key() -> None:
    """The engine's ``checkpoint.format`` (not a DeepSpeed key): native by default, ``deepspeed`` in any case;
    anything else refused in one line naming the key and the choices; a typo named."""
    assert _parse({}).checkpoint.format == "native"
    assert _parse({"checkpoint": {"format": "DeepSpeed"}}).checkpoint.format == "deepspeed"
    for bad in ("dcp", 3, None):
        _err({"train_batch_size": 1, "checkpoint": {"format": bad}}, "format.*'native'.*'deepspeed'")
    _err({"train_batch_size": 1, "checkpoint": {"fromat": "deepspeed"}}, "did you mean format")


_DS_WRITER = """
import json, sys
from deepspeed.runtime.model_checkpointing.config import get_checkpoint_config
out = []
for block in json.loads(sys.stdin.read()):
    try:
        out.append(get_checkpoint_config({"checkpoint": block})["writer"])
    except AssertionError:
        out.append("refused")
print(json.dumps(out))
"""


@pytest.mark.deepspeed
def test_checkpoint_writer_matches_real_deepspeed() -> None:
    """DeepSpeed 0.19.8's own parser on the same ``checkpoint.writer`` blocks: the same values and defaults
    (its upper-cased enums lower-cased here), and what it refuses the engine refuses."""
    blocks = [
        {"writer": {}},
        {"writer": {"decoupled": True}},
        {
            "writer": {
                "type": "python",
                "io_buffer_size": 1048576,
                "io_buffer_double": False,
                "io_multiplier": 2,
                "show_statistics": True,
                "data_parallel": "replica",
            }
        },
        {"writer": {"type": "FAST", "decoupled": True}},
        {"format": "deepspeed", "writer": {"decoupled": True}},  # the engine's key: DeepSpeed ignores it
        {"writer": {"type": "bogus"}},
        {"writer": {"data_parallel": "bogus"}},
    ]
    proc = subprocess.run([str(DS_PYTHON), "-c", _DS_WRITER], input=json.dumps(blocks), capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    for block, ds in zip(blocks, theirs, strict=True):
        try:
            w = _parse({"checkpoint": block}).checkpoint.writer
        except ConfigError:
            assert ds == "refused", block
            continue
        dp = ds["data_parallel"]
        assert {k: getattr(w, k) for k in ds} == {
            **ds, "type": ds["type"].lower(), "data_parallel": dp.lower() if dp else None}, block  # fmt: skip


# ------------------------------------------------------------------------- public configs (corpus)

PUBLIC = DATA / "ds_configs_public.json"  # generator, sources and how DeepSpeed was run: ds_configs_public.py
ENGINE_LACKS = {"llamafactory_ds_z2_autotp_config": "tensor_parallel"}
"""Corpus entries DeepSpeedConfig parses that the engine refuses by design (real DeepSpeed refused these at
``initialize`` too: AutoTP needs a model policy)."""


def _ds_adam_params(kind: str, p: dict) -> tuple:
    """DeepSpeed's Adam defaults (FusedAdam / DeepSpeedCPUAdam; torch AdamW's weight decay for torch_adam)."""
    wd = p.get("weight_decay", 0.01 if p.get("torch_adam") else 0.0)
    return (kind, p.get("lr", 1e-3), tuple(p.get("betas", (0.9, 0.999))), p.get("eps", 1e-8), wd)


@pytest.mark.parametrize("entry", json.loads(PUBLIC.read_text()), ids=lambda e: e["name"])
def test_public_configs_as_deepspeed_reads_them(entry: dict) -> None:
    """Public HF Trainer configs (LLaMA-Factory, FastChat, axolotl, LLaVA, Qwen, InternVL, LMFlow,
    transformers, accelerate, DeepSpeedExamples, ...), filled as the Trainer fills them: the engine accepts
    what DeepSpeed 0.19.8's ``DeepSpeedConfig`` accepted (recorded in the corpus) and resolves the same batch
    sizes, ZeRO stage, offload devices, optimizer, scheduler, precision and clipping; what DeepSpeed refused
    it refuses."""
    ds = entry["deepspeed_config"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cfg = parse_config(entry["filled"], world_size=2)
        except ConfigError as e:
            assert "refused" in ds or e.key == ENGINE_LACKS.get(entry["name"]), (entry["name"], str(e))
            return
    assert "refused" not in ds, entry["name"]
    z = cfg.zero_optimization
    got = {
        "batch": [cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps],
        "stage": cfg.zero_stage,
        "offload_optimizer": None if z.offload_optimizer is None else z.offload_optimizer.device,
        "offload_param": None if z.offload_param is None else z.offload_param.device,
        "fp16": cfg.fp16.enabled,
        "bf16": cfg.bf16.enabled,
        "gradient_clipping": cfg.gradient_clipping,
    }
    assert got == {k: ds[k] for k in got}, entry["name"]
    (ds_opt, ds_params), (ds_sched, ds_sched_params) = ds["optimizer"], ds["scheduler"]
    o = cfg.optimizer
    if ds_opt is None:
        assert o is None
    else:
        assert o is not None and o.type.lower() == ds_opt
        assert (o.type.lower(), o.lr, o.betas, o.eps, o.weight_decay) == _ds_adam_params(ds_opt, ds_params)
    s = cfg.scheduler
    assert (s.type, s.params) == (ds_sched, ds_sched_params) if s else ds_sched is None


def test_unknown_top_level_keys_are_ignored_as_deepspeed_does() -> None:
    """DeepSpeed 0.19.8 ignores top-level keys it does not know (LLaMA-Factory's ds_z3_fp8_config.json
    carries ``comms_config`` and ``monitor_config``; the corpus records DeepSpeedConfig accepting it): the
    engine ignores them too, with a warning naming the nearest valid key. Unknown keys inside a block stay
    errors, as DeepSpeed's pydantic blocks refuse them (``extra_forbidden``)."""
    with pytest.warns(UserWarning) as caught:
        cfg = _parse(
            {"comms_config": {"verbose": False}, "monitor_config": {"enabled": True}, "gradient_clip": 0}
        )
    messages = [str(w.message) for w in caught]
    assert (
        messages[0]
        == "comms_config: unknown top-level key, ignored (as DeepSpeed does); did you mean comms_logger?"
    )
    assert messages[1] == "monitor_config: unknown top-level key, ignored (as DeepSpeed does)"
    assert "did you mean gradient_clipping?" in messages[2]
    assert cfg.gradient_clipping == 1.0 and "comms_config" in cfg.to_dict()
    _err({"train_batch_size": 1, "zero_optimization": {"stage": 2, "bogus": 1}}, "zero_optimization.bogus")


def test_communication_data_type_is_read_as_deepspeed_reads_it() -> None:
    """DeepSpeed 0.19.8's ``get_communication_data_type``: fp32/fp16/bf16 in any case, None by default, any
    other value refused; the engine's reducer then reduces gradients in that dtype."""
    import torch

    import engine

    base = {"train_batch_size": 1}
    assert parse_config(base, world_size=1).communication_data_type is None
    for given, want in (("fp32", "fp32"), ("FP32", "fp32"), ("Bf16", "bf16"), ("fp16", "fp16")):
        got = parse_config({**base, "communication_data_type": given}, world_size=1)
        assert got.communication_data_type == want
    e = _err({**base, "communication_data_type": "int8"}, "expected one of")
    assert e.key == "communication_data_type"
    model = torch.nn.Linear(3, 2)
    eng, *_ = engine.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config={**base, "bf16": {"enabled": True}, "communication_data_type": "fp32"},
    )
    assert eng.reducer.comm_dtype == torch.float32
