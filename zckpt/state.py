"""The training state beside the tensors, in one typed shape for every format.

Every reader fills one ``TrainingState`` (optimizer kind and param groups, LR scheduler, loss scaler, step
counters, client state, per-rank RNG, the run's config); every writer (native, DeepSpeed, the engine's
load) consumes it, so no operation needs to know which format a checkpoint came from. Tensors inside the
state (client-state tensors, RNG states) are ``TensorEntry`` leaves, read only when a writer needs them.
``framework`` carries what only one framework can use, verbatim, under that framework's name.

``CheckpointMeta`` is a checkpoint's manifest: where and what it is (format, path, world size, tag, tied
names, files) and its ``TrainingState``.

``to_json`` is the one conversion of state values (tensors, numpy scalars, dtypes, enums, stand-in
records) into JSON values.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from zckpt.dtypes import DType, is_torch_dtype
from zckpt.errors import CorruptCheckpoint
from zckpt.model import TensorEntry, dtype_name


@dataclass(frozen=True)
class ParamGroup:
    """One optimizer param group: its parameters (by state-dict name) and its hyper-parameters."""

    params: tuple[str, ...]
    options: Mapping[str, Any] = field(default_factory=dict)
    """``lr``, ``betas``, ``weight_decay``...: JSON values (``betas`` as a list), exactly as saved."""


@dataclass(frozen=True)
class OptimizerState:
    """The optimizer as the checkpoint records it (per-parameter states are ``Role.OPTIM`` entries)."""

    kind: str
    groups: tuple[ParamGroup, ...] = ()
    state_names: tuple[str, ...] = ()

    def group_of(self, name: str) -> int | None:
        """Index of the group holding parameter ``name``."""
        return next((i for i, g in enumerate(self.groups) if name in g.params), None)

    def tensor_option(self) -> str | None:
        """The first option that is (or holds) a tensor, described (``param group 0's option 'lr' is a tensor
        []``), or None: torch takes a tensor ``lr``, and DCP saves it as a tensor item."""
        for i, g in enumerate(self.groups):
            for path, e in tensor_leaves(dict(g.options)):
                return f"param group {i}'s option {path!r:.80} is a tensor {list(e.shape)}"
        return None


@dataclass(frozen=True)
class Counters:
    """Step counters; ``None`` where the format does not record one."""

    global_steps: int | None = None
    global_samples: int | None = None
    skipped_steps: int | None = None
    micro_steps: int | None = None


@dataclass(frozen=True)
class RankRng:
    """One rank's random-number generator states: Python's and NumPy's as JSON, torch's as tensors."""

    python: Any = None
    numpy: Any = None
    torch: Mapping[str, TensorEntry] = field(default_factory=dict)
    """``"torch_cpu"`` / ``"torch_cuda"`` -> the ``get_rng_state()`` byte tensor."""


@dataclass(frozen=True)
class TrainingState:
    """Everything in a training checkpoint that is not a model tensor or a per-parameter optimizer state."""

    stage: int | None = None
    """ZeRO stage the run used (``None``: not a ZeRO checkpoint)."""
    precision: str | None = None
    """Training precision: ``fp32``, ``bf16`` or ``fp16`` (``None``: unknown)."""
    optimizer: OptimizerState | None = None
    scheduler: Any = None
    """The LR scheduler's ``state_dict()`` (JSON values)."""
    loss_scaler: Mapping[str, Any] | None = None
    """The fp16 loss scaler's attributes (``cur_scale``, ``dynamic``, ...), JSON values."""
    counters: Counters = field(default_factory=Counters)
    client_state: Mapping[str, Any] = field(default_factory=dict)
    """What the training script saved beside the model (``save_checkpoint(client_state=...)``): nested
    dicts/lists of JSON values and ``TensorEntry`` leaves."""
    rng: tuple[RankRng, ...] = ()
    """Per saving rank; empty when the format saves none (DeepSpeed)."""
    config: Mapping[str, Any] | None = None
    """The run's (DeepSpeed-shaped) config, JSON values."""
    framework: Mapping[str, Any] = field(default_factory=dict)
    """Framework-private state kept verbatim for a writer of the same framework, keyed by its name."""

    def private(self, name: str) -> Mapping[str, Any]:
        """The ``framework`` entry of ``name`` (empty when the source came from another framework)."""
        got = self.framework.get(name)
        return got if isinstance(got, Mapping) else {}


@dataclass(frozen=True)
class CheckpointMeta:
    """The manifest: everything about a checkpoint that is not tensor bytes."""

    format: str
    path: str
    """The folder (or single file) holding this checkpoint's files: for formats with tags (DeepSpeed,
    native) the tag folder, whatever path the user gave."""
    world_size: int = 1
    tag: str | None = None
    save_dir: str | None = None
    """The folder holding ``latest`` and the other tags, for formats that have one."""
    tied: Mapping[str, str] = field(default_factory=dict)
    """``{alias: owner}`` of tied parameters; only owners have entries."""
    tied_files: Mapping[str, str] = field(default_factory=dict)
    """``{alias: file}``: the file that records each tie, named when the tie is bad (default ``path``)."""
    files: tuple[str, ...] = ()
    state: TrainingState = field(default_factory=TrainingState)
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Format-private facts for ``inspect`` (DeepSpeed sub-groups, an HF index path...); no operation
    reads them."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise CorruptCheckpoint(f"{self.path}: world size {self.world_size}", path=self.path)
        for alias, owner in self.tied.items():
            if alias == owner:
                where = self.tie_file(alias)
                raise CorruptCheckpoint(f"{where}: tied alias {alias!r:.80} points at itself", path=where)

    def tie_file(self, alias: str) -> str:
        """The file that records ``alias``'s tie."""
        return self.tied_files.get(alias, self.path)

    @property
    def stage(self) -> int | None:
        """ZeRO stage of the run that saved it (None: not a ZeRO checkpoint, e.g. DCP)."""
        return self.state.stage

    @property
    def precision(self) -> str | None:
        """Training precision as recorded (``fp32``/``bf16``/``fp16``; None: not recorded)."""
        return self.state.precision

    @property
    def step(self) -> int | None:
        """Optimizer steps taken (``global_steps``; None: not recorded)."""
        return self.state.counters.global_steps

    @property
    def optimizer(self) -> OptimizerState | None:
        """The optimizer's class, param groups and state names (None: no optimizer state)."""
        return self.state.optimizer

    @property
    def config(self) -> Mapping[str, Any] | None:
        """The training config saved with it (DeepSpeed's ``ds_config``; None: none)."""
        return self.state.config

    def to_json(self) -> dict[str, Any]:
        """This manifest as JSON values (what ``zckpt inspect --json`` prints)."""
        out: dict[str, Any] = _describe({f.name: getattr(self, f.name) for f in fields(self)})
        return out


def _describe(o: Any) -> Any:
    """``to_json`` for display: dataclasses as dicts, tensor leaves as short descriptions."""
    if isinstance(o, TensorEntry):
        return f"<tensor {list(o.shape)} {dtype_name(o.dtype)}>"
    if hasattr(o, "__dataclass_fields__"):
        return {f.name: _describe(getattr(o, f.name)) for f in fields(o)}
    if isinstance(o, Mapping):
        return {str(k): _describe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_describe(v) for v in o]
    return to_json(o)


def to_json(o: Any) -> Any:
    """``o`` as JSON values: small tensors as numbers/lists, dtypes by name, enums by value, stand-in
    records (anything with ``to_dict``) as dicts, tuples and sets as lists; ``TensorEntry`` leaves stay."""
    if o is None or isinstance(o, (bool, int, float, str, TensorEntry)):
        return o
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")  # no tensor or array exists without them
    if torch is not None and isinstance(o, torch.Tensor):
        return o.item() if o.numel() == 1 else o.tolist()
    if isinstance(o, DType) or is_torch_dtype(o):
        return dtype_name(o)
    if isinstance(o, enum.Enum):
        return to_json(o.value)
    if np is not None and isinstance(o, (np.generic, np.ndarray)):
        return o.item() if isinstance(o, np.generic) else o.tolist()
    if isinstance(o, Mapping):
        return {str(k): to_json(v) for k, v in o.items()}
    if isinstance(o, (list, tuple, set, frozenset)):
        return [to_json(v) for v in o]
    if hasattr(o, "to_dict"):
        return to_json(o.to_dict())
    return repr(o)


def tensor_leaves(o: Any, path: str = "") -> list[tuple[str, TensorEntry]]:
    """``(dotted path, entry)`` of every ``TensorEntry`` leaf of a nested state value, in order."""
    if isinstance(o, TensorEntry):
        return [(path, o)]
    if isinstance(o, Mapping):
        return [x for k, v in o.items() for x in tensor_leaves(v, f"{path}.{k}" if path else str(k))]
    if isinstance(o, (list, tuple)):
        return [x for i, v in enumerate(o) for x in tensor_leaves(v, f"{path}.{i}")]
    return []
