"""What ``load_checkpoint`` returns, as DeepSpeed 0.19.8's ``DeepSpeedEngine.load_checkpoint`` returns it.

DeepSpeed returns ``(load_path, client_state)``: ``load_path`` is the model-states file this rank read
(``<tag>/mp_rank_00_model_states.pt``; ZeRO-3: ``<tag>/zero_pp_rank_<rank>_mp_rank_00_model_states.pt``) and
``client_state`` is every top-level key of that file that the load did not consume: its own bookkeeping
(``buffer_names``, ``param_shapes``, ``frozen_param_shapes``, ``shared_params``, ``frozen_param_fragments``,
``global_samples``, ``checkpoint_parallel_dimensions``, ``ds_config``, ``ds_version``; ``lr_scheduler`` when
its state was not loaded, ``optimizer`` (None under ZeRO) when the optimizer's was not; with
``load_module_only`` also the step counters and world sizes), then the script's own ``client_state`` keys.

The engine builds the same dict, in DeepSpeed's key order, from the loaded engine and the checkpoint's
``TrainingState`` whatever the checkpoint's format (native or DeepSpeed), as the saving run's ZeRO stage
wrote it (e.g. no frozen shapes from stage 0-1): names and shapes from the model
(a strict load has checked they are the checkpoint's), the frozen fragments from the loaded params,
counters, scheduler and config from the checkpoint. ``load_path`` of a DeepSpeed checkpoint is the file
DeepSpeed names; of a native one, the rank file holding this rank's state (there is no model-states file).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from engine.version import __version__
from engine.zero.partition import persistent_buffers
from zckpt.checkpoint import Checkpoint
from zckpt.formats.native import layout as L
from zckpt.storage.location import location

if TYPE_CHECKING:
    from engine.engine import Engine


def load_path(eng: Engine, ckpt: Checkpoint) -> str:
    """The file DeepSpeed's ``load_checkpoint`` names as the one it loaded (see the module doc): of a
    DeepSpeed checkpoint, the model-states file of this rank's kind that exists (ZeRO-3's per-rank file
    first when the engine runs stage 3); of a native one, this rank's rank file."""
    tag_dir = location(ckpt.meta.path)
    per_rank = tag_dir / f"zero_pp_rank_{eng.comm.rank}_mp_rank_00_model_states.pt"
    shared = tag_dir / "mp_rank_00_model_states.pt"
    names = [per_rank, shared] if eng.stage == 3 else [shared, per_rank]
    for f in names:
        if f.is_file():
            return str(f)
    if (tag_dir / L.MANIFEST).is_file():  # the rank file as it is named (a save to s3:// names a generation)
        rank = eng.comm.rank % max(1, ckpt.meta.world_size or 1)
        for file in ckpt.meta.files:
            name = file.rsplit("/", 1)[-1]
            if name.startswith(f"rank_{rank:05d}.") and L.RANK_FILE.fullmatch(name):
                return str(tag_dir / name)
        return str(tag_dir / L.rank_file(rank))
    return str(names[0])


def client_state(
    eng: Engine,
    ckpt: Checkpoint,
    client: Any,
    *,
    flags: tuple[bool, bool],
    module_only: bool,
) -> dict[str, Any]:
    """DeepSpeed's ``client_state`` for this load (see the module doc); ``client`` is the script's own,
    ``flags`` the call's ``(load_optimizer_states, load_lr_scheduler_states)``."""
    load_optimizer_states, load_lr_scheduler_states = flags
    st = ckpt.meta.state
    # what the saving run's stage put in its model-states file (its entries are this file's keys)
    saver = ckpt.meta.stage if ckpt.meta.stage is not None else eng.stage
    stage3 = saver == 3
    zero = saver > 0
    top: dict[str, Any] = OrderedDict()
    top["buffer_names"] = [n for n, _ in persistent_buffers(eng.module)]
    top["optimizer"] = None  # under ZeRO the optimizer states are in the optim-states files
    top["param_shapes"] = _param_shapes(eng) if zero else None
    top["frozen_param_shapes"] = (
        OrderedDict((s.name, torch.Size(s.shape)) for s in eng.states if not s.trainable)
        if saver >= 2
        else None
    )
    top["shared_params"] = dict(eng.tied) if zero and (eng.comm.rank == 0 or not stage3) else {}
    if not zero:
        top["shared_params"] = None
    top["frozen_param_fragments"] = _frozen_fragments(eng, stage3) if saver >= 2 else None
    top["lr_scheduler"] = st.scheduler
    top["data_sampler"] = None
    top["random_ltd"] = None
    c = st.counters
    top["skipped_steps"] = c.skipped_steps or 0
    top["global_steps"] = c.global_steps or 0
    top["global_samples"] = c.global_samples if c.global_samples is not None else eng.global_samples
    top["dp_world_size"] = ckpt.meta.world_size
    top["mp_world_size"] = 1
    top["checkpoint_parallel_dimensions"] = {"pp_degree": 1, "tp_degree": 1}
    top["ds_config"] = st.config
    top["ds_version"] = st.private("deepspeed").get("ds_version") or __version__
    consumed = {"module"}  # DeepSpeed's deepspeed_states; the two flags count as given, module_only or not
    if not module_only:
        consumed |= {"skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler"}
        consumed |= {"random_ltd"}
    if load_lr_scheduler_states:
        consumed.add("lr_scheduler")
    if load_optimizer_states:
        consumed.add("optimizer")
    out = {k: v for k, v in top.items() if k not in consumed}
    if isinstance(client, dict):
        out.update(client)
    return out


def _param_shapes(eng: Engine) -> list[OrderedDict[str, torch.Size]]:
    """One ``{name: shape}`` per optimizer param group, in group order (DeepSpeed's ``param_shapes``)."""
    by_master = {id(s.master): s for s in eng.states if s.master is not None}
    out = []
    for g in eng.optimizer.optimizer.param_groups:
        states = [by_master[id(p)] for p in g["params"] if id(p) in by_master]
        out.append(OrderedDict((s.name, torch.Size(s.shape)) for s in states))
    return out


def _frozen_fragments(eng: Engine, stage3: bool) -> OrderedDict[str, torch.Tensor]:
    """Each frozen param as DeepSpeed saves it: whole (stage 2), this rank's flat partition (stage 3: its
    ``ds_tensor``, ``ceil(numel / world)`` elements, the last rank's zero-padded)."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for s in eng.states:
        if s.trainable:
            continue
        if not stage3:
            out[s.name] = s.param.detach().cpu().clone()
        elif s.sharded and s.shard is not None:
            out[s.name] = s.shard.detach().reshape(-1).cpu().clone()
        else:
            out[s.name] = s.param.detach().reshape(-1).cpu().clone()
    return out
