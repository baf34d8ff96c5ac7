"""The model record: what rank 0's file says about the model, to cross-check ``manifest.json`` with.

``manifest.json`` carries the digests of the rank files, but nothing covers the manifest itself: an edit to
its ``tied`` map (a dropped tie, an alias moved to an owner of another shape), to a tensor's shape (same
number of elements, so every chunk keeps its size) or to ``precision`` would change the model that
``consolidate`` writes. The writer therefore also records, in rank 0's safetensors ``__metadata__`` under
``zckpt.model``, the precision, every model tensor (name, shape, dtype, role, partitioned) and every tie
with its alias's shape and dtype. The reader refuses a manifest that disagrees with that record, naming the
entry; a rank file whose record was removed or altered no longer matches the manifest's sha256 of it
(``zckpt verify``). Rank files written before the record existed carry none: their manifests are checked
only for internal consistency (``check_manifest``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from zckpt.errors import CorruptCheckpoint
from zckpt.formats.native import layout as L

KEY = "zckpt.model"
"""The ``__metadata__`` key of rank 0's file that holds the record (a JSON string)."""

_HINT = "the manifest was edited after the save; restore it from a good copy"


def _tensor_row(t: L.TensorSpec) -> list[Any]:
    return [t.name, list(t.shape), t.dtype, t.role.value, t.partitioned]


def _show(row: list[Any]) -> str:
    return f"{row[1]} {row[2]} {row[3]}{' partitioned' if row[4] else ''}"


def encode(tensors: Sequence[L.TensorSpec], tied: Mapping[str, str], precision: str) -> dict[str, str]:
    """Rank 0's ``__metadata__`` entry for a save of ``tensors`` (owners), ``tied`` and ``precision``."""
    by_name = {t.name: t for t in tensors}
    ties = {
        a: [o, list(by_name[o].shape), by_name[o].dtype] if o in by_name else [o, None, None]
        for a, o in sorted(tied.items())
    }
    doc = {"precision": precision, "tensors": [_tensor_row(t) for t in tensors], "tied": ties}
    return {KEY: json.dumps(doc, separators=(",", ":"))}


def _fail(where: str, msg: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"{where}: {msg}", hint=_HINT, path=where)


def _decode(raw: str, rank0: str) -> tuple[str, dict[str, list[Any]], dict[str, list[Any]]]:
    try:
        doc = json.loads(raw)
        precision, rows, ties = doc["precision"], doc["tensors"], doc["tied"]
        if not isinstance(precision, str) or not isinstance(rows, list) or not isinstance(ties, dict):
            raise TypeError
        tensors = {r[0]: r for r in rows if isinstance(r, list) and len(r) == 5 and isinstance(r[0], str)}
        if len(tensors) != len(rows) or not all(isinstance(v, list) and len(v) == 3 for v in ties.values()):
            raise TypeError
    except (ValueError, TypeError, KeyError, RecursionError):
        raise CorruptCheckpoint(
            f"{rank0}: __metadata__ {KEY!r} is not a model record",
            hint="the rank file was damaged; `zckpt verify` compares it with the manifest's sha256",
            path=rank0,
        ) from None
    return precision, tensors, ties


def check_manifest(man: L.Manifest, manifest: str) -> None:
    """What the manifest alone must satisfy: every optimizer state and every param a param group lists
    has data (a tensor the manifest lists) or, for a group's param, a tie to one."""
    roles = {t.name: t.role for t in man.tensors}
    for o in man.optim_states:
        if o.param not in roles:
            raise _fail(manifest, f"optimizer state {o.state!r:.40} of {o.param!r:.80}, which has no data "
                                  "(tensors does not list it)")  # fmt: skip
    groups = (man.optimizer or {}).get("param_groups") or []
    for i, g in enumerate(groups):
        for p in g.get("params") or []:
            owner = man.tied.get(p, p)
            if owner not in roles:
                raise _fail(manifest, f"optimizer param group {i} lists {p!r:.80}, which has neither data "
                                      "(a param in tensors) nor a tie to one")  # fmt: skip


def check(man: L.Manifest, metadata: Mapping[str, str], manifest: str, rank0: str) -> None:
    """Refuse ``man`` where it disagrees with the model record in rank 0's ``metadata`` (if any)."""
    check_manifest(man, manifest)
    raw = metadata.get(KEY)
    if raw is None:
        return
    precision, rec, ties = _decode(raw, rank0)
    also = f"but {rank0.rsplit('/', 1)[-1]} records"
    if man.precision != precision:
        raise _fail(manifest, f"precision {man.precision!r:.20}, {also} {precision!r:.20}")
    mine = {t.name: t for t in man.tensors}
    for t in man.tensors:
        got = rec.get(t.name)
        if got is None:
            raise _fail(manifest, f"tensor {t.name!r:.80} is not in the model {also[4:]}")
        if got != _tensor_row(t):
            raise _fail(manifest, f"tensor {t.name!r:.80} is {_show(_tensor_row(t))}, {also} {_show(got)}")
    for name in rec:
        if name not in mine:
            raise _fail(manifest, f"tensors lacks {name!r:.80}, which is in the model {also[4:]}")
    for alias, (owner, shape, dtype) in ties.items():
        now = man.tied.get(alias)
        if now is None:
            raise _fail(manifest, f"tied lacks {alias!r:.80} (-> {owner!r:.80}), which {also[4:]}")
        if now != owner:
            to = mine.get(now)
            same = to is not None and [list(to.shape), to.dtype] == [shape, dtype]
            across = "owners" if same else "shapes or dtypes"
            now_is = f"{list(to.shape)} {to.dtype}" if to is not None else "no tensor"
            raise _fail(manifest, f"tied {alias!r:.80} -> {now!r:.80} ({now_is}), {also} -> {owner!r:.80} "
                                  f"({shape} {dtype}): a tie across {across}")  # fmt: skip
    for alias, owner in man.tied.items():
        if alias not in ties:
            raise _fail(manifest, f"tied {alias!r:.80} -> {owner!r:.80} is not a tie {also[4:]}")
