"""``engine.accelerator``: DeepSpeed's ``deepspeed.accelerator.get_accelerator()`` for the engine's devices.

Owns the device questions a training script asks DeepSpeed instead of torch: which device to put tensors
on (``device_name``, ``current_device_name``), how many there are, the communication backend, seeds,
synchronisation, memory counters and pinning. The engine runs on CUDA when torch has it and on the CPU
otherwise (``engine.dist.device``); the answers follow DeepSpeed 0.19.8's ``CUDA_Accelerator`` and
``CPU_Accelerator`` (the CPU one answers ``"cpu"`` for every device name and the launcher's
``LOCAL_RANK`` for ``current_device``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from engine import dist as _dist

__all__ = ["Accelerator", "get_accelerator"]


class Accelerator:
    """One kind of device: ``"cuda"`` or ``"cpu"``; the methods are DeepSpeed's accelerator interface."""

    def __init__(self, kind: str) -> None:
        self._name = kind
        self._cuda = kind == "cuda"

    # -- devices ----------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        if not self._cuda or device_index is None:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> Any:
        if not self._cuda:
            return None
        return torch.device("cuda") if device_index is None else torch.device("cuda", device_index)

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> Any:
        if self._cuda:
            return torch.cuda.current_device()
        return os.environ.get("LOCAL_RANK", 0)

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        if self._cuda:
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_synchronized_device(self) -> bool:
        return not self._cuda

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # -- dtypes -----------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    # -- random numbers ---------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    # -- memory -----------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else 0

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The accelerator of the engine's device (``engine.dist.device``): CUDA when available, else CPU."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator(_dist.device().type)
    return _ACCELERATOR
