"""Process-group start-up: ``init_distributed`` (DeepSpeed's ``deepspeed.init_distributed``).

Reads the launcher's environment (torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``). Without a launcher it runs as world size 1 with no process group at all: every engine
collective is then a local no-op (``engine.zero.collectives``).

At exit (``settle_at_exit``) the engine gives gloo's worker threads the interpreter before it finalizes: a
worker that finishes a collective destroys its work object afterwards, and that drops references to Python
tensors, which needs the GIL; if the main thread has reached finalization by then (a busy machine deschedules
the worker for a few milliseconds), the worker is terminated inside a destructor and the process aborts with
"terminate called without an active exception" (SIGABRT, a failed rank to torchrun) after the script ended
cleanly. torch's own fix (an atexit ``destroy_process_group``) was abandoned upstream.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SETTLE_MAX_S = 1.0
"""At most this long at exit waiting for the process's other threads to stop running."""
_settle_registered = False


def _running_threads() -> int:
    """Threads of this process, other than the calling one, that are running or runnable (``R``)."""
    me, n = str(os.getpid()), 0
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return 0
    for task in tasks:
        if task.name == me:
            continue
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        n += stat[stat.rfind(")") + 2 :].startswith("R")
    return n


def _settle() -> None:
    """atexit: sleep (releasing the GIL) until no other thread has run for three polls in a row."""
    deadline, quiet = time.monotonic() + SETTLE_MAX_S, 0
    while quiet < 3 and time.monotonic() < deadline:
        time.sleep(0.002)
        quiet = quiet + 1 if _running_threads() == 0 else 0


def settle_at_exit() -> None:
    """Register ``_settle`` once (module docstring: why). Called when the engine meets a gloo group."""
    global _settle_registered
    if not _settle_registered and Path("/proc/self/task").is_dir():
        atexit.register(_settle)
        _settle_registered = True


def launched() -> bool:
    """Whether a launcher (torchrun, deepspeed, mpirun-with-env) set up a multi-process world."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def device() -> torch.device:
    """This rank's compute device: ``cuda:<LOCAL_RANK>`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(
    dist_backend: str | None = None, timeout: timedelta = timedelta(minutes=30), **_ignored: object
) -> None:
    """Initialise the default process group once (NCCL with CUDA, gloo without); no-op when already done.

    World size 1 without a launcher leaves torch.distributed uninitialised, which the engine treats as a
    single process. Extra DeepSpeed keyword arguments (``auto_mpi_discovery``, ``verbose``...) are accepted.
    """
    if not dist.is_available() or dist.is_initialized():
        return
    if not launched():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise RuntimeError("WORLD_SIZE > 1 but RANK/MASTER_ADDR are unset; launch with torchrun")
        log.info("no launcher environment: running single-process without a process group")
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "gloo":
        settle_at_exit()
    if backend == "nccl":
        torch.cuda.set_device(device())
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps one agent store across restarts: keys of the previous attempt's process group
        # (its ranks' gloo/NCCL addresses) are still there, and a rank that reads one before its peer
        # overwrites it connects to a dead process. Namespace this attempt's keys.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=timeout)  # fmt: skip
        store = dist.PrefixStore(f"zckpt-engine/attempt{restart}", agent)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
        return
    dist.init_process_group(backend=backend, timeout=timeout)
