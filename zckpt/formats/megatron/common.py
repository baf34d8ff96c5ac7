"""Megatron's ``common.pt``: everything of a ``torch_dist`` save that is not sharded, read without Megatron.

``torch.save`` of a dict written by rank 0: ``args`` (``argparse.Namespace`` of every Megatron-LM argument),
``checkpoint_version``, ``iteration``, ``optimizer`` (``param_groups``, ``state`` with ``common_step``; with
the distributed optimizer ``param_state_sharding_type``), ``opt_param_scheduler``, ``content_metadata``
(``distrib_optim_sharding_type``...). Unpickled through zckpt's allowlist plus ``standins.ALLOWED``; tensors
stay ``TensorRef`` placeholders (the one read is ``common_step``, a scalar).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zckpt.codecs.pickle_safe import Namespace, TensorRef
from zckpt.codecs.torchzip import load_archive
from zckpt.errors import CorruptCheckpoint
from zckpt.formats.megatron.standins import ALLOWED
from zckpt.storage.location import Location


@dataclass(frozen=True)
class Common:
    """What ``common.pt`` holds, checked: ``args`` as a plain dict."""

    source: str
    args: Mapping[str, Any]
    iteration: int | None
    checkpoint_version: float | None
    sharding_type: str | None
    """The distributed optimizer's ``param_state_sharding_type`` (``dp_reshardable``,
    ``fully_reshardable``...); None without a distributed optimizer or without optimizer state."""
    param_groups: tuple[Mapping[str, Any], ...] = ()
    step: int | None = None
    scheduler: Mapping[str, Any] = field(default_factory=dict)
    content_metadata: Mapping[str, Any] = field(default_factory=dict)
    has_optimizer: bool = False


def _plain(v: Any, depth: int = 0) -> Any:
    """JSON-able copy of a small value (enums and signals by name, tensors by their shape)."""
    if depth > 8:
        return "..."
    if isinstance(v, dict):
        return {str(k): _plain(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x, depth + 1) for x in v]
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, TensorRef):
        return f"tensor{list(v.shape)}"
    return repr(v)


def load_common(folder: Location, *, trust_pickle: bool = False) -> Common:
    """``folder/common.pt`` read and checked (one ``CorruptCheckpoint``/``UnsafePickle`` line on damage)."""
    src = str(folder / "common.pt")
    _, obj = load_archive(src, trust_pickle=trust_pickle, extra=ALLOWED)
    if not isinstance(obj, dict):
        raise CorruptCheckpoint(f"{src}: not a dict but {type(obj).__name__}", path=src)
    ns = obj.get("args")
    if not isinstance(ns, Namespace) and not (trust_pickle and hasattr(ns, "__dict__")):
        raise CorruptCheckpoint(
            f"{src}: no Megatron args (an argparse.Namespace under 'args')",
            hint="the model config is read from args; restore common.pt from the original save",
            path=src,
        )
    args = dict(vars(ns))
    it = obj.get("iteration")
    ver = obj.get("checkpoint_version")
    opt = obj.get("optimizer")
    groups: tuple[Mapping[str, Any], ...] = ()
    step: int | None = None
    sharding: str | None = None
    if isinstance(opt, dict):
        pg = opt.get("param_groups")
        if pg is None and isinstance(opt.get("optimizer"), dict):
            pg = opt["optimizer"].get("param_groups")
        if isinstance(pg, list):
            groups = tuple(_plain(g) for g in pg if isinstance(g, dict))
        st = opt.get("state")
        if st is None and isinstance(opt.get("optimizer"), dict):  # Float16Optimizer nests torch's own
            st = opt["optimizer"].get("state")
        cs = st.get("common_step") if isinstance(st, dict) else None
        if isinstance(cs, TensorRef) and cs.numel == 1:
            step = int(cs.scalar())
        elif isinstance(cs, int) and not isinstance(cs, bool):
            step = cs
        s = opt.get("param_state_sharding_type")
        sharding = s if isinstance(s, str) else None
    cm = obj.get("content_metadata")
    cm = cm if isinstance(cm, dict) else {}
    if sharding is None and isinstance(cm.get("distrib_optim_sharding_type"), str):
        sharding = cm["distrib_optim_sharding_type"]
    sched = obj.get("opt_param_scheduler")
    return Common(
        source=src,
        args=args,
        iteration=it if isinstance(it, int) and not isinstance(it, bool) else None,
        checkpoint_version=float(ver)
        if isinstance(ver, (int, float)) and not isinstance(ver, bool)
        else None,
        sharding_type=sharding,
        param_groups=groups,
        step=step,
        scheduler=_plain(sched) if isinstance(sched, dict) else {},
        content_metadata=_plain(cm),
        has_optimizer=isinstance(opt, dict),
    )
