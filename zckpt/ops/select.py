"""Options that select tensors by name (``diff --keys`` / ``--map``, ``consolidate --keep-fp32``) must
select something: a pattern that matches no name is an error naming the pattern, never an empty
comparison that passes (a typo in a CI gate would read as "EQUAL").

The convention is the shell's and pytest's: ``ls nomatch*`` and ``pytest -k nomatch`` fail (exit 2 /
5) instead of succeeding on nothing.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

from zckpt.errors import KeyMappingError
from zckpt.model import STATE_SEP


def glob_matches(name: str, pattern: str) -> bool:
    """``pattern`` (fnmatch, case-sensitive) matches ``name`` or, for an optimizer state
    ``"<param>:<state>"``, its parameter name."""
    return fnmatch.fnmatchcase(name, pattern) or (
        STATE_SEP in name and fnmatch.fnmatchcase(name.split(STATE_SEP, 1)[0], pattern)
    )


def require_globs(option: str, patterns: Sequence[str], names: Iterable[str], where: str) -> None:
    """Raise ``KeyMappingError`` naming the first of ``patterns`` that matches none of ``names``."""
    if not patterns:
        return
    left = list(dict.fromkeys(patterns))
    for n in names:
        left = [p for p in left if not glob_matches(n, p)]
        if not left:
            return
    pat = left[0]
    raise KeyMappingError(
        f"{option} {pat!r} matches no tensor name of {where}",
        hint="check the pattern (fnmatch, case-sensitive: '*' and '?'); `zckpt inspect` lists the names"
        + (f"; {len(left)} patterns match nothing" if len(left) > 1 else ""),
    )
