"""How ``zckpt ... --help`` reads: plain text that fits a default 80-column terminal.

The app renders help with click's plain formatter (``rich_markup_mode=None`` in ``app.py``), the layout
of pip, git and the ``hf`` CLI: two columns, option names never cut, text wrapped between words at
min(terminal, 80) - 2 columns, no box drawing, no markup (so ``'zckpt[plot]'`` prints as written).
``Formatter`` wraps only at spaces: click's wrapper also breaks at hyphens (``[default: verify-`` /
``data]``) and inside long words, which cuts option names and values in two.

``Command`` fixes what typer's plain layout still gets wrong: positional arguments read ``CKPT`` and
``[SRC [DST]]`` in the usage line (POSIX/docopt spelling; typer writes ``{ckpt}`` and ``[src] [dst]``),
required options are named there too (``--world N``), and the arguments' rows carry no ``<path>`` type.
Options name their value with an explicit ``metavar`` (``--tag TAG``, ``--dtype [auto|fp32|bf16|fp16]``,
click's spelling of a choice); flags show none. ``Command`` also hands its parameters to ``_coerce``
(their values converted without importing pydantic).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

from typer.core import TyperCommand, TyperGroup

from zckpt.cli import _coerce

_ClickContext: Any = TyperCommand.context_class  # typer's click (vendored since typer 0.2x), not ours to pin
_ClickFormatter: Any = _ClickContext.formatter_class


def wrap(text: str, width: int, indent: str = "") -> str:
    """``text`` rewrapped to ``width`` columns at spaces only, each line starting with ``indent``.

    Paragraphs are separated by blank lines; one whose first line is ``\\b`` alone is kept as written
    (click's marker for examples), each line indented."""
    out = []
    for para in textwrap.dedent(text).strip("\n").split("\n\n"):
        lines = para.splitlines()
        if lines and lines[0].strip() == "\b":
            out.append("\n".join(indent + line for line in lines[1:]))
        else:
            out.append(
                textwrap.fill(
                    " ".join(line.strip() for line in lines),
                    width,
                    initial_indent=indent,
                    subsequent_indent=indent,
                    break_on_hyphens=False,
                    break_long_words=False,
                )
            )
    return "\n\n".join(out)


class Formatter(_ClickFormatter):
    """click's help formatter, with every paragraph wrapped by ``wrap`` (at spaces only)."""

    def write_text(self, text: str) -> None:
        self.write(wrap(text, self.width, " " * self.current_indent) + "\n")

    def write_dl(self, rows: Sequence[tuple[str, str]], col_max: int = 30, col_spacing: int = 2) -> None:
        rows = list(rows)
        first_col = min(max((len(r[0]) for r in rows), default=0), col_max) + col_spacing
        pad = " " * (self.current_indent + first_col)
        for first, second in rows:
            self.write(" " * self.current_indent + first)
            if not second:
                self.write("\n")
                continue
            if len(first) <= first_col - col_spacing:
                self.write(" " * (first_col - len(first)))
            else:  # a long option name keeps its own line; its help starts on the next
                self.write("\n" + pad)
            text = wrap(second, max(self.width - first_col - self.current_indent, 10))
            self.write(text.replace("\n", "\n" + pad) + "\n")


class Context(_ClickContext):
    """click's context, formatting help with ``Formatter``."""

    formatter_class = Formatter


def arg_name(param: Any) -> str:
    """A positional argument as the usage line and help name it: its metavar, else its name in capitals."""
    name = param.metavar or (param.name or "").upper()
    return f"{name}..." if param.nargs != 1 else name


class Group(TyperGroup):
    """The ``zckpt`` app: its help (the command list) is wrapped by ``Formatter``."""

    context_class = Context

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _coerce.install(self.params)

    def get_help_option(self, ctx: Any) -> Any:
        return _coerce.install_one(super().get_help_option(ctx))


class Command(TyperCommand):
    """A ``zckpt`` command whose help uses the names above (see the module docstring)."""

    context_class = Context

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _coerce.install(self.params)  # its values converted without pydantic where typer's would be the same

    def get_help_option(self, ctx: Any) -> Any:
        return _coerce.install_one(super().get_help_option(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        params = self.get_params(ctx)
        for p in params:  # required options are part of the call: `zckpt reshard [OPTIONS] --world N`
            if p.param_type_name == "option" and p.required:
                pieces.append(f"{p.opts[0]} {p.metavar}" if p.metavar else p.opts[0])
        args = [p for p in params if p.param_type_name == "argument"]
        first_optional = next((i for i, p in enumerate(args) if not p.required), len(args))
        tail = ""
        for p in reversed(args[first_optional:]):  # a later positional only follows an earlier one
            tail = f"[{arg_name(p)}{' ' + tail if tail else ''}]"  # [SRC [DST]]
        return [*pieces, *(arg_name(p) for p in args[:first_optional]), *([tail] if tail else [])]

    def format_options(self, ctx: Any, formatter: Any) -> None:
        args: list[tuple[str, str]] = []
        opts: list[tuple[str, str]] = []
        for p in self.get_params(ctx):
            record = p.get_help_record(ctx)
            if record is None:
                continue
            if p.param_type_name == "argument":
                args.append((arg_name(p), record[1]))
            else:
                opts.append(record)
        if args:
            with formatter.section("Arguments"):
                formatter.write_dl(args)
        if opts:
            with formatter.section("Options"):
                formatter.write_dl(opts)
