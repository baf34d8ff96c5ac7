"""Per-block rules of the config parser: the tables of DeepSpeed keys the engine does not implement
(refused when active, ignored when inert or performance-only), deprecated spellings and their mapping, and
one ``parse_*`` function per JSON block (fp16, bf16/bfloat16, zero_optimization + offload, optimizer;
the scheduler block is ``engine.config.sched``). ``engine.config.parse_config`` drives them.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from engine.config.parse import (
    ConfigError,
    Foreign,
    build,
    coerce,
    deprecated,
    join,
    take_foreign,
    unknown_key,
    unknown_value,
)
from engine.config.schema import (
    BF16Config,
    CheckpointConfig,
    FP16Config,
    OffloadConfig,
    OptimizerConfig,
    WriterConfig,
    ZeroConfig,
)

REMOVED = "removed from DeepSpeed itself"
TOP_FOREIGN: dict[str, Foreign] = {
    **{
        k: Foreign(REMOVED)
        for k in (
            "nebula",
            "compression_training",
            "amp",
            "quantize_training",
            "sparse_gradients",
            "eigenvalue",
            "sparse_attention",
            "elasticity",
            "graph_harvesting",
            "curriculum_learning",
            "progressive_layer_drop",
        )
    },
    "pipeline": Foreign("pipeline parallelism"),
    "moe": Foreign("mixture of experts"),
    "expert_parallel": Foreign("expert parallelism"),
    "tensor_parallel": Foreign("tensor parallelism"),
    "sequence_parallel_size": Foreign("sequence parallelism", default=1),
    "flops_profiler": Foreign("the flops profiler"),
    "tensorboard": Foreign("the TensorBoard monitor"),
    "wandb": Foreign("the Weights & Biases monitor"),
    "csv_monitor": Foreign("the CSV monitor"),
    "comet": Foreign("the Comet monitor"),
    "autotuning": Foreign("autotuning"),
    "data_efficiency": Foreign("data efficiency / curriculum sampling"),
    "hybrid_engine": Foreign("the RLHF hybrid engine"),
    "torch_autocast": Foreign("torch.autocast mode; use fp16 or bf16"),
    "compile": Foreign("DeepCompile"),
    "weight_quantization": Foreign("weight quantization"),
    "datastates": Foreign("the DataStates checkpoint engine"),
    "data_types": Foreign("custom gradient-accumulation / parameter dtypes"),
    "gradient_allreduce_op": Foreign("gradient_allreduce_op 'sum'", default="mean"),
    "disable_allgather": Foreign("disable_allgather", default=False),
    "use_data_before_expert_parallelism": Foreign("expert parallelism", default=False),
    "managed_gradient_accumulation": Foreign("unmanaged gradient accumulation", default=True),
    **{
        k: Foreign("logging/performance only", ignore=True)
        for k in (
            "comms_logger",
            "memory_breakdown",
            "log_level",
            "timers",
            "vocabulary_size",
            "disable_python_gc",
            "aio",
            "seq_parallel_communication_data_type",
        )
    },
}
ZERO_FOREIGN: dict[str, Foreign] = {
    "zenflow": Foreign("ZenFlow"),
    "legacy_stage1": Foreign("the legacy stage-1 implementation", default=False),
    "parameter_alignment": Foreign("16-byte parameter alignment in flat buffers", default=False),
    "zero_hpz_partition_size": Foreign("hierarchical (ZeRO++ hpZ) partitioning", default=1),
    "zero_quantized_weights": Foreign("ZeRO++ quantized weights", default=False),
    "zero_quantized_nontrainable_weights": Foreign("ZeRO++ quantized frozen weights", default=False),
    "zero_quantized_gradients": Foreign("ZeRO++ quantized gradients", default=False),
    "load_from_fp32_weights": Foreign("initialising masters from 16-bit weights on load", default=True),
    "pipeline_loading_checkpoint": Foreign("pipeline checkpoint loading", default=False),
    "compute_grad_norm": Foreign("skipping the gradient norm", default=True),
    "leaf_module": Foreign("ZeRO-3 leaf modules"),
    "save_muon_momentum_buffer_in_memory": Foreign("the Muon optimizer", default=False),
    "mics_shard_size": Foreign(REMOVED),
    "mics_hierarchical_params_gather": Foreign(REMOVED),
    "zeropp_loco_param": Foreign(REMOVED),
    **{
        k: Foreign("performance only", ignore=True)
        for k in (
            "use_multi_rank_bucket_allreduce",
            "stage3_module_granularity_threshold",
            "module_granularity_threshold",
            "stage3_model_persistence_threshold",
            "model_persistence_threshold",
            "stage3_use_all_reduce_for_fetch_params",
            "use_all_reduce_for_fetch_params",
            "stage3_allgather_sequential",
            "allgather_sequential",
            "memory_efficient_linear",
            "override_module_apply",
            "log_trace_cache_warnings",
            "enable_sanity_checks",
        )
    },
}
OFFLOAD_FOREIGN: dict[str, Foreign] = {
    "ratio": Foreign("partial optimizer offload", default=1.0),
    "super_offload": Foreign("SuperOffload", default=False),
    **{
        k: Foreign("NVMe/performance only", ignore=True)
        for k in (
            "nvme_path",
            "buffer_count",
            "buffer_size",
            "max_in_cpu",
            "pipeline_read",
            "pipeline_write",
            "fast_init",
            "cpuadam_cores_perc",
        )
    },
}
FP16_FOREIGN = {"fp16_master_weights_and_grads": Foreign("fp16 master weights", default=False)}
BF16_FOREIGN = {
    "bf16_master_weights_and_grads": Foreign("bf16 master weights", default=False),
    "bf16_optimizer_states": Foreign("bf16 optimizer states", default=False),
    "immediate_grad_update": Foreign("performance only", ignore=True),
}
OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}
DS_OTHER_OPTIMIZERS = {
    "adagrad",
    "lamb",
    "lion",
    "muon",
    "muadam",
    "muadamw",
    "musgd",
    "onebitadam",
    "zerooneadam",
    "onebitlamb",
    "fusedadam",
    "cpuadam",
}
ADAM_FOREIGN = {
    "amsgrad": Foreign("AMSGrad", default=False),
    "bias_correction": Foreign("Adam without bias correction", default=True),
    "fp32_optimizer_states": Foreign("16-bit optimizer states", default=True),
    "foreach": Foreign("performance only", ignore=True),
}
SGD_FOREIGN = {
    "maximize": Foreign("maximize", default=False),
    "differentiable": Foreign("differentiable SGD", default=False),
    "foreach": Foreign("performance only", ignore=True),
}
BLOCKS = (
    "fp16",
    "bf16",
    "bfloat16",
    "zero_optimization",
    "optimizer",
    "scheduler",
    "checkpoint",
    "activation_checkpointing",
)
CHECKPOINT_INERT = ("tag_validation", "use_node_local_storage", "parallel_write", "checkpoint_serialization")
"""``checkpoint`` keys that do not change the engine's format (accepted, no effect)."""


def as_block(value: Any, path: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {value!r}", key=path)
    return dict(value)


def parse_fp16(value: Any) -> FP16Config:
    d = as_block(value, "fp16")
    take_foreign(d, "fp16", FP16_FOREIGN)
    cfg = build(FP16Config, d, "fp16")
    if cfg.dynamic_loss_scale:  # DeepSpeed validates these only when dynamic scaling is active
        for name in ("loss_scale_window", "min_loss_scale", "hysteresis"):
            if getattr(cfg, name) <= 0:
                raise ConfigError(
                    f"fp16.{name}: must be > 0 when dynamic loss scaling is enabled (loss_scale=0)",
                    key=f"fp16.{name}",
                )
    return cfg


def parse_bf16(d: dict[str, Any]) -> BF16Config:
    if "bf16" in d and "bfloat16" in d:
        raise ConfigError("bfloat16: same block as bf16; give only bf16", key="bfloat16")
    key = "bf16"
    if "bfloat16" in d:
        deprecated("Config block 'bfloat16' is deprecated; use 'bf16'")
        key = "bfloat16"
    d_bf16 = as_block(d.pop(key, None), key)
    take_foreign(d_bf16, key, BF16_FOREIGN)
    return build(BF16Config, d_bf16, key)


def parse_offload(value: Any, path: str) -> OffloadConfig | None:
    if value is None:
        return None
    d = as_block(value, path)
    take_foreign(d, path, OFFLOAD_FOREIGN)
    if d.get("device") == "nvme":
        raise ConfigError(
            f"{path}.device: 'nvme' offload is not supported by the engine; use 'cpu' or 'none'",
            key=f"{path}.device",
        )
    return build(OffloadConfig, d, path)


def parse_zero(value: Any) -> ZeroConfig:
    path = "zero_optimization"
    if isinstance(value, bool):
        deprecated('Boolean zero_optimization is deprecated; use {"stage": N}')
        value = {"stage": 1 if value else 0}
    d = as_block(value, path)
    take_foreign(d, path, ZERO_FOREIGN)
    pin: bool | None = None
    if "cpu_offload_use_pin_memory" in d:
        deprecated(
            f"{path}.cpu_offload_use_pin_memory is deprecated; use offload_param/offload_optimizer.pin_memory"
        )
        pin = coerce(d.pop("cpu_offload_use_pin_memory"), bool | None, f"{path}.cpu_offload_use_pin_memory")
    renames = (
        ("cpu_offload", "offload_optimizer"),
        ("cpu_offload_param", "offload_param"),
        ("cpu_offload_params", "offload_param"),
        ("stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"),
    )
    for old, new in renames:
        if old not in d:
            continue
        deprecated(f"{path}.{old} is deprecated; use {new}")
        if new in d:
            raise ConfigError(
                f"{path}.{old}: cannot be given together with its replacement {new}", key=join(path, old)
            )
        v = d.pop(old)
        if new.startswith("offload_"):
            on = coerce(v, bool | None, join(path, old))
            d[new] = {"device": "cpu"} if on else None
        else:
            d[new] = v
    offload = {}
    for name in ("offload_param", "offload_optimizer"):
        block = d.pop(name, None)
        if pin is not None and isinstance(block, dict) and "pin_memory" not in block:
            block = {**block, "pin_memory": pin}
        offload[name] = parse_offload(block, join(path, name))
    overlap = d.pop("overlap_comm", None)
    cfg = build(
        ZeroConfig,
        d,
        path,
        prebuilt={**offload, "overlap_comm": False},
        also_valid=(*ZERO_FOREIGN, *(o for o, _ in renames), "cpu_offload_use_pin_memory", "overlap_comm"),
    )
    overlap_comm = cfg.stage == 3 if overlap is None else coerce(overlap, bool, f"{path}.overlap_comm")
    off_param = offload["offload_param"]
    if off_param is not None and off_param.active and cfg.stage != 3:
        raise ConfigError(
            f"{path}.offload_param: parameter offload needs stage 3, got stage {cfg.stage}",
            key=f"{path}.offload_param",
        )
    return dataclasses.replace(cfg, overlap_comm=overlap_comm)


ACTIVATION_CHECKPOINTING: dict[str, Any] = {
    "partition_activations": False,
    "contiguous_memory_optimization": False,
    "cpu_checkpointing": False,
    "number_checkpoints": None,
    "synchronize_checkpoint_boundary": False,
    "profile": False,
}
"""DeepSpeed's ``activation_checkpointing`` keys and defaults. As in DeepSpeed, the block acts only through
``deepspeed.checkpointing.configure(deepspeed_config=...)`` (``engine.checkpointing``)."""


def parse_activation_checkpointing(value: Any) -> dict[str, Any]:
    """The ``activation_checkpointing`` block, validated, with DeepSpeed's defaults filled in."""
    out = dict(ACTIVATION_CHECKPOINTING)
    for key, v in as_block(value, "activation_checkpointing").items():
        if key not in out:
            raise unknown_key("activation_checkpointing", key, out)
        tp: Any = int | None if key == "number_checkpoints" else bool
        out[key] = coerce(v, tp, f"activation_checkpointing.{key}")
    return out


def parse_optimizer(value: Any) -> OptimizerConfig | None:
    if value is None:
        return None
    d = as_block(value, "optimizer")
    take_foreign(d, "optimizer", {"legacy_fusion": Foreign("legacy fusion", default=False)})
    for key in d:
        if key not in ("type", "params"):
            raise unknown_key("optimizer", key, ("type", "params", "legacy_fusion"))
    if "type" not in d:
        raise ConfigError("optimizer.type: required (Adam, AdamW or SGD)", key="optimizer.type")
    name = coerce(d["type"], str, "optimizer.type")
    kind = OPTIMIZERS.get(name.lower())
    if kind is None:
        if name.lower() in DS_OTHER_OPTIMIZERS:
            raise ConfigError(
                f"optimizer.type: {name} is not supported by the engine; use Adam, AdamW or SGD",
                key="optimizer.type",
            )
        raise unknown_value("optimizer.type", name, OPTIMIZERS.values())
    params = as_block(d.get("params"), "optimizer.params")
    raw_params = copy.deepcopy(params)
    if "max_grad_norm" in params:
        raise ConfigError(
            "optimizer.params.max_grad_norm: 'max_grad_norm' is not supported as an optimizer "
            "parameter, please switch to using the deepspeed parameter 'gradient_clipping'",
            key="optimizer.params.max_grad_norm",
        )
    path = "optimizer.params"
    if kind == "SGD":
        take_foreign(params, path, SGD_FOREIGN)
        cfg = build(
            OptimizerConfig,
            params,
            path,
            prebuilt={"type": kind, "params": raw_params, "adam_w_mode": False},
            exclude=("betas", "eps", "adam_w_mode", "torch_adam", "type", "params"),
        )
        if cfg.nesterov and (cfg.momentum <= 0 or cfg.dampening != 0):
            raise ConfigError(
                f"{path}.nesterov: Nesterov momentum requires a momentum and zero dampening",
                key=f"{path}.nesterov",
            )
        return cfg
    take_foreign(params, path, ADAM_FOREIGN)
    cfg = build(
        OptimizerConfig,
        params,
        path,
        prebuilt={"type": kind, "params": raw_params},
        exclude=("momentum", "dampening", "nesterov", "type", "params"),
    )
    adam_w = kind == "AdamW" or cfg.adam_w_mode  # DeepSpeed: "Adam" means AdamW unless adam_w_mode is false
    wd = cfg.weight_decay
    if cfg.torch_adam and adam_w and "weight_decay" not in params:
        wd = 0.01  # torch.optim.AdamW's own default, which DeepSpeed leaves in place
    return dataclasses.replace(cfg, adam_w_mode=adam_w, weight_decay=wd)


def parse_checkpoint(value: Any) -> CheckpointConfig:
    """The ``checkpoint`` block: ``writer`` parsed (DeepSpeed 0.19's keys), ``load_universal`` refused."""
    d = as_block(value, "checkpoint")
    if d.pop("load_universal", False):
        raise ConfigError(
            "checkpoint.load_universal: not supported by the engine (universal checkpoints)",
            key="checkpoint.load_universal",
        )
    for k in CHECKPOINT_INERT:
        d.pop(k, None)
    writer = d.pop("writer", None)
    fmt = d.pop("format", "native")
    if d:
        raise unknown_key(
            "checkpoint", next(iter(d)), ["writer", "format", "load_universal", *CHECKPOINT_INERT]
        )
    if not isinstance(fmt, str) or fmt.lower() not in ("native", "deepspeed"):
        raise ConfigError(
            f"checkpoint.format: {fmt!r} is not a checkpoint layout of the engine",
            key="checkpoint.format",
            hint="use 'native' (the default) or 'deepspeed' (DeepSpeed's own files)",
        )
    return CheckpointConfig(writer=parse_writer(writer), format=fmt.lower())  # type: ignore[arg-type]


def parse_writer(value: Any) -> WriterConfig:
    path = "checkpoint.writer"
    d = as_block(value, path)
    for key in ("type", "data_parallel"):  # DeepSpeed upper-cases these
        if isinstance(d.get(key), str):
            d[key] = d[key].lower()
    if d.get("type") == "mock":
        raise ConfigError(
            f"{path}.type: 'mock' (write nothing) is not supported by the engine: a checkpoint that is not "
            "written cannot become `latest`",
            key=f"{path}.type",
            hint="use 'fast' (O_DIRECT, the default) or 'python' (buffered writes)",
        )
    if d.get("data_parallel") in ("socket", "machine"):
        raise ConfigError(
            f"{path}.data_parallel: {d['data_parallel']!r} is not supported by the engine: every rank writes "
            "its own partition file (DeepSpeed's 'replica' unit)",
            key=f"{path}.data_parallel",
            hint="leave it out or use 'replica'",
        )
    return build(WriterConfig, d, path)
