"""Run a function on several gloo ranks (``torch.multiprocessing.spawn``, ``file://`` store, no ports).

``run(fn, world, *args)`` spawns ``world`` processes; each starts a gloo process group on a file store
in a fresh temporary folder, calls ``fn(rank, world, *args)`` and writes what it returns (JSON-able) to
``<tmp>/result_<rank>.json``. The parent returns the list of per-rank results. ``fn`` must be a module-level
function (spawn pickles it by name). One spawn costs ~4 s on 2 cores, so put many checks in one ``fn``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable[..., Any], world: int, tmp: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        out = fn(rank, world, *args)
        Path(tmp, f"result_{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()
    # Skip interpreter finalization: gloo worker threads still holding tensors from async work (FSDP2 runs
    # them) can abort the process there ("terminate called without an active exception", SIGABRT) after
    # the result is written -- a known torch issue, not the code under test. Exceptions above still
    # propagate to the parent through spawn's error file.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Call ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the per-rank results."""
    with tempfile.TemporaryDirectory(prefix="zdist-") as tmp:
        mp.spawn(_entry, args=(fn, world, tmp, args), nprocs=world, join=True)
        return [json.loads(Path(tmp, f"result_{r}.json").read_text()) for r in range(world)]


def outcome(call: Callable[[], object]) -> str:
    """How a distributed conversion ended on this rank: ``"no error"``, ``"own:<strerror>"`` (this rank's own
    ``OSError``) or ``"peer:<message>"`` (the ``WriteFailed`` a failure on another rank raises here)."""
    from zckpt.errors import WriteFailed

    try:
        call()
    except OSError as e:
        return f"own:{e.strerror}"
    except WriteFailed as e:
        return f"peer:{e}"
    return "no error"
