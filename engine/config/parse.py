"""Generic machinery behind ``engine.config``: ``ConfigError``, lenient value coercion (as lenient as
DeepSpeed's pydantic models: integral floats such as ``1e9`` for ints, ``"true"`` for bools), building a
frozen dataclass from one JSON block with unknown-key suggestions, handling of DeepSpeed keys the engine
does not implement, HF ``"auto"`` rejection, and deprecation warnings.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import math
import types
import typing
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

log = logging.getLogger("engine.config")

T = TypeVar("T")


class ConfigError(ValueError):
    """An invalid or unsupported DeepSpeed config. ``key`` is the dotted path of the offending key."""

    def __init__(self, message: str, *, key: str | None = None, hint: str | None = None) -> None:
        super().__init__(message if hint is None else f"{message} (hint: {hint})")
        self.key = key
        self.hint = hint


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def deprecated(message: str) -> None:
    """Announce a deprecated spelling: a ``DeprecationWarning`` (for tests/tools) and a logged warning."""
    warnings.warn(message, DeprecationWarning, stacklevel=4)
    log.warning(message)


def reject_auto(obj: Any, path: str) -> None:
    """Raise on the first HF Trainer ``"auto"`` placeholder anywhere in ``obj``."""
    if isinstance(obj, str) and obj.strip().lower() == "auto":
        raise ConfigError(
            f"{path or '<root>'}: 'auto' is an HF Trainer placeholder; give a number",
            key=path,
            hint="HF Trainer fills 'auto' in before calling DeepSpeed; the engine needs the concrete value",
        )
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            reject_auto(v, join(path, str(k)))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            reject_auto(v, f"{path}[{i}]")


def unknown_key(path: str, key: str, candidates: Iterable[str]) -> ConfigError:
    """The error for an unknown key, naming the nearest valid key when one is close."""
    cands = sorted(set(candidates))
    near = difflib.get_close_matches(key, cands, n=1, cutoff=0.6)
    where = join(path, key)
    if near:
        return ConfigError(f"{where}: unknown key; did you mean {near[0]}?", key=where)
    listed = ", ".join(cands)
    return ConfigError(f"{where}: unknown key; valid keys here: {listed}", key=where)


def ignore_unknown_top(raw: dict[str, Any], candidates: Iterable[str]) -> None:
    """Drop the top-level keys not in ``candidates`` with a warning naming the nearest valid key.

    DeepSpeed 0.19.8 reads its top level as a plain dict and ignores keys it does not know (public configs
    carry some: LLaMA-Factory's ``comms_config``/``monitor_config``); only its nested blocks (pydantic models)
    refuse unknown keys, and so does the engine there.
    """
    cands = sorted(set(candidates))
    for key in [k for k in raw if k not in cands]:
        raw.pop(key)
        near = difflib.get_close_matches(key, cands, n=1, cutoff=0.6)
        tail = f"; did you mean {near[0]}?" if near else ""
        message = f"{key}: unknown top-level key, ignored (as DeepSpeed does){tail}"
        warnings.warn(message, UserWarning, stacklevel=3)
        log.warning(message)


def unknown_value(path: str, value: str, candidates: Iterable[str]) -> ConfigError:
    """The error for an unknown enumerated value (optimizer/scheduler type), naming the nearest one."""
    cands = sorted(set(candidates))
    near = difflib.get_close_matches(value, cands, n=1, cutoff=0.5)
    tail = f"did you mean {near[0]}?" if near else f"expected one of {', '.join(cands)}"
    return ConfigError(f"{path}: unknown value {value!r}; {tail}", key=path)


# ----------------------------------------------------------------------------------------------- coercion

_TRUE = {"true", "yes", "on", "y", "t", "1"}
_FALSE = {"false", "no", "off", "n", "f", "0"}


def to_bool(v: Any, path: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    raise ConfigError(f"{path}: expected true or false, got {v!r}", key=path)


def to_float(v: Any, path: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise ConfigError(f"{path}: expected a number, got {v!r}", key=path)
    try:
        out = float(v)
    except ValueError:
        raise ConfigError(f"{path}: expected a number, got {v!r}", key=path) from None
    if not math.isfinite(out):
        raise ConfigError(f"{path}: must be a finite number, got {v!r}", key=path)
    return out


def to_int(v: Any, path: str) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            pass
    f = to_float(v, path)
    if not f.is_integer():
        raise ConfigError(f"{path}: expected an integer, got {v!r}", key=path)
    return int(f)


def coerce(v: Any, tp: Any, path: str) -> Any:
    """Coerce JSON value ``v`` to annotation ``tp``: bool/int/float/str, Literal, X | None, tuples."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = tuple(a for a in typing.get_args(tp) if a is not type(None))
        if v is None:
            return None
        if len(args) != 1:
            raise TypeError(f"unsupported annotation {tp}")
        return coerce(v, args[0], path)
    if origin is Literal:
        choices = typing.get_args(tp)
        if v not in choices:
            raise ConfigError(f"{path}: expected one of {', '.join(map(repr, choices))}, got {v!r}", key=path)
        return v
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(v, list | tuple) or len(v) != len(args):
            raise ConfigError(f"{path}: expected a list of {len(args)} numbers, got {v!r}", key=path)
        return tuple(coerce(x, a, f"{path}[{i}]") for i, (x, a) in enumerate(zip(v, args, strict=True)))
    if tp is bool:
        return to_bool(v, path)
    if tp is int:
        return to_int(v, path)
    if tp is float:
        return to_float(v, path)
    if tp is str:
        if not isinstance(v, str):
            raise ConfigError(f"{path}: expected a string, got {v!r}", key=path)
        return v
    raise TypeError(f"unsupported annotation {tp}")


def check_bounds(v: Any, meta: Mapping[str, Any], path: str) -> None:
    if v is None:
        return
    for op, bound, ok in (("ge", ">=", v.__ge__), ("gt", ">", v.__gt__), ("le", "<=", v.__le__)):
        if op in meta and not ok(meta[op]):
            raise ConfigError(f"{path}: must be {bound} {meta[op]}, got {v}", key=path)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_keys(cls: type) -> dict[str, str]:
    """JSON key (field name or alias) → field name, for a config dataclass."""
    keys: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        keys[f.name] = f.name
        for alias in f.metadata.get("aliases", ()):
            keys[alias] = f.name
    return keys


def build(
    cls: type[T],
    raw: Mapping[str, Any],
    path: str,
    *,
    prebuilt: Mapping[str, Any] | None = None,
    exclude: Iterable[str] = (),
    also_valid: Iterable[str] = (),
) -> T:
    """Instantiate dataclass ``cls`` from JSON block ``raw`` found at ``path``.

    ``prebuilt`` supplies already-parsed field values (nested blocks); ``exclude`` lists fields that may not
    come from JSON; ``also_valid`` extends the suggestion list for unknown keys (keys handled elsewhere).
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a JSON object, got {raw!r}", key=path)
    keys = {k: n for k, n in field_keys(cls).items() if n not in set(exclude)}
    hints = _hints(cls)  # type: ignore[arg-type]
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = dict(prebuilt or {})
    seen: dict[str, str] = {}
    for key, value in raw.items():
        where = join(path, key)
        name = keys.get(key)
        if name is None or name in (prebuilt or {}):
            raise unknown_key(path, key, [*keys, *also_valid])
        if name in seen:
            raise ConfigError(f"{where}: same setting as {join(path, seen[name])}; give only one", key=where)
        seen[name] = key
        kwargs[name] = coerce(value, hints[name], where)
        check_bounds(kwargs[name], meta[name], where)
    return cls(**kwargs)


# ------------------------------------------------------------------------------ DeepSpeed keys we lack


@dataclass(frozen=True)
class Foreign:
    """A DeepSpeed key the engine does not implement.

    ``default``: accepted (and ignored) when the value is inert: equal to this, None, or a block that is
    disabled / all-falsy. ``ignore``: any value accepted — it only tunes performance or logging.
    ``message``: why it is refused otherwise.
    """

    message: str
    default: Any = None
    ignore: bool = False


def _inert(value: Any, default: Any) -> bool:
    if value is None or value == default:
        return True
    if default is not None:
        return False
    if isinstance(value, Mapping):
        if "enabled" in value:
            return not value["enabled"]
        return all(_inert(v, None) for v in value.values())
    if isinstance(value, list | tuple):
        return len(value) == 0
    return value is False or value == 0 or value == ""


def take_foreign(raw: dict[str, Any], path: str, table: Mapping[str, Foreign]) -> None:
    """Pop every key of ``table`` from ``raw``; refuse active ones with a ``ConfigError``."""
    for key in [k for k in raw if k in table]:
        spec, value = table[key], raw.pop(key)
        if spec.ignore or _inert(value, spec.default):
            if not spec.ignore and value is not None and value != spec.default:
                log.debug("%s: %s is inactive; ignored", join(path, key), value)
            continue
        where = join(path, key)
        raise ConfigError(f"{where}: not supported by the engine ({spec.message})", key=where)
