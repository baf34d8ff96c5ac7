"""The ``Engine``: DeepSpeed's ``DeepSpeedEngine`` surface over per-parameter ZeRO partitioning.

Algorithm (all stages share it; see ``engine.param`` for the tensor vocabulary):

1. Start-up: materialise meta parameters (``to_empty`` + ``reset_parameters``, module by module), cast
   params and floating buffers to the compute dtype (fp16/bf16/fp32) on the device, broadcast them from rank 0
   in buckets, and cut every param into per-rank chunks: an fp32 *master* chunk for each trainable param
   (stages 1-3: ``ceil(numel / world)`` elements; stage 0: the whole param). Stage 3 keeps only the *shard*
   and releases the full tensor; modules gather it on demand (``engine.hooks``).
2. ``backward(loss)``: divide by the accumulation steps, multiply by the fp16 loss scale, run autograd. Each
   param's full gradient is handed to the bucketed reducer the moment it is final (``engine.grads``) and
   averaged into its fp32 *grad shard*.
3. ``step()`` at an accumulation boundary: overflow check, global-norm clipping and the optimizer step on the
   masters (``engine.optimizer``), loss-scale update, LR schedule; then the new values go back to the model
   (stages 0-2: all-gather into the full params; stage 3: refresh the shards, re-gather persistent params).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine import dist as _dist
from engine.collectives import Comm
from engine.config import EngineConfig
from engine.grads import GradReducer, make_grad_hook
from engine.hooks import ParamFetcher, install_hooks
from engine.loss_scaler import build_loss_scaler
from engine.optimizer import PartitionedOptimizer
from engine.param import ParamState
from engine.scheduler import build_scheduler

log = logging.getLogger(__name__)

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class Engine:
    """A model trained with ZeRO partitioning. Built by ``engine.initialize``."""

    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        model_parameters: Iterable[Any] | None = None,
        lr_scheduler: Any = None,
        training_data: Any = None,
        collate_fn: Any = None,
    ) -> None:
        self.comm = Comm()
        self.config = config
        self.module = model
        self.device = _dist.device()
        zc = config.zero_optimization
        self.stage = config.zero_stage
        self.dtype = _DTYPES[config.precision]
        self.partition_world = 1 if self.stage == 0 else self.comm.world
        self.master_device = torch.device("cpu") if config.offload_optimizer else self.device
        self.shard_device = torch.device("cpu") if config.offload_param else self.device
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._boundary: bool | None = None
        self._step_applied = False

        self.states, self.tied = self._partition(model, zc.stage3_param_persistence_threshold)
        self.fetcher: ParamFetcher | None = None
        self._hook_handles: list[Any] = []
        if self.stage == 3:
            self.fetcher = ParamFetcher(
                self.comm, self.device, zc.allgather_bucket_size, zc.stage3_prefetch_bucket_size
            )
            by_id = {id(s.param): s for s in self.states}
            for m in model.modules():
                direct = [by_id[id(p)] for p in m.parameters(recurse=False) if id(p) in by_id]
                if direct:
                    self.fetcher.module_params[m] = direct
            self._hook_handles = install_hooks(model, self.fetcher)
        self.reducer = GradReducer(self.comm, zc.reduce_bucket_size, self.partition_world)
        release = self._release_one if self.stage == 3 else None
        for s in self.states:
            if s.trainable:
                self._hook_handles.append(
                    s.param.register_post_accumulate_grad_hook(make_grad_hook(s, self.reducer, release))
                )

        self.optimizer = PartitionedOptimizer(
            self.states,
            self.comm,
            client=optimizer,
            config=config.optimizer,
            model_parameters=model_parameters,
            partitioned=self.partition_world > 1,
        )
        if optimizer is not None:
            optimizer.param_groups = self.optimizer.param_groups  # a client scheduler now drives ours
        self.loss_scaler = build_loss_scaler(config)
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self.training_dataloader = self._build_dataloader(training_data, collate_fn)

    # -- start-up -------------------------------------------------------------------------------
    def _partition(self, model: nn.Module, persistence: int) -> tuple[list[ParamState], dict[str, str]]:
        _materialize(model, self.device)
        for m in model.modules():
            for key, buf in m._buffers.items():
                if buf is not None:
                    m._buffers[key] = buf.to(
                        self.device, self.dtype if buf.is_floating_point() else buf.dtype
                    )
        owners: dict[int, ParamState] = {}
        tied: dict[str, str] = {}
        states: list[ParamState] = []
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in owners:
                owner = owners[id(p)]
                owner.aliases = (*owner.aliases, name)
                tied[name] = owner.name
                continue
            p.data = p.data.to(self.device, self.dtype if p.is_floating_point() else p.dtype)
            st = ParamState(
                name=name,
                param=p,
                shape=tuple(p.shape),
                numel=p.numel(),
                partition_world=self.partition_world,
                rank=self.comm.rank if self.partition_world > 1 else 0,
                trainable=p.requires_grad,
                sharded=self.stage == 3,
                persistent=self.stage == 3 and p.numel() <= persistence,
            )
            owners[id(p)] = st
            states.append(st)
        self._broadcast([s.param.data for s in states] + [b for b in model.buffers()])
        engine_ref = weakref.ref(self)
        for s in states:
            if s.trainable:
                s.master = s.slice_of(s.param.data).to(self.master_device, torch.float32)
                s.grad_shard = torch.zeros(s.chunk, dtype=torch.float32, device=self.master_device)
            if s.sharded:
                same = self.dtype == torch.float32 and self.master_device == self.shard_device
                s.shard = (
                    s.master
                    if (same and s.master is not None)
                    else s.slice_of(s.param.data).to(self.shard_device)
                )
                if self.shard_device.type == "cpu" and self.device.type == "cuda" and _pin(self.config):
                    s.shard = s.shard.pin_memory()
                s.release()
            s.param._zstate = s  # type: ignore[attr-defined]
            s.param._zengine = engine_ref  # type: ignore[attr-defined]
        return states, tied

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's initial values everywhere (DeepSpeed broadcasts the model at start), in buckets."""
        if not self.comm.distributed:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        limit = max(1, self.config.zero_optimization.allgather_bucket_size)
        for group in by_dtype.values():
            bucket: list[torch.Tensor] = []
            size = 0
            for t in group:
                bucket.append(t)
                size += t.numel()
                if size >= limit:
                    self.comm.broadcast_flat_(bucket)
                    bucket, size = [], 0
            self.comm.broadcast_flat_(bucket)

    def _build_scheduler(self, client: Any) -> Any:
        if client is None:
            return build_scheduler(self.config, self.optimizer) if self.config.scheduler is not None else None
        if callable(client) and not hasattr(client, "step"):
            return client(self.optimizer)
        if getattr(client, "optimizer", None) is not None and client.optimizer is not self.optimizer:
            client.optimizer = self.optimizer.optimizer
        return client

    def _build_dataloader(self, data: Any, collate_fn: Any) -> Any:
        if data is None:
            return None
        from torch.utils.data import DataLoader, DistributedSampler

        sampler: DistributedSampler[Any] = DistributedSampler(
            data, num_replicas=self.comm.world, rank=self.comm.rank
        )
        return DataLoader(
            data,
            batch_size=self.config.train_micro_batch_size_per_gpu,
            sampler=sampler,
            collate_fn=collate_fn,
            drop_last=self.config.dataloader_drop_last,
        )

    def _release_one(self, state: ParamState) -> None:
        state.release()

    # -- training loop --------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    __call__ = forward

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Scale the loss (1/accumulation steps, fp16 loss scale), run autograd and reduce the gradients."""
        if scale_wrt_gas and self.config.gradient_accumulation_steps > 1:
            loss = loss / self.config.gradient_accumulation_steps
        scaled = loss * self.loss_scaler.loss_scale if self.config.fp16.enabled else loss
        if self.fetcher is not None:
            self.fetcher.start_backward()
        scaled.backward(retain_graph=retain_graph)
        self.reducer.flush()
        if self.fetcher is not None:
            self.fetcher.release_all()
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary = is_boundary

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Apply the optimizer at an accumulation boundary; count the micro-step either way."""
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            fp16 = self.config.fp16.enabled
            check = fp16 or (self.config.bf16.enabled and self.config.bf16.check_grad_overflow)
            applied = self.optimizer.step(
                loss_scale=self.loss_scaler.loss_scale if fp16 else 1.0,
                clip=self.config.gradient_clipping,
                check_overflow=check,
            )
            if fp16:
                self.loss_scaler.update_scale(not applied)
            if applied:
                self._publish()
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            else:
                self.skipped_steps += 1
            self._step_applied = applied
            self.global_steps += 1
            self.global_samples += self.config.train_batch_size
        self.micro_steps += 1

    def _publish(self) -> None:
        """Bring the updated masters back into the model (see the module docstring, step 3)."""
        trainable = [s for s in self.states if s.trainable]
        if self.stage == 3:
            for s in trainable:
                assert s.shard is not None and s.master is not None
                if s.shard is not s.master:
                    s.shard.copy_(s.master)
            self.refresh_gathered([s for s in trainable if s.gathered])
        else:
            self.refresh_gathered(trainable)

    def refresh_gathered(self, states: list[ParamState]) -> None:
        """Overwrite the full tensors of gathered params with every rank's current chunk (bucketed)."""
        limit = max(1, self.config.zero_optimization.allgather_bucket_size)
        bucket: list[ParamState] = []
        size = 0
        for i, s in enumerate(states):
            bucket.append(s)
            size += s.numel
            if size >= limit or i == len(states) - 1:
                locals_ = [self._local_chunk(b) for b in bucket]
                if self.partition_world == 1:
                    fulls = [c[: b.numel] for c, b in zip(locals_, bucket, strict=True)]
                else:
                    fulls = self.comm.all_gather_params(locals_, [b.numel for b in bucket])
                for b, full in zip(bucket, fulls, strict=True):
                    with torch.no_grad():
                        b.param.data.copy_(full.view(b.shape))
                bucket, size = [], 0

    def _local_chunk(self, s: ParamState) -> torch.Tensor:
        src = s.shard if s.sharded else s.master
        assert src is not None
        return src.to(self.device, self.dtype)

    # -- DeepSpeedEngine accessors ----------------------------------------------------------------
    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    def zero_grad(self) -> None:
        """Gradients never stay on the params (the reducer consumes them); kept for API compatibility."""

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float:
        return self.optimizer.last_global_norm

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

    # -- checkpoints (engine.checkpoint) -----------------------------------------------------------
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
    ) -> bool:
        from engine import checkpoint

        checkpoint.save(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest)
        return True

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        from engine import checkpoint

        return checkpoint.load(
            self,
            load_dir,
            tag=tag,
            load_optimizer_states=load_optimizer_states and not load_module_only,
            load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only,
        )

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        from engine import export

        return export.save_16bit_model(self, save_dir, save_filename)


def _pin(config: EngineConfig) -> bool:
    off = config.zero_optimization.offload_param
    return bool(off is not None and off.pin_memory)


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Give meta-device params/buffers real storage, module by module, and re-run their initialisers."""
    for m in model.modules():
        direct = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        if any(t.is_meta for t in direct):
            m.to_empty(device=device, recurse=False)
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()
