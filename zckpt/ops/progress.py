"""The one progress bar every long command uses: tqdm on stderr, shown only on a terminal."""

from __future__ import annotations

import sys

from tqdm import tqdm


def bar(total: int, desc: str, *, enabled: bool = True, unit: str = "B") -> tqdm:
    """A tqdm bar (bytes by default, scaled), disabled when ``enabled`` is false or stderr is no terminal."""
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit in ("B", "el"),  # counts of a few (ranks) stay integers: 3/3, not 3.00/3.00
        unit_divisor=1024 if unit == "B" else 1000,
        file=sys.stderr,
        disable=not enabled or not sys.stderr.isatty(),
        leave=False,
    )


def sized(nbytes: int) -> str:
    """``nbytes`` as the bars write sizes (``1.11GB``: binary multiples)."""
    return f"{tqdm.format_sizeof(nbytes, 'B', 1024)}"
