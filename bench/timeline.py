#!/usr/bin/env python3
"""Where one ``zckpt`` command's wall time goes, as a timeline of marks (seconds from this script's start):
torch's import (start, end), a DCP folder's ``.metadata`` load (with the pre-open's result taken, where
the tree has ``zckpt.storage.preopen``), its open after that (``load_folder``: locating the chunk
archives), the output file's write, the end. Works on older trees too (``PYTHONPATH=TREE``), for
before/after timelines.

    python bench/timeline.py consolidate CK OUT.safetensors --dtype fp32 --overwrite --no-progress

Runs the command line in this process (``zckpt.cli.app.main``, ``ZCKPT_FAST_EXIT=0`` so that it returns), with
the marks printed as one ``TIMELINE name=s ...`` line on stderr. The command itself runs as it does from the
``zckpt`` program: this script imports nothing of torch before it, so the pre-open forks its child as usual.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from typing import Any

T0 = time.perf_counter()
MARKS: list[tuple[str, float]] = []


def mark(name: str) -> None:
    MARKS.append((name, time.perf_counter() - T0))


class _Imports(importlib.abc.MetaPathFinder):
    """Marks the first import of torch (finds nothing itself)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == "torch" and not any(n == "torch-import" for n, _ in MARKS):
            mark("torch-import")


def timed(module: str, name: str, label: str) -> None:
    """Mark the start and end of every call of ``module.name`` (patched where it is looked up)."""
    mod = importlib.import_module(module)
    fn: Callable[..., Any] = getattr(mod, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mark(f"{label}-start")
        try:
            return fn(*args, **kwargs)
        finally:
            mark(f"{label}-end")

    setattr(mod, name, wrapper)


def main() -> None:
    sys.meta_path.insert(0, _Imports())
    if importlib.util.find_spec("zckpt.storage.preopen") is not None:
        timed("zckpt.storage.preopen", "take", "preopen-take")
    from zckpt.cli import app

    leave = app._leave_startup

    def after_torch(*args: object) -> None:  # older trees call it with no argument, newer with ``torch``
        leave(*args)
        mark("start-up left" if args and not args[0] else "torch-imported")
        timed("zckpt.formats.dcp.read", "load_metadata", "dcp-metadata")
        timed("zckpt.formats.dcp.read", "load_folder", "dcp-locate")
        timed("zckpt.codecs.safetensors", "write_file", "write")

    app._leave_startup = after_torch
    os.environ["ZCKPT_FAST_EXIT"] = "0"
    sys.argv = ["zckpt", *sys.argv[1:]]
    try:
        app.main()
    finally:
        mark("end")
        print("TIMELINE " + " ".join(f"{n}={t:.2f}" for n, t in MARKS), file=sys.stderr)


if __name__ == "__main__":
    main()
