"""The environment switches of zckpt's I/O that count things, read by one parser (``docs/environment.md``
lists every switch). ``ZCKPT_WORKERS``: threads of each pool that scales with cores (readers, scans, the
diff's pairs, a block digest's lanes); ``ZCKPT_FILES``: output files written side by side. Unset or empty:
each pool's own default, from the cores this process may run on (``cores``: its CPU affinity, not the
machine's count). Anything but a positive whole number is one clear error naming the variable."""

from __future__ import annotations

import os

from zckpt.errors import InvalidArgument

WORKERS = "ZCKPT_WORKERS"
FILES = "ZCKPT_FILES"


def count(name: str) -> int | None:
    """The positive count environment variable ``name`` sets, or None when it is unset or empty.

    Raises:
        InvalidArgument: (a ``ValueError``) for any other value (``"four"``, ``"0"``, ``"-2"``, ``"1.5"``).
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    n = int(raw) if raw.isdecimal() else 0
    if n < 1:
        raise InvalidArgument(
            f"{name}={raw!r}: not a positive whole number", hint=f"unset it, or give a count: {name}=4"
        )
    return n


def cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or ``taskset``'s share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def workers(default: int) -> int:
    """``ZCKPT_WORKERS`` when set, else ``default`` (a pool's own choice from ``cores()``), at least 1."""
    n = count(WORKERS)
    return n if n is not None else max(1, default)


def check() -> None:
    """Raise for a bad value of any switch here, before a command starts work."""
    for name in (WORKERS, FILES):
        count(name)
