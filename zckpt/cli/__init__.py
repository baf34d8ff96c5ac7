"""The ``zckpt`` command line: a thin typer layer over the library (``app.py`` mounts one module per command).

``main`` is the console-script entry point: ``zckpt._guard_startup`` makes an interrupt while it imports
the app (typer and torch take a moment) one line and exit status 130, never a traceback; under ``python -m
zckpt.cli.app`` ``zckpt/__init__`` installs the same handler before the app's imports.
"""

from __future__ import annotations

from zckpt import _guard_startup


def main() -> None:
    _guard_startup()
    from zckpt.cli.app import main as run

    run()
