"""The training dataloader `initialize()` and `engine.deepspeed_io()` build, sampled as DeepSpeed samples."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset


def make_dataloader(dataset: Any, batch_size: int, collate_fn: Callable | None, drop_last: bool, sampler: Any = None,
                    num_workers: int = 0, world_size: int = 1, rank: int = 0) -> DataLoader:
    if isinstance(dataset, IterableDataset):
        return DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn, drop_last=drop_last,
                          num_workers=num_workers)
    # DeepSpeed samples with a DistributedSampler over the data-parallel ranks (shuffled, seed 0, never
    # re-seeded per epoch); using the same sampler keeps the data order of a ported script identical.
    sampler = sampler if sampler is not None else DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last,
                      num_workers=num_workers)
