"""The ``Engine``: DeepSpeed's ``DeepSpeedEngine`` surface over per-parameter ZeRO partitioning.

Algorithm (all stages share it; see ``engine.zero.param`` for the tensor vocabulary):

1. Start-up: materialise meta parameters (``to_empty`` + ``reset_parameters``, module by module), cast
   params and floating buffers to the compute dtype (fp16/bf16/fp32) on the device, broadcast them from rank 0
   in buckets, and cut every param into per-rank chunks: an fp32 *master* chunk for each trainable param
   (stages 1-3: ``ceil(numel / world)`` elements; stage 0: the whole param). Stage 3 keeps only the *shard*
   and releases the full tensor; modules gather it on demand (``engine.zero.fetcher``, driven by the hooks
   of ``engine.zero.hooks``) -- except at partition world 1 without param offload, where the shard would be
   the whole param: it stays materialised, with no hooks and no copies. Each rank's tensors live in flat
   buffers (``engine.zero.partition``): one fp32 master buffer, one grad buffer (fp32, or the compute dtype
   where that is exact: ``Engine._grad_dtype``), one compute-dtype shard (stage 3) or param (partition
   world 1) buffer, the per-param tensors being views, so the optimizer-side work is a few ops over big
   tensors.
2. ``backward(loss)``: divide by the accumulation steps, multiply by the fp16 loss scale, run autograd. Each
   param's full gradient is handed to the bucketed reducer the moment it is final (``engine.zero.grads``) and
   averaged into its *grad shard* (at world 1: added there at once; with optimizer offload: copied
   asynchronously into a pinned host buffer).
3. ``step()`` at an accumulation boundary: overflow check, global-norm clipping and the optimizer step on the
   masters (``engine.optim.optimizer``, fused kernel where torch has one), loss-scale update, LR schedule;
   then the new values go back to the model (partition world 1: one cast-copy of the flat buffer; stages 1-2:
   all-gather into the full params; stage 3: one cast-copy into the shards, re-gather persistent params).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine import dist as _dist
from engine.accessors import DeepSpeedAccessors
from engine.checkpoint.async_save import AsyncSaver
from engine.config import EngineConfig
from engine.optim.loss_scaler import build_loss_scaler
from engine.optim.optimizer import PartitionedOptimizer
from engine.optim.scheduler import build_scheduler
from engine.zero.collectives import Comm
from engine.zero.grads import GradReducer, make_grad_hook
from engine.zero.hooks import ParamFetcher, install_hooks
from engine.zero.param import ParamState
from engine.zero.partition import attach, lay_out, partition_model, pinned

log = logging.getLogger(__name__)

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class Engine(DeepSpeedAccessors):
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
        self.sharded = self.stage == 3 and (self.partition_world > 1 or config.offload_param)
        """Stage-3 params are released between uses. Not at partition world 1 without param offload: the
        shard would be the whole param, so it simply stays materialised (nothing to partition, no hooks)."""
        self.flat_master = torch.zeros(0)
        self.flat_grad = torch.zeros(0)
        self.flat_shard: torch.Tensor | None = None
        self.flat_param: torch.Tensor | None = None
        self._h2d_stage: torch.Tensor | None = None
        self._h2d_done: Any = None
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._boundary: bool | None = None
        self._step_applied = False

        self.states, self.tied = self._partition(model, zc.stage3_param_persistence_threshold)
        self.fetcher: ParamFetcher | None = None
        self._hook_handles: list[Any] = []
        if self.sharded:
            self._install_fetcher(model)
        self.reducer = GradReducer(
            self.comm, zc.reduce_bucket_size, self.partition_world, self.device, self.flat_grad, self.dtype
        )
        self.reducer.comm_dtype = _DTYPES.get(self.config.communication_data_type or "")
        self.reducer.n_trainable = sum(1 for s in self.states if s.trainable)
        release = self.fetcher.release_after_grad if self.fetcher is not None else None
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
            flat_grad=self.flat_grad,
            sub_group=zc.sub_group_size,
        )
        if self.reducer.direct and self.reducer.to_host:
            self.optimizer.lazy_zero = self.reducer
        if optimizer is not None:
            optimizer.param_groups = self.optimizer.param_groups  # a client scheduler now drives ours
        self.loss_scaler = build_loss_scaler(config)
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self.training_dataloader = self._build_dataloader(training_data, collate_fn)
        self.checkpoint_stats: dict[str, Any] = {}
        """Timings of the last finished save (``engine.checkpoint.save``)."""
        self.load_stats: dict[str, Any] = {}
        """Timings of the last ``load_checkpoint`` (``engine.checkpoint.load``): total and tensor reads."""
        self.checkpointer: AsyncSaver | None = (
            AsyncSaver(self) if config.checkpoint.writer.decoupled else None
        )
        """Background writer of ``checkpoint.writer.decoupled`` saves (``engine.checkpoint.async_save``)."""

    # -- start-up -------------------------------------------------------------------------------
    def _partition(self, model: nn.Module, persistence: int) -> tuple[list[ParamState], dict[str, str]]:
        """Build the param states and lay them out in flat buffers (``engine.zero.partition``)."""
        zc = self.config.zero_optimization
        states, tied = partition_model(
            model,
            self.comm,
            device=self.device,
            dtype=self.dtype,
            partition_world=self.partition_world,
            sharded=self.sharded,
            persistence=persistence,
            bucket=zc.allgather_bucket_size,
        )
        cuda = torch.cuda.is_available()
        flat = lay_out(
            states,
            device=self.device,
            dtype=self.dtype,
            master_device=self.master_device,
            shard_device=self.shard_device,
            grad_dtype=self._grad_dtype(),
            sharded=self.sharded,
            pin_opt=cuda and self.master_device.type == "cpu" and pinned(zc.offload_optimizer),
            pin_par=cuda and self.shard_device.type == "cpu" and pinned(zc.offload_param),
        )
        self.flat_master, self.flat_grad = flat.master, flat.grad
        self.flat_shard, self.flat_param = flat.shard, flat.param
        attach(states, self)
        return states, tied

    def _grad_dtype(self) -> torch.dtype:
        """fp32 gradient partitions, or the compute dtype where that loses nothing and saves its memory: one
        process (nothing to average), one micro-step per optimizer step (nothing to accumulate) and the
        buffer on the device (with optimizer offload the host buffer is fp32 and a pinned 16-bit mirror
        takes the copies). Then each slot holds exactly the gradient autograd produced, as DeepSpeed's
        stage 3 keeps it; the optimizer widens it to fp32 one sub-group at a time."""
        one = self.comm.world == 1 and self.config.gradient_accumulation_steps == 1
        if one and self.dtype != torch.float32 and self.master_device == self.device:
            return self.dtype
        return torch.float32

    def _install_fetcher(self, model: nn.Module) -> None:
        """Stage 3, sharded: the fetcher and the module hooks that gather/release params around each use."""
        zc = self.config.zero_optimization
        copies = self.device.type == "cuda" and self.shard_device.type == "cpu"
        self.fetcher = ParamFetcher(
            self.comm,
            self.device,
            self.states,
            bucket_numel=zc.allgather_bucket_size,
            prefetch_numel=zc.stage3_prefetch_bucket_size,
            max_reuse=zc.stage3_max_reuse_distance,
            max_live=zc.stage3_max_live_parameters,
            copy_stream=torch.cuda.Stream(self.device) if copies else None,
        )
        by_id = {id(s.param): s for s in self.states}
        for m in model.modules():
            direct = [by_id[id(p)] for p in m.parameters(recurse=False) if id(p) in by_id]
            if direct:
                self.fetcher.module_params[m] = direct
        self._hook_handles = install_hooks(model, self.fetcher)

    def _build_scheduler(self, client: Any) -> Any:
        if client is None:
            return build_scheduler(self.config, self.optimizer) if self.config.scheduler is not None else None
        if callable(client) and not hasattr(client, "step"):
            # DeepSpeed calls it with its basic (torch) optimizer: torch's own schedules (the Trainer's
            # LambdaLR when the config has an optimizer block and no scheduler block) require one
            return client(self.optimizer.optimizer)
        if getattr(client, "optimizer", None) is not None and client.optimizer is not self.optimizer:
            client.optimizer = self.optimizer.optimizer
        return client

    def _build_dataloader(self, data: Any, collate_fn: Any) -> Any:
        self.collate_fn = collate_fn
        return None if data is None else self.deepspeed_io(data)

    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Any = None,
        num_local_io_workers: int | None = None,
    ) -> Any:
        """DeepSpeed's data loader over ``dataset``: micro batches of this rank's ``DistributedSampler`` share
        (shuffled for ``route`` ``"train"``, in order for ``"eval"``/``"predict"``; DeepSpeed's seed, 0, and
        its epoch, 0, unless the script calls ``loader.data_sampler.set_epoch``), ``dataloader_drop_last``
        from the config. ``engine.data.DeepSpeedDataLoader`` says what it keeps of DeepSpeed's loader."""
        from engine.data import DeepSpeedDataLoader

        return DeepSpeedDataLoader(
            dataset,
            batch_size=batch_size or self.config.train_micro_batch_size_per_gpu,
            world=self.comm.world,
            rank=self.comm.rank,
            shuffle=route == "train",
            data_sampler=data_sampler,
            collate_fn=collate_fn if collate_fn is not None else self.collate_fn,
            pin_memory=pin_memory and self.device.type == "cuda",
            num_workers=num_local_io_workers or 0,
            drop_last=self.config.dataloader_drop_last,
        )

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
            if self.fetcher is not None:
                self.fetcher.sync()  # no host-to-device copy still reads the shards this step rewrites
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
        if self.flat_shard is not None:
            if self.flat_shard is not self.flat_master:
                self._cast_into(self.flat_shard, self.flat_master)
            self.refresh_gathered([s for s in trainable if s.gathered])
        elif self.flat_param is not None:
            self._cast_into(self.flat_param, self.flat_master)
        else:
            self.refresh_gathered(trainable)

    def _cast_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` across dtype and device. Host fp32 -> GPU 16-bit: cast on the host into a
        pinned staging buffer, then ONE asynchronous host-to-device copy (half the bytes of copying fp32)."""
        if src.device == dst.device or src.device.type != "cpu" or dst.dtype == src.dtype:
            dst.copy_(src)
            return
        if self._h2d_stage is None:
            self._h2d_stage = torch.empty(src.numel(), dtype=dst.dtype, pin_memory=torch.cuda.is_available())
        elif self._h2d_done is not None:
            self._h2d_done.synchronize()  # the previous copy out of the staging buffer has finished
        self._h2d_stage.copy_(src)
        dst.copy_(self._h2d_stage, non_blocking=True)
        if dst.device.type == "cuda":
            self._h2d_done = torch.cuda.Event()
            self._h2d_done.record()

    def refresh_gathered(self, states: list[ParamState]) -> None:
        """Overwrite the full tensors of gathered params with every rank's current chunk (bucketed).

        Non-sharded frozen params are skipped: their full tensor is the only copy, already current."""
        states = [s for s in states if s.trainable or s.sharded]
        limit = max(1, self.config.zero_optimization.allgather_bucket_size)
        bucket: list[ParamState] = []
        size = 0
        for i, s in enumerate(states):
            bucket.append(s)
            size += s.numel
            if size >= limit or i == len(states) - 1:
                locals_ = self._local_chunks(bucket)
                if self.partition_world == 1:
                    fulls = [c[: b.numel] for c, b in zip(locals_, bucket, strict=True)]
                else:
                    fulls = self.comm.all_gather_params(locals_, [b.numel for b in bucket])
                for b, full in zip(bucket, fulls, strict=True):
                    with torch.no_grad():
                        b.param.data.copy_(full.view(b.shape))
                bucket, size = [], 0

    def _local_chunks(self, bucket: list[ParamState]) -> list[torch.Tensor]:
        """The bucket's chunks in the compute dtype on the device: one cast over masters that lie back to back
        in the flat buffer (stages 1-2), else one per param; never a model-size copy."""
        adjacent = all(not s.sharded and s.trainable for s in bucket) and all(
            b.flat_offset == a.flat_offset + a.chunk for a, b in zip(bucket[:-1], bucket[1:], strict=True)
        )
        if adjacent:
            lo = bucket[0].flat_offset
            wide = self.flat_master[lo : bucket[-1].flat_offset + bucket[-1].chunk]
            wide = wide.to(self.device, self.dtype, non_blocking=True)
            return [wide[s.flat_offset - lo : s.flat_offset - lo + s.chunk] for s in bucket]
        out = []
        for s in bucket:
            src = s.shard if s.sharded else s.master
            assert src is not None
            out.append(src.to(self.device, self.dtype, non_blocking=True))
        return out

    # -- checkpoints (engine.checkpoint) -----------------------------------------------------------
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Write a checkpoint (collective). With ``checkpoint.writer.decoupled`` it returns once this rank's
        state is snapshotted and the files are written in the background (``wait_for_checkpoint``).

        ``exclude_frozen_parameters``: frozen params are left out, as DeepSpeed leaves them out of its model
        states; loading such a checkpoint needs ``load_module_strict=False`` (the model keeps its own)."""
        from engine import checkpoint
        from engine.checkpoint import ds_layout

        save = ds_layout.save if self.config.checkpoint.format == "deepspeed" else checkpoint.save
        save(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
             exclude_frozen=exclude_frozen_parameters)  # fmt: skip
        return True

    def wait_for_checkpoint(self) -> None:
        """Wait until the save in flight (``checkpoint.writer.decoupled``) is published; raise its error if
        it failed (``engine.checkpoint.CheckpointSaveError``). A no-op for synchronous saves."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def destroy(self) -> None:
        """Finish the save in flight (raising its error), then free the snapshot memory (DeepSpeed's
        ``engine.destroy()``). Call it before ``torch.distributed.destroy_process_group()``."""
        if self.checkpointer is not None:
            saver, self.checkpointer = self.checkpointer, None
            saver.close()

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Restore the engine from ``load_dir`` (``tag``, else what ``latest`` names), with DeepSpeed's
        arguments in DeepSpeed's order; ``(path, client_state)``, or ``(None, None)`` when there is nothing
        to load. ``load_module_strict=False`` loads the tensors model and checkpoint share, skips the rest.
        As in DeepSpeed, ``load_module_only`` leaves optimizer, scheduler and step counters as they were;
        ``load_optimizer_states=False`` / ``load_lr_scheduler_states=False`` leave that state alone (the
        counters are restored)."""
        from engine import checkpoint

        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...) is not supported by the engine")

        if self.checkpointer is not None:
            self.checkpointer.wait_for(load_dir)  # an in-flight save of this folder is published first
        if self.fetcher is not None:
            self.fetcher.sync()  # no host-to-device copy still reads the shards the load rewrites
        return checkpoint.load(
            self,
            load_dir,
            tag=tag,
            load_optimizer_states=load_optimizer_states and not load_module_only,
            load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only,
            strict=load_module_strict,
            module_only=load_module_only,
            client_flags=(load_optimizer_states, load_lr_scheduler_states),
        )

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``stage3_gather_16bit_weights_on_model_save`` (accelerate asks before ``get_state_dict``)."""
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """DeepSpeed's ZeRO-3 full state dict on rank 0 (None elsewhere): collective, one param gathered at a
        time (``engine.export.consolidated_state_dict``); what ``trainer.save_model()`` saves."""
        from engine import export

        if self.stage != 3:
            raise ValueError("this function requires ZeRO-3 mode")
        return export.consolidated_state_dict(self, exclude_frozen=exclude_frozen_parameters)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        from engine import export

        return export.save_16bit_model(self, save_dir, save_filename)
