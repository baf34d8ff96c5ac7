"""Composition root of the ``zckpt`` command line.

Each command lives in its own module exposing ``NAME`` and ``command`` (a plain function whose
parameters are typer ``Annotated`` aliases from ``_options``); adding a command is one line in
``COMMANDS``. Every command runs under ``_guarded``: a ``ZckptError`` (or an OS error) prints
``error: <message>`` and ``hint: <hint>`` on stderr and exits 2, without a traceback unless
``ZCKPT_DEBUG=1``; Ctrl-C exits 130 (writers have already removed their temporary files). Exit
status 1 is left to commands for a negative answer (``diff``: "different"), 0 is success.
"""

from __future__ import annotations

import functools
import importlib
import os
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import typer

from zckpt.cli._output import Output

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130

COMMANDS = (
    "zckpt.cli.inspect",
    "zckpt.cli.consolidate",
    "zckpt.cli.diff",
    "zckpt.cli.verify",
    "zckpt.cli.reshard",
)

app = typer.Typer(
    name="zckpt",
    help="Inspect, consolidate, reshard, diff and verify sharded (ZeRO, FSDP-style) training checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _one_line_warning(message: Warning | str, *_: Any, **__: Any) -> None:
    Output.warning(str(message))


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        from zckpt.errors import ZckptError

        debug = os.environ.get("ZCKPT_DEBUG") == "1"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always" if debug else "default")
                if not debug:  # library warnings as one `warning: ...` line, not file:line + source
                    warnings.showwarning = _one_line_warning
                return fn(*args, **kwargs)
        except ZckptError as e:
            if debug:
                traceback.print_exc()
            Output.error(str(e), e.hint)
            raise typer.Exit(EXIT_ERROR) from None
        except OSError as e:
            if debug:
                traceback.print_exc()
            where = f": {e.filename}" if e.filename else ""
            Output.error(f"{e.strerror or e}{where}")
            raise typer.Exit(EXIT_ERROR) from None
        except KeyboardInterrupt:
            Output.error("interrupted; no partial output was left behind")
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return run


for _module in COMMANDS:
    _mod = importlib.import_module(_module)
    app.command(name=_mod.NAME)(_guarded(_mod.command))


def main() -> None:
    """Console-script entry point (``zckpt``)."""
    app()


if __name__ == "__main__":
    main()
