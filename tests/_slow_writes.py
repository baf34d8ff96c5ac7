"""Slow writes for the kill tests, injected from the test side (zckpt has no test hook of its own).

``install()`` wraps ``zckpt.storage.sink.HashingSink``: each file reads ``ZCKPT_TEST_WRITE_DELAY`` (seconds,
a test switch read only here) when it is opened, and each ``write`` / ``write_owned`` / ``commit`` of it
sleeps that long first, which spreads a save over enough time for a kill to land inside a write. Tests set
and unset the variable between saves, as before. Installed in this process by the modules that use it
(``_kill``, ``_ft_worker``, ``test_engine_async_save``); a fork inherits it; a new interpreter gets it from
``tests/_site/sitecustomize.py`` when ``PYTHONPATH`` names that folder (``SITE``)."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

ENV = "ZCKPT_TEST_WRITE_DELAY"
SITE = str(Path(__file__).resolve().parent / "_site")
"""Put on a child's ``PYTHONPATH`` (with the repository root) to install the slow writes there too."""


def install() -> None:
    """Wrap ``HashingSink`` (once per process)."""
    from zckpt.storage.sink import HashingSink

    if getattr(HashingSink, "_test_slowed", False):
        return
    init = HashingSink.__init__

    @functools.wraps(init)
    def opened(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        self._test_delay = float(os.environ.get(ENV) or 0)  # read once per file, not per write

    HashingSink.__init__ = opened  # type: ignore[method-assign]
    for name in ("write", "write_owned", "commit"):
        setattr(HashingSink, name, _slowed(getattr(HashingSink, name)))
    HashingSink._test_slowed = True  # type: ignore[attr-defined]


def _slowed(fn: Any) -> Any:
    @functools.wraps(fn)
    def slow(self: Any, *a: Any, **k: Any) -> Any:
        delay = getattr(self, "_test_delay", 0.0)
        if delay:
            time.sleep(delay)
        return fn(self, *a, **k)

    return slow


def child_pythonpath(root: str | os.PathLike[str]) -> str:
    """A ``PYTHONPATH`` for a child interpreter: the repository ``root``, this folder and ``SITE``."""
    return os.pathsep.join([str(root), str(Path(__file__).resolve().parent), SITE])
