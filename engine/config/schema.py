"""The DeepSpeed config as typed, frozen dataclasses: one class per JSON block and ``EngineConfig``.

Each field carries DeepSpeed 0.19.8's default and a one-line meaning; parse metadata (bounds, aliases) rides
on the field (``_f``). Parsing lives in ``engine.config`` (``parse_config``), ``engine.config.blocks``
(per-block rules) and ``engine.config.parse`` (generic coercion).

Defaults worth knowing (they changed across DeepSpeed versions; these are 0.19.8's):
``gradient_clipping`` 1.0, ``steps_per_print`` None, offload ``pin_memory`` True, ``overlap_comm`` True for
stage 3 else False, optimizer ``Adam`` means decoupled weight decay (``adam_w_mode`` True).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal


def _f(default: Any, **meta: Any) -> Any:
    """A dataclass field with parse metadata (``ge``/``gt``/``le`` bounds, ``aliases``)."""
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class FP16Config:
    """The ``fp16`` block: fp16 mixed precision with static or dynamic loss scaling."""

    enabled: bool = False
    """Train in fp16 with fp32 master weights. DeepSpeed default: false."""
    auto_cast: bool = False
    """Cast floating-point inputs of ``forward`` to fp16. DeepSpeed default: false."""
    loss_scale: float = _f(0.0, ge=0)
    """Static loss scale; 0 selects dynamic loss scaling. DeepSpeed default: 0."""
    initial_scale_power: int = _f(16, ge=0)
    """Dynamic scaling starts at ``2**initial_scale_power``. DeepSpeed default: 16."""
    loss_scale_window: int = 1000
    """Overflow-free steps before the dynamic scale doubles. DeepSpeed default: 1000."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is first halved (DeepSpeed's ``delayed_shift``). Default: 2."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis on every overflow-free step, not only at a window boundary. Default: false."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic loss scale. DeepSpeed default: 1."""

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether dynamic loss scaling is active (fp16 enabled and ``loss_scale == 0``)."""
        return self.enabled and self.loss_scale == 0


@dataclass(frozen=True, kw_only=True)
class BF16Config:
    """The ``bf16`` block (alias ``bfloat16``): bf16 mixed precision, fp32 master weights, no loss scaling."""

    enabled: bool = False
    """Train in bf16 with fp32 master weights. DeepSpeed default: false."""
    check_grad_overflow: bool = True
    """Skip the optimizer step when a gradient holds inf/NaN, as for fp16. DeepSpeed default: true."""


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """``zero_optimization.offload_param`` / ``offload_optimizer``. Only ``none`` and ``cpu`` devices."""

    device: Literal["none", "cpu"] = "none"
    """Where the offloaded tensors live: ``none`` (not offloaded) or ``cpu``. DeepSpeed default: none."""
    pin_memory: bool = True
    """Keep offloaded tensors in page-locked CPU memory (fast async copies). DeepSpeed default: true."""

    @property
    def active(self) -> bool:
        return self.device == "cpu"


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """The ``zero_optimization`` block. Unprefixed DeepSpeed field names (``prefetch_bucket_size``...) are
    accepted for the ``stage3_*`` keys, as DeepSpeed's pydantic model does."""

    stage: int = _f(0, ge=0, le=3)
    """0 = plain data parallel; 1/2/3 partition optimizer states / + gradients / + parameters. Default: 0."""
    contiguous_gradients: bool = True
    """Copy reduced gradients into one contiguous buffer as they are produced. DeepSpeed default: true."""
    reduce_scatter: bool = True
    """Average gradients with reduce-scatter rather than all-reduce. DeepSpeed default: true."""
    reduce_bucket_size: int = _f(500_000_000, gt=0)
    """Elements reduced per gradient bucket. DeepSpeed default: 5e8."""
    allgather_partitions: bool = True
    """Stages 1/2: all-gather updated partitions (vs. broadcasts) after the step. DeepSpeed default: true."""
    allgather_bucket_size: int = _f(500_000_000, ge=0)
    """Elements all-gathered at a time (stages 1/2). DeepSpeed default: 5e8."""
    overlap_comm: bool = False
    """Overlap gradient reduction with backward. DeepSpeed default: true for stage 3, false otherwise."""
    offload_param: OffloadConfig | None = None
    """Parameter offload (stage 3 only). DeepSpeed default: none."""
    offload_optimizer: OffloadConfig | None = None
    """Optimizer-state offload, optimizer step on CPU (stages 1–3). DeepSpeed default: none."""
    sub_group_size: int = _f(1_000_000_000, ge=0)
    """Elements per optimizer sub-group (tile of the flat fp32 partition). DeepSpeed default: 1e9."""
    stage3_prefetch_bucket_size: int = _f(50_000_000, ge=0, aliases=("prefetch_bucket_size",))
    """Elements of upcoming parameters fetched ahead of use. DeepSpeed default: 5e7."""
    stage3_param_persistence_threshold: int = _f(100_000, ge=0, aliases=("param_persistence_threshold",))
    """Parameters with fewer elements stay gathered (not re-partitioned). DeepSpeed default: 1e5."""
    stage3_max_live_parameters: int = _f(1_000_000_000, ge=0, aliases=("max_live_parameters",))
    """Most gathered parameter elements resident per rank before releasing. DeepSpeed default: 1e9."""
    stage3_max_reuse_distance: int = _f(1_000_000_000, ge=0, aliases=("max_reuse_distance",))
    """Keep a parameter gathered if it is reused within this many elements of fetches. Default: 1e9."""
    stage3_gather_16bit_weights_on_model_save: bool = _f(
        False, aliases=("gather_16bit_weights_on_model_save",)
    )
    """``save_16bit_model`` gathers the partitioned weights (stage 3). DeepSpeed default: false."""
    round_robin_gradients: bool = False
    """Stages 1/2 with CPU offload: spread gradient copies over ranks. Layout-neutral. Default: false."""
    elastic_checkpoint: bool = False
    """Legacy elastic checkpoint flag (no effect in the engine's format). DeepSpeed default: false."""
    ignore_unused_parameters: bool = True
    """Tolerate parameters that get no gradient (stage 2). DeepSpeed default: true."""


OptimizerType = Literal["Adam", "AdamW", "SGD"]


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The ``optimizer`` block; ``params`` are flattened here. Adam/AdamW follow DeepSpeed's FusedAdam /
    DeepSpeedCPUAdam (``torch_adam`` selects torch.optim.Adam/AdamW); SGD is torch.optim.SGD."""

    type: OptimizerType
    """``Adam``, ``AdamW`` or ``SGD`` (any case in the JSON)."""
    lr: float = _f(1e-3, ge=0)
    """Learning rate (the scheduler overwrites it). Default: 1e-3 (FusedAdam, torch SGD)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam: coefficients of the running averages. Default: (0.9, 0.999)."""
    eps: float = _f(1e-8, ge=0)
    """Adam: denominator term. Default: 1e-8."""
    weight_decay: float = _f(0.0, ge=0)
    """Weight decay. Default 0, except 0.01 for torch_adam in AdamW mode (torch.optim.AdamW's default)."""
    adam_w_mode: bool = True
    """Adam: decoupled weight decay. Always true for ``AdamW``; DeepSpeed's default for ``Adam`` is true."""
    torch_adam: bool = False
    """Adam: use torch.optim.Adam/AdamW instead of DeepSpeed's fused/CPU Adam (same math). Default: false."""
    momentum: float = _f(0.0, ge=0)
    """SGD: momentum factor. Default: 0."""
    dampening: float = 0.0
    """SGD: dampening of momentum. Default: 0."""
    nesterov: bool = False
    """SGD: Nesterov momentum. Default: false."""
    params: dict[str, Any] = field(default_factory=dict)
    """The block's ``params`` exactly as written (for checkpoints and logs)."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The ``scheduler`` block. ``params`` holds only the keys the user wrote (coerced to the right types),
    so ``build_scheduler`` applies each class's own DeepSpeed defaults."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    """Schedule class name (case-sensitive, as in DeepSpeed)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Constructor keyword arguments for the schedule (see ``engine.optim.scheduler``)."""


@dataclass(frozen=True, kw_only=True)
class WriterConfig:
    """``checkpoint.writer`` (DeepSpeed 0.19's checkpoint writer): how ``save_checkpoint`` writes each rank's
    file. Every rank writes its own rank file (``engine.checkpoint``); these keys say how and when."""

    type: Literal["fast", "python"] = "fast"
    """``fast``: ``O_DIRECT`` writes from page-aligned buffers, several in flight (DeepSpeed's ``fast``
    writer uses libaio to the same end); ``python``: plain buffered writes, fsynced. ``mock`` (write
    nothing) is refused: a checkpoint that is not written cannot become ``latest``. Any case.
    Default: fast."""
    decoupled: bool = False
    """Asynchronous save: ``save_checkpoint`` returns once this rank's state is snapshotted into reusable
    host buffers, and a background thread writes the same files while training goes on (see docs/engine.md,
    "Checkpoints at disk speed"). DeepSpeed default: false."""
    io_buffer_size: int = _f(64 << 20, gt=0)
    """Bytes per device write (rounded up to 4 KiB for ``O_DIRECT``). DeepSpeed default: 64 MiB."""
    io_buffer_double: bool = True
    """Fill one I/O buffer while another is written; false writes synchronously. DeepSpeed default: true."""
    show_statistics: bool = False
    """Print each rank file's write statistics (bytes, seconds, GB/s, hashing, fsync). Default: false."""
    data_parallel: Literal["replica"] | None = None
    """Which data-parallel ranks write: every rank writes its own partition in the engine's format,
    which is DeepSpeed's ``replica`` unit; null or ``replica`` (any case) are accepted, ``socket`` and
    ``machine`` are refused. DeepSpeed default: null."""
    io_multiplier: int = _f(1, ge=1)
    """Parallel writers per rank file: ``io_multiplier`` writes in flight at once (times two buffers with
    ``io_buffer_double``). DeepSpeed default: 1."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The ``checkpoint`` block. ``writer`` and ``format`` (the engine's own key) change what the engine
    does; ``load_universal`` is refused; DeepSpeed's other keys (``tag_validation``,
    ``use_node_local_storage``, ``parallel_write``, ``checkpoint_serialization``) are accepted and have no
    effect on the engine's format."""

    writer: WriterConfig = field(default_factory=WriterConfig)
    """How rank files are written (defaults: DeepSpeed's, synchronous)."""
    format: Literal["native", "deepspeed"] = "native"
    """The layout ``save_checkpoint`` writes: ``native`` (docs/native-format.md, the fastest) or
    ``deepspeed``: DeepSpeed 0.19.8's own ZeRO-1/2/3 files, ``latest`` and ``zero_to_fp32.py``, which real
    DeepSpeed's ``load_checkpoint``, the Trainer and ``zero_to_fp32.py`` read with no conversion
    (``engine.checkpoint.ds_layout``). Not a DeepSpeed key (DeepSpeed ignores it and always writes its
    own layout). Any case. Default: native."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """A parsed, validated DeepSpeed config for a given data-parallel world size."""

    world_size: int
    """Data-parallel world size the batch sizes were resolved for."""
    train_batch_size: int
    """Global batch per optimizer step = micro batch × accumulation steps × world size."""
    train_micro_batch_size_per_gpu: int
    """Samples per rank per forward/backward."""
    gradient_accumulation_steps: int
    """Micro-steps per optimizer step. DeepSpeed resolves it from the other two (1 when unspecified)."""
    steps_per_print: int | None = None
    """Log progress every this many optimizer steps; None = never. DeepSpeed default: None."""
    wall_clock_breakdown: bool = False
    """Time forward/backward/step and log the breakdown. DeepSpeed default: false."""
    dump_state: bool = False
    """Print the engine state after initialisation. DeepSpeed default: false."""
    gradient_clipping: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 disables. DeepSpeed 0.19.8 default: 1.0."""
    prescale_gradients: bool = False
    """Divide gradients by the world size before (not after) the reduction. DeepSpeed default: false."""
    gradient_predivide_factor: float = 1.0
    """Divide gradients by this before the reduction and by world/factor after. DeepSpeed default: 1.0."""
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    """The dtype gradients are reduced in (the reduced values then go into the gradient buffer's dtype);
    None = the compute dtype. DeepSpeed default: None. Case-insensitive, as DeepSpeed reads it."""
    zero_allow_untested_optimizer: bool = False
    """Allow a client optimizer other than Adam/AdamW/SGD-like with ZeRO. DeepSpeed default: false."""
    zero_force_ds_cpu_optimizer: bool = True
    """With optimizer offload, require a CPU Adam over a client optimizer. DeepSpeed default: true."""
    dataloader_drop_last: bool = False
    """The dataloader built from ``training_data`` drops the last incomplete batch. Default: false."""
    fp16: FP16Config = field(default_factory=FP16Config)
    """fp16 mixed precision and loss scaling."""
    bf16: BF16Config = field(default_factory=BF16Config)
    """bf16 mixed precision."""
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO stage and its knobs."""
    optimizer: OptimizerConfig | None = None
    """Optimizer built by the engine; None = the client passes one."""
    scheduler: SchedulerConfig | None = None
    """LR schedule built by the engine; None = the client passes one or none."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """How ``save_checkpoint`` writes (``checkpoint.writer``)."""
    user_config: dict[str, Any] = field(default_factory=dict, repr=False)
    """The config as the user gave it (deep copy), for checkpoints."""

    def to_dict(self) -> dict[str, Any]:
        """The original user config (a fresh deep copy; JSON-able when the input was)."""
        return copy.deepcopy(self.user_config)

    # DeepSpeed's ``engine.config`` is the user's config dict: the HF Trainer reads it as one
    # (``self.deepspeed.config.get("zero_optimization", {})``). Read-only lookups into ``user_config``.
    def get(self, key: str, default: Any = None) -> Any:
        return self.user_config.get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.user_config[key]

    def __contains__(self, key: object) -> bool:
        return key in self.user_config

    def keys(self) -> Any:
        return self.user_config.keys()

    def items(self) -> Any:
        return self.user_config.items()

    @property
    def precision(self) -> Literal["fp32", "fp16", "bf16"]:
        if self.fp16.enabled:
            return "fp16"
        return "bf16" if self.bf16.enabled else "fp32"

    @property
    def zero_stage(self) -> int:
        return self.zero_optimization.stage

    @property
    def offload_optimizer(self) -> bool:
        off = self.zero_optimization.offload_optimizer
        return off is not None and off.active

    @property
    def offload_param(self) -> bool:
        off = self.zero_optimization.offload_param
        return off is not None and off.active
