"""Command-line values converted as typer converts them, without importing pydantic (start-up, issue 42).

typer (0.2x) converts each parameter's value through a pydantic ``TypeAdapter`` that it builds on first use
(``typer._coercion.build_runtime_param``): importing pydantic and building the adapters is ~0.1 s, a third
of ``zckpt inspect``'s start-up on 2 cores. ``install`` gives the parameters whose annotation is ``str``,
``Path``, ``list[str]``, ``bool``, ``int``, ``float`` or an ``Enum`` a ``Plain`` converter instead: for the
values argv holds (strings, lists of strings, a flag's bool, None) and the options' own defaults it does what
typer's adapters do (``str`` as is, ``Path(value)`` then typer's own path checks, a list of strings, a bool
as is, a number of the declared type inside its ``min``/``max`` as is, a choice through typer's own
``coerce_cli_choice``); any other value (a number typed on the command line, a word that is not a choice:
their errors are pydantic's wording), or any other annotation, goes to typer's adapter, built only then.
``tests/test_cli_coerce.py`` compares the two on every parameter of every command. With a typer that
converts through click types instead (before 0.2x, no pydantic), or where its internals moved, ``install``
leaves the parameters as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Any

try:
    from typer._click.exceptions import BadParameter
    from typer._coercion import build_runtime_param
    from typer._param_types import coerce_cli_choice, coerce_cli_path, lenient_issubclass, routes_to_path
except ImportError:  # another typer: its own conversion stays
    build_runtime_param = None  # type: ignore[assignment]


def install(params: Iterable[Any]) -> None:
    """Give each of a command's ``params`` whose annotation ``Plain`` converts a ``Plain`` converter (typer
    builds a parameter's converter only when ``_runtime_param`` is None, on its first value)."""
    if build_runtime_param is None:
        return
    for p in params:
        desc = getattr(p, "type_descriptor", None)
        if desc is None or getattr(p, "_runtime_param", False) is not None:
            continue
        kind = _kind(desc)
        if kind is not None:
            p._runtime_param = Plain(desc, kind)


def install_one(param: Any) -> Any:
    """``install`` for one parameter (click makes ``--help`` apart from the others); returns it."""
    if param is not None:
        install([param])
    return param


def _kind(desc: Any) -> str | None:
    info, ann = desc.parameter_info, desc.annotation
    if desc.file_annotation is not None or info.parser is not None or getattr(info, "click_type", None):
        return None
    if ann == list[str]:
        return "list"
    if ann is str:
        return "str"
    if ann is bool:
        return "bool"
    if ann is int or ann is float:
        return "number"
    if lenient_issubclass(ann, Path) and routes_to_path(ann, info):
        return "path"
    if lenient_issubclass(ann, Enum):
        return "choice"
    return None


class Plain:
    """One parameter's converter (what ``typer._coercion.RuntimeParam`` offers typer: ``coerce``)."""

    def __init__(self, desc: Any, kind: str) -> None:
        self.desc = desc
        self.kind = kind
        self._typer: Any = None

    def coerce(self, value: Any, param: Any, ctx: Any) -> Any:
        """``value`` as typer's adapter would return it (or raise, as ``BadParameter``)."""
        if value is None:  # typer's RuntimeParam.coerce: an unset option
            return () if param.multiple or param.nargs == -1 else None
        if self.kind == "list":
            if isinstance(value, (list, tuple)) and all(type(v) is str for v in value):
                return list(value)
        elif self.kind == "bool":
            if type(value) is bool:
                return value
        elif self.kind == "number":
            if type(value) is self.desc.annotation and self._within(value):  # a default, as declared
                return value
        elif self.kind == "choice":  # typer's choice adapter: its parse_choice, pydantic around it
            with contextlib.suppress(ValueError):  # not a choice: typer's adapter words the error
                return coerce_cli_choice(
                    value,
                    choices=tuple(self.desc.annotation),
                    case_sensitive=self.desc.parameter_info.case_sensitive,
                    ctx=ctx,
                )
        elif type(value) is str:
            return value if self.kind == "str" else self._path(value, param, ctx)
        if self._typer is None:  # anything argv cannot hold (typer's test runner may pass it): typer's own
            self._typer = build_runtime_param(self.desc)
        return self._typer.coerce(value, param=param, ctx=ctx)

    def _within(self, value: float) -> bool:
        """``value`` is a number typer's adapter returns unchanged: not NaN, inside ``min``/``max``."""
        lo, hi = self.desc.parameter_info.min, self.desc.parameter_info.max
        return value == value and (lo is None or value >= lo) and (hi is None or value <= hi)

    def _path(self, value: str, param: Any, ctx: Any) -> Any:
        info = self.desc.parameter_info  # as typer's _build_path_adapter
        path_type = info.path_type
        if path_type is None and lenient_issubclass(self.desc.annotation, Path):
            path_type = self.desc.annotation
        arg = path_type(value) if lenient_issubclass(path_type, Path) else value  # pydantic's Path(value)
        try:  # then typer's checks (exists, file_okay, readable, resolve_path...)
            return coerce_cli_path(arg, info, path_type=path_type, param=param, ctx=ctx)
        except ValueError as e:  # `os.stat` of a path holding NUL: pydantic's wording of a ValueError
            raise BadParameter(f"Value error, {e}", ctx=ctx, param=param) from e
