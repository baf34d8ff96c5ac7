"""What flat state-dict files (safetensors, torch ``.bin``/``.pt``) share: tensor roles and optimizer-state
names (``<param>:<state>``), and zckpt's metadata keys for roles and tied aliases."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from zckpt.dtypes import DType
from zckpt.errors import CorruptCheckpoint
from zckpt.model import STATE_SEP, Piece, Role, TensorEntry
from zckpt.storage.location import Location

TIED_KEY = "zckpt.tied"
"""safetensors ``__metadata__`` / index ``metadata`` key: JSON ``{alias: owner}``."""
ROLES_KEY = "zckpt.roles"
"""safetensors ``__metadata__`` key: JSON ``{name: "frozen" | "buffer" | "optim"}`` (params unlisted)."""


def json_map(raw: str | None, key: str, path: Location) -> dict[str, str]:
    """A JSON object of strings stored under ``key`` (absent: empty)."""
    if raw is None:
        return {}
    try:
        val = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        raise CorruptCheckpoint(f"{path}: metadata {key!r} is not JSON", path=str(path)) from None
    if not isinstance(val, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in val.items()
    ):
        raise CorruptCheckpoint(f"{path}: metadata {key!r} must map names to names", path=str(path))
    return dict(val)


def tied_map(val: object, key: str, path: Location | str) -> dict[str, str]:
    """``{alias: owner}`` as recorded under ``key``: names to names, no alias its own owner."""
    if not isinstance(val, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in val.items()
    ):
        raise CorruptCheckpoint(f"{path}: {key!r} must map names to names", path=str(path))
    for alias, owner in val.items():
        if alias == owner:
            raise CorruptCheckpoint(f"{path}: {key!r}: alias {alias!r:.80} is tied to itself", path=str(path))
    return dict(val)


def role_of(name: str, dtype: DType, roles: Mapping[str, str], path: Location) -> Role:
    """The role recorded for ``name``, else by dtype: floating tensors are params, the others buffers."""
    default = Role.PARAM if (dtype.is_floating_point or dtype.is_complex) else Role.BUFFER
    value = roles.get(name, default.value)
    try:
        return Role(value)
    except ValueError:
        raise CorruptCheckpoint(
            f"{path}: tensor {name!r:.80} has unknown role {value!r:.40}", path=str(path)
        ) from None


def entry_of(
    name: str,
    shape: tuple[int, ...],
    dtype: DType,
    role: Role,
    pieces: tuple[Piece, ...],
    path: Location,
) -> TensorEntry:
    """One tensor of a flat state dict; an optimizer state's ``<param>:<state>`` name is split."""
    base, state = name, None
    if role is Role.OPTIM:
        base, sep, state = name.rpartition(STATE_SEP)
        if not sep or not base or not state:
            raise CorruptCheckpoint(
                f"{path}: optimizer state {name!r:.80} is not named <param>:<state>", path=str(path)
            )
    return TensorEntry(base, shape, dtype, role, pieces, state=state)


def roles_json(items: Iterable[tuple[str, Role]]) -> str | None:
    """The ``ROLES_KEY`` value for ``(name, role)`` pairs (None when every tensor is a param)."""
    roles = {n: r.value for n, r in items if r is not Role.PARAM}
    return json.dumps(roles, sort_keys=True) if roles else None
