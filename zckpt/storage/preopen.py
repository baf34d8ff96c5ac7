"""Work on an input file that needs no torch, done in a child process while the command line imports torch.

``import torch`` takes 1-2 s (a CUDA build: ~2 s) and holds the GIL for most of it, so a thread cannot do
anything beside it. Parsing a large DCP ``.metadata`` takes about as long again, before any byte is written.
``start`` forks (only while the process has one thread and no torch: the command line before its import)
a child that imports nothing but the target's own module, runs ``target(path)`` and leaves the bytes it
returns in an anonymous memory file; the parent goes on importing torch. ``take`` waits for the child and
returns those bytes, or None when no child was started for the path or the child failed in any way: the
caller then does the work itself, and reports any refusal through its own path. The caller checks that the
bytes describe the input it read itself (``zckpt.formats.dcp.metadata`` compares digests).

The child must stay away from torch: the packages above the target module (whose ``__init__`` imports torch)
are registered bare, their search path only, so importing the module runs no package ``__init__``. Linux
only (``os.memfd_create``); elsewhere, with one core, or once torch is imported, ``start`` does nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import signal
import sys
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class _Child:
    pid: int
    fd: int
    """The memory file the child writes its result into."""


def available() -> bool:
    """Forking is safe and worth it here: one thread, torch not imported, two cores or more, Linux."""
    return (
        hasattr(os, "memfd_create")
        and hasattr(os, "fork")
        and "torch" not in sys.modules
        and threading.active_count() == 1
        and len(os.sched_getaffinity(0)) >= 2
    )


Children = dict[str, _Child]
"""The children one command started, by path: kept in its ``zckpt.storage.session.Storage`` (``cache``)."""


def start(started: Children, target: str, path: str) -> bool:
    """Run ``target`` (``"package.module:function"``, a function of a path returning bytes) on ``path`` in a
    child process, noted in ``started``; True if one was started. ``path`` is the key ``take`` is called with
    (a real path)."""
    if path in started or not available():
        return False
    fd = os.memfd_create("zckpt-preopen", os.MFD_CLOEXEC)
    stops = {signal.SIGINT, signal.SIGTERM}
    held = signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # until the child has its own handlers
    try:
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _child(target, path, fd, held)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    started[path] = _Child(pid, fd)
    return True


def take(started: Children, path: str) -> bytes | None:
    """What the child started for ``path`` returned (waiting for it), or None (none started, or it failed)."""
    child = started.pop(path, None)
    if child is None:
        return None
    try:
        _, status = os.waitpid(child.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            return None
        size = os.fstat(child.fd).st_size
        return os.pread(child.fd, size, 0) if size else None
    finally:
        os.close(child.fd)


def discard(started: Children) -> None:
    """End the children nobody took (``SIGKILL``: they only read) and reap them."""
    while started:
        _, child = started.popitem()
        with contextlib.suppress(OSError):
            os.kill(child.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child.pid, 0)
        os.close(child.fd)


def _child(target: str, path: str, fd: int, mask: set[int | signal.Signals]) -> None:
    """Run in the forked child: the result into ``fd``, then exit 0; any failure exits 1 (the parent then does
    the work itself). Ctrl-C and SIGTERM end it quietly (the parent reports them): their default actions are
    set while they are still blocked, then ``mask``, the parent's, is restored."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        module, _, name = target.partition(":")
        out = getattr(_import_bare(module), name)(path)
        view = memoryview(out)
        while view:
            view = view[os.write(fd, view) :]
        code = 0
    except BaseException:  # noqa: BLE001, S110 - the parent redoes the work and reports what is wrong
        pass
    finally:
        os._exit(code)


def _import_bare(module: str) -> object:
    """Import ``module`` without running the ``__init__`` of the packages above it that are not imported
    yet: each is registered as a bare package (its search path only). Only in the child, which exits after."""
    parts = module.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError(f"{name} is not a package")
        sys.modules[name] = importlib.util.module_from_spec(spec)
    return importlib.import_module(module)


__all__ = ["Children", "available", "discard", "start", "take"]
