"""``engine.data``: the data loader ``initialize(training_data=...)`` and ``engine.deepspeed_io`` return.

Owns DeepSpeed's ``DeepSpeedDataLoader`` contract as a script sees it: micro batches of
``train_micro_batch_size_per_gpu`` samples from this rank's ``DistributedSampler`` share of the dataset
(shuffled with seed 0 for training; the sampler's epoch stays 0 unless the script calls
``loader.data_sampler.set_epoch(e)``, so without that every epoch repeats one order, as in DeepSpeed),
``len(loader)`` in micro batches, ``drop_last`` from the config's ``dataloader_drop_last``, and a fresh pass
each time the loader is iterated. Unlike DeepSpeed it loads in the training process unless asked for workers
(``num_local_io_workers``); the batches are the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

__all__ = ["DeepSpeedDataLoader"]


class DeepSpeedDataLoader:
    """Iterable over micro batches of this rank's share of ``dataset`` (see the module docstring)."""

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        world: int,
        rank: int,
        shuffle: bool = True,
        data_sampler: Any = None,
        collate_fn: Any = None,
        pin_memory: bool = False,
        num_workers: int = 0,
        drop_last: bool = False,
    ) -> None:
        if data_sampler is None:
            data_sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle)
        self.dataset = dataset
        self.data_sampler = data_sampler
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        self.num_local_io_workers = num_workers
        self.dataloader_drop_last = drop_last
        n = len(data_sampler)
        self.len = n // batch_size if drop_last else math.ceil(n / batch_size)
        self.dataloader: DataLoader[Any] | None = None
        self.data: Iterator[Any] | None = None

    def __len__(self) -> int:
        return self.len

    def __iter__(self) -> DeepSpeedDataLoader:
        self.dataloader = DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=self.data_sampler,
            collate_fn=self.collate_fn,
            pin_memory=self.pin_memory,
            num_workers=self.num_local_io_workers,
            drop_last=self.dataloader_drop_last,
        )
        self.data = iter(self.dataloader)
        return self

    def __next__(self) -> Any:
        if self.data is None:
            iter(self)
        assert self.data is not None
        return next(self.data)
