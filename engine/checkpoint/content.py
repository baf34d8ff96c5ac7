"""What one save of an ``Engine`` holds, captured when ``save_checkpoint`` is called.

``capture`` collects this rank's rank-file items (fp32 master chunks, optimizer-state chunks, frozen chunks,
its RNG; rank 0 also the persistent buffers, in their own dtype, and client-state tensors) as ``WriteItem``s
over the live tensors (on whatever device they live: nothing is copied here), this rank's Python/NumPy RNG
state, and on rank 0 everything the manifest needs besides the rank files' records (``ManifestArgs``: tensor
and optimizer-state specs, tied names, the ``TrainingState`` with optimizer groups, scheduler, loss scaler,
counters, client state and config, all converted to JSON values, i.e. copies). A synchronous save writes the
items straight away; an asynchronous one snapshots their bytes first (``engine.checkpoint.host``), after which
training may change every live tensor. ``predict_bytes`` estimates a rank file's size before the optimizer has
any state.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.checkpoint_optim import state_layout
from engine.zero.partition import persistent_buffers
from zckpt.formats.native import layout as L
from zckpt.formats.native import record
from zckpt.formats.native import write as W
from zckpt.model import Role, dtype_name
from zckpt.state import Counters, OptimizerState, ParamGroup, RankRng, TrainingState, to_json
from zckpt.storage.location import Location, local
from zckpt.stream.items import WriteItem, entry_from_tensor

if TYPE_CHECKING:
    from engine.engine import Engine


def staging_dir(save_dir: Path, tag: str) -> Path:
    """Where the ranks of one save into a local ``save_dir`` write the tag folder before rank 0 publishes it
    (an ``s3://`` save dir gets a fresh local stand-in instead: ``engine.checkpoint.save.prepare``)."""
    return save_dir / f".{tag}.staging"


@dataclass(frozen=True)
class ManifestArgs:
    """Everything ``zckpt.formats.native.write.build_manifest`` needs besides the rank files' records and
    the ranks' RNG states (rank 0 only)."""

    tag: str
    world: int
    stage: int
    tensors: list[L.TensorSpec]
    optim_states: list[L.OptimSpec]
    tied: dict[str, str]
    state: TrainingState
    client_state: Any


@dataclass(frozen=True)
class RankSave:
    """One rank's part of one save."""

    root: Location
    tag: str
    rank: int
    world: int
    items: list[WriteItem]
    """This rank's rank-file tensors in file order (live tensors until snapshotted)."""
    rng: dict[str, Any]
    """This rank's Python and NumPy RNG states (JSON), for the manifest."""
    manifest: ManifestArgs | None
    save_latest: bool
    stage: Path | None = None
    """Where this rank writes its file (``prepare``); None: ``staging_dir``."""
    generation: str | None = None
    """The generation in the rank files' names (an ``s3://`` save: ``prepare``)."""

    @property
    def model_record(self) -> dict[str, str] | None:
        """Rank 0's model record for its rank file's header (``zckpt.formats.native.record``)."""
        m = self.manifest
        return None if m is None else record.encode(m.tensors, m.tied, W.precision_of(m.state))

    @property
    def tag_dir(self) -> Location:
        return self.root / self.tag

    @property
    def stage_dir(self) -> Path:
        if self.stage is not None:
            return self.stage
        return staging_dir(local(self.root, "a save without a stand-in folder"), self.tag)

    @property
    def rank_path(self) -> Path:
        return self.stage_dir / L.rank_file(self.rank, self.generation)


def capture(
    eng: Engine,
    root: Location,
    tag: str,
    client_state: Mapping[str, Any],
    save_latest: bool,
    exclude_frozen: bool = False,
) -> RankSave:
    """This rank's part of a save of ``eng`` as it is now (see the module doc). ``exclude_frozen``: frozen
    params are left out of the rank files and the manifest (DeepSpeed's ``exclude_frozen_parameters``), with
    any tie whose owner is one of them."""
    rank = eng.comm.rank
    client = client_entries(dict(client_state), "")
    left_out = frozenset(s.name for s in eng.states if exclude_frozen and not s.trainable)
    items, optim_specs = _rank_items(eng, client if rank == 0 else {}, left_out)
    rng = _rank_rng()
    items += W.rng_items(rng)
    man = None
    if rank == 0:
        man = ManifestArgs(
            tag=tag,
            world=eng.comm.world,
            stage=eng.stage,
            tensors=_tensor_specs(eng, left_out),
            optim_states=optim_specs,
            tied={a: o for a, o in eng.tied.items() if o not in left_out},
            state=training_state(eng, client),
            client_state=W.client_tree(client)[0],
        )
    return RankSave(root, tag, rank, eng.comm.world, items, W.rng_json(rng), man, save_latest)


def _rank_rng() -> RankRng:
    np_state: Any = np.random.get_state()
    torch_states = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        torch_states["torch_cuda"] = torch.cuda.get_rng_state()
    return RankRng(
        to_json(random.getstate()),
        [np_state[0], np_state[1].tolist(), *[to_json(x) for x in np_state[2:]]],
        {k: entry_from_tensor(k, t, Role.BUFFER) for k, t in torch_states.items()},
    )


def _rank_items(
    eng: Engine, client: Mapping[str, Any], left_out: frozenset[str] = frozenset()
) -> tuple[list[WriteItem], list[L.OptimSpec]]:
    """This rank's tensors for its rank file, and the optimizer-state specs (the same on every rank)."""
    r, pw = eng.comm.rank, eng.partition_world
    items: list[WriteItem] = []
    specs: list[L.OptimSpec] = []
    inner = eng.optimizer.optimizer
    for s in eng.states:
        if s.trainable:
            assert s.master is not None
            for k, v in inner.state.get(s.master, {}).items():
                t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
                part = t.shape == s.master.shape and t.dim() == 1
                if r < pw:
                    items.append(W.tensor_item(L.optim_key(k, s.name), t))
                py = None if isinstance(v, torch.Tensor) else type(v).__name__
                shape = s.shape if part else tuple(t.shape)
                specs.append(L.OptimSpec(s.name, k, shape, dtype_name(t.dtype), part, py))
        if r < pw and s.name not in left_out:
            role = Role.PARAM if s.trainable else Role.FROZEN
            val = s.master if s.trainable else s.local_values()
            assert val is not None
            items.append(W.tensor_item(L.tensor_key(role, s.name), val))
    if r == 0:
        for name, b in persistent_buffers(eng.module):
            items.append(W.tensor_item(L.tensor_key(Role.BUFFER, name), b))
        items += W.client_tree(client)[1]
    return items, specs


def _tensor_specs(eng: Engine, left_out: frozenset[str] = frozenset()) -> list[L.TensorSpec]:
    specs = [
        L.TensorSpec(
            s.name,
            s.shape,
            "float32" if s.trainable else dtype_name(s.dtype),
            Role.PARAM if s.trainable else Role.FROZEN,
            True,
        )
        for s in eng.states
        if s.name not in left_out
    ]
    specs += [
        L.TensorSpec(n, tuple(b.shape), dtype_name(b.dtype), Role.BUFFER, False)
        for n, b in persistent_buffers(eng.module)
    ]
    return specs


def training_state(eng: Engine, client: Mapping[str, Any]) -> TrainingState:
    """The engine's state beside its tensors, as every native writer consumes it."""
    inner = eng.optimizer.optimizer
    names_by_master = {id(s.master): s.name for s in eng.states if s.master is not None}
    groups = tuple(
        ParamGroup(
            tuple(names_by_master[id(p)] for p in g["params"]),
            {k: to_json(v) for k, v in g.items() if k != "params"},
        )
        for g in inner.param_groups
    )
    names = sorted({k for s in eng.states if s.master is not None for k in inner.state.get(s.master, {})})
    sched = eng.lr_scheduler.state_dict() if eng.lr_scheduler is not None else None
    return TrainingState(
        stage=eng.stage,
        precision=eng.config.precision,
        optimizer=OptimizerState(type(inner).__name__, groups, tuple(names)),
        scheduler=to_json(sched),
        loss_scaler=to_json(eng.loss_scaler.state_dict()),
        counters=Counters(eng.global_steps, eng.global_samples, eng.skipped_steps, eng.micro_steps),
        client_state=client,
        config=to_json(eng.config.to_dict()),
    )


def client_entries(obj: Any, path: str) -> Any:
    """client_state with tensors as entries (written into rank 0's file); JSON values otherwise."""
    if isinstance(obj, torch.Tensor):
        return entry_from_tensor(f"client/{path}", obj.detach().cpu().contiguous(), Role.BUFFER)
    if isinstance(obj, dict):
        return {str(k): client_entries(v, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [client_entries(v, f"{path}.{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"client_state value at {path!r} is a {type(obj).__name__}; use JSON values or tensors")


def predict_bytes(eng: Engine) -> int:
    """About the size of this rank's rank file, also before the optimizer has stepped (its per-element
    states then come from one probe step of the same optimizer class): tensors plus header and RNG."""
    r, pw = eng.comm.rank, eng.partition_world
    inner = eng.optimizer.optimizer
    total = 1 << 20  # header, RNG states
    per_group: dict[int, tuple[int, int]] = {}  # group -> (bytes per element, bytes per param)
    for s in eng.states if r < pw else []:
        if not s.trainable:
            total += s.chunk * s.dtype.itemsize
            continue
        assert s.master is not None
        g = next((g for g in inner.param_groups if any(p is s.master for p in g["params"])), {})
        if id(g) not in per_group:
            per_elem, fixed = s.master.element_size(), 0
            for v in (state_layout(inner, g, s.master) or {}).values():
                t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
                if tuple(t.shape) == tuple(s.master.shape):
                    per_elem += t.element_size()
                else:
                    fixed += math.prod(t.shape) * t.element_size()
            per_group[id(g)] = (per_elem, fixed)
        per_elem, fixed = per_group[id(g)]
        total += s.master.numel() * per_elem + fixed
    if r == 0:
        total += sum(b.numel() * b.element_size() for _, b in persistent_buffers(eng.module))
    return total
