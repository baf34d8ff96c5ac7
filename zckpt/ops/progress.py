"""The one progress bar every long command uses: tqdm on stderr, shown only on a terminal.

A bar that is not shown is a ``NullBar``, not a disabled tqdm: tqdm takes a process-wide lock (shared with
forked children) to register every bar, even a disabled one, so a library call in a forked worker, or a
command killed in a forked child while holding it, could leave the lock taken for good. tqdm is imported
only for a bar that is shown (it is ~10 ms of a metadata command's start-up).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tqdm import tqdm


class NullBar:
    """What a hidden bar is asked to do, done by nothing."""

    n = 0

    def update(self, n: float = 1) -> None:
        self.n += int(n)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NullBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def bar(total: int, desc: str, *, enabled: bool = True, unit: str = "B") -> tqdm | NullBar:
    """A tqdm bar (bytes by default, scaled), or a ``NullBar`` when ``enabled`` is false or stderr is no
    terminal."""
    if not enabled or not sys.stderr.isatty():
        return NullBar()
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit in ("B", "el"),  # counts of a few (ranks) stay integers: 3/3, not 3.00/3.00
        unit_divisor=1024 if unit == "B" else 1000,
        file=sys.stderr,
        leave=False,
    )


def sized(nbytes: int) -> str:
    """``nbytes`` as the bars write sizes (``1.11GB``: binary multiples)."""
    from tqdm import tqdm

    return f"{tqdm.format_sizeof(nbytes, 'B', 1024)}"
