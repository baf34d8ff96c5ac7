"""``engine.accessors``: the small half of DeepSpeed's ``DeepSpeedEngine`` surface, as a mixin of ``Engine``.

Owns the read-only questions a script asks the engine -- batch sizes, stage, precision, lr and momentum, the
last gradient norm, ranks and world sizes, ``train``/``eval``, the model's state dict -- and the
pass-through of every other attribute to the wrapped model (DeepSpeed's ``DeepSpeedEngine.__getattr__``).
The training loop, start-up and checkpoints are ``engine.engine``'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from torch import nn

from engine import dist as _dist

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.optim.loss_scaler import LossScaler
    from engine.optim.optimizer import PartitionedOptimizer
    from engine.zero.collectives import Comm

_Self = TypeVar("_Self", bound="DeepSpeedAccessors")


class DeepSpeedAccessors:
    """Accessors of ``Engine`` (which sets the attributes declared here)."""

    module: nn.Module
    config: EngineConfig
    comm: Comm
    stage: int
    global_steps: int
    optimizer: PartitionedOptimizer
    loss_scaler: LossScaler
    _step_applied: bool

    def __getattr__(self, name: str) -> Any:
        """Attributes the engine does not define are the model's (DeepSpeed's ``DeepSpeedEngine`` passes
        them through the same way: ``engine.generate(...)``, ``engine.config`` of an HF model...)."""
        module = self.__dict__.get("module")
        if module is not None and not name.startswith("__"):
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def train(self: _Self, mode: bool = True) -> _Self:
        self.module.train(mode)
        return self

    def eval(self: _Self) -> _Self:
        return self.train(False)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    def zero_grad(self) -> None:
        """Gradients never stay on the params (the reducer consumes them); kept for API compatibility."""

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step (before clipping); None before the first."""
        return self.optimizer.last_global_norm if self.global_steps > 0 else None

    def get_mom(self) -> list[Any]:
        """Each param group's momentum: ``momentum`` for SGD/RMSprop, ``betas`` otherwise (DeepSpeed's)."""
        key = "betas" if "betas" in self.optimizer.param_groups[0] else "momentum"
        return [g.get(key) for g in self.optimizer.param_groups]

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def dataloader_drop_last(self) -> bool:
        return self.config.dataloader_drop_last

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def module_state_dict(
        self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """The model's state dict (stage 3: call it inside ``GatheredParameters`` for full tensors)."""
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for n, p in self.module.named_parameters():
                if not p.requires_grad:
                    sd.pop(prefix + n, None)
        return dict(sd)

    def compile(
        self,
        backend: str = "inductor",
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """``torch.compile`` the wrapped model in place (DeepSpeed's ``engine.compile``, which accelerate
        calls when the Trainer's ``torch_compile`` is on): ``nn.Module.compile(backend=, **compile_kwargs)``.
        The stage-3 hooks stay eager (``engine.zero.hooks``). DeepCompile schedules and compiled autograd are
        DeepSpeed's own compiler passes: refused."""
        if schedule is not None or compiled_autograd_enabled:
            raise ValueError(
                "compile: DeepCompile schedules and compiled autograd are not supported by the engine"
            )
        if self.is_compiled:
            return
        kwargs = dict(compile_kwargs or {})
        kwargs.pop("backend", None)  # DeepSpeed: the backend argument overrides one in compile_kwargs
        self.module.compile(backend=backend, **kwargs)
        self.__dict__["_compiled"] = True

    @property
    def is_compiled(self) -> bool:
        return bool(self.__dict__.get("_compiled", False))

    def was_step_applied(self) -> bool:
        return self._step_applied

    def zero_optimization_stage(self) -> int:
        return self.stage

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world

    @property
    def local_rank(self) -> int:
        return _dist.local_rank()

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks: every rank (the engine has no model or pipeline parallelism)."""
        return self.comm.world

    @property
    def mp_world_size(self) -> int:
        return 1
