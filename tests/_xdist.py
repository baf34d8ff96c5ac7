"""How the suite runs on several pytest-xdist workers (``make test`` passes ``-n``); one process (no ``-n``)
runs as without this module.

- ``--dist loadfile``: a test file is one unit of work, run by one worker, so a module-scoped fixture is made
  once and the fuzz tests share their cache (``tests/fuzz/corpus.py`` builds and replaces it on first use).
  (``--dist loadgroup`` does not group with pytest 9: xdist 3.8 renames ``item._nodeid``, which pytest 9 no
  longer reads.)
- Tests marked ``slow`` come first in every worker's collection, and with ``--no-loadscope-reorder`` the
  files are handed out in that order: the files holding long tests start first, none starts last and runs
  alone at the end.
- Tests marked ``serial`` run with no other test in flight: they compare the time of one code path with
  another's, a ratio that a neighbour's load would skew. Every other test holds a shared lock while it runs, a
  serial one the exclusive lock; a gate taken first lets a waiting serial test in before the other workers'
  next tests. The controller makes the locks' folder and removes it at the end."""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

_LOCKS = pytest.StashKey[str]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:  # controller: one folder for the run, named to each worker
    if _LOCKS not in node.config.stash:
        node.config.stash[_LOCKS] = tempfile.mkdtemp(prefix="zckpt-pytest-locks-")
    node.workerinput["zckpt_locks"] = node.config.stash[_LOCKS]


def pytest_unconfigure(config: pytest.Config) -> None:
    if _LOCKS in config.stash:
        shutil.rmtree(config.stash[_LOCKS], ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # every worker sorts alike: the controller hands out this order
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    folder = getattr(item.config, "workerinput", {}).get("zckpt_locks")
    if folder is None:  # not an xdist worker
        yield
        return
    gate, lock = Path(folder, "gate"), Path(folder, "lock")
    if item.get_closest_marker("serial") is not None:
        with _flock(gate, fcntl.LOCK_EX), _flock(lock, fcntl.LOCK_EX):
            yield
        return
    with _flock(gate, fcntl.LOCK_SH):
        pass
    with _flock(lock, fcntl.LOCK_SH):
        yield
