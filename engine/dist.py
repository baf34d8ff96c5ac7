"""Process-group start-up: ``init_distributed`` (DeepSpeed's ``deepspeed.init_distributed``).

Reads the launcher's environment (torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``). Without a launcher it runs as world size 1 with no process group at all: every engine
collective is then a local no-op (``engine.zero.collectives``).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


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
