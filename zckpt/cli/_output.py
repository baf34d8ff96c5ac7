"""All command output goes through one ``Output``: human tables, or JSON with ``--json``.

Results go to stdout; errors, hints and warnings to stderr, one line each.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import typer

MAX_LINE = 300


def one_line(text: str, limit: int = MAX_LINE) -> str:
    """``text`` on one line (control characters shown escaped), at most ``limit`` characters."""
    flat = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(text.split()))
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def human_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


class Output:
    """Printer for one command run; ``json=True`` switches results to JSON."""

    def __init__(self, *, json: bool = False) -> None:
        self.json_mode = json

    def result(self, data: dict[str, Any]) -> None:
        """The command's machine-readable result (printed only in JSON mode)."""
        if self.json_mode:
            typer.echo(json.dumps(data, indent=2, default=str))

    def text(self, line: str = "") -> None:
        if not self.json_mode:
            typer.echo(line)

    def fields(self, pairs: Sequence[tuple[str, Any]]) -> None:
        """Aligned ``key  value`` lines; None values are skipped."""
        pairs = [(k, v) for k, v in pairs if v is not None]
        width = max((len(k) for k, _ in pairs), default=0)
        for k, v in pairs:
            self.text(f"{k:<{width}}  {v}")

    def table(
        self, headers: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[int] = ()
    ) -> None:
        """A plain aligned table; columns whose index is in ``right`` are right-aligned."""
        cells = [[str(c) for c in r] for r in rows]
        widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

        def line(r: Sequence[str]) -> str:
            parts = [
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ]
            return "  ".join(parts).rstrip()

        self.text(line(headers))
        for r in cells:
            self.text(line(r))

    @staticmethod
    def error(message: str, hint: str | None = None) -> None:
        """``error: ...`` on one line (and ``hint: ...``), each cut to ``MAX_LINE`` characters: a message that
        quotes damaged input must not echo a megabyte of it."""
        typer.echo(f"error: {one_line(message)}", err=True)
        if hint:
            typer.echo(f"hint: {one_line(hint)}", err=True)

    @staticmethod
    def warning(message: str) -> None:
        typer.echo(f"warning: {one_line(message)}", err=True)
