"""The ``zckpt`` command line: a thin typer layer over the library (``app.py`` mounts one module per command).

``main`` is the console-script entry point: it imports the app under a Ctrl-C guard, so an interrupt during
start-up (importing typer and torch takes a moment) is one line and exit status 130, never a traceback.
``python -m zckpt.cli.app`` runs the app module's imports before any function of ours: ``zckpt/__init__``
installs a SIGINT handler for that case, which ``app.main`` replaces with Python's own.
"""

from __future__ import annotations

import os
import sys

EXIT_INTERRUPTED = 130


def main() -> None:
    try:
        from zckpt.cli.app import main as run
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted; nothing was written\n")
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)
    run()
