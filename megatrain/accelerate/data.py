"""The prepared dataloader: batches left in host memory for the engine to copy, the last of an epoch marked, sharded
over ranks."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .wrappers import GradientState, forward_attr


class _Skip:
    """A batch sampler (its skipped batches are never loaded) or an iterable-dataset loader (they must be
    produced to be passed over) without its first `skip` batches."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return max(len(self.inner) - self.skip, 0)


def skipping(loader: torch.utils.data.DataLoader, skip: int) -> Any:
    if skip == 0:
        return loader
    if isinstance(loader.dataset, torch.utils.data.IterableDataset) or loader.batch_sampler is None:
        return _Skip(loader, skip)
    return torch.utils.data.DataLoader(
        loader.dataset, batch_sampler=_Skip(loader.batch_sampler, skip), collate_fn=loader.collate_fn,
        num_workers=loader.num_workers, pin_memory=loader.pin_memory, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator, persistent_workers=loader.persistent_workers)


class PreparedDataLoader:
    """Yields the loader's batches and marks the last one of each epoch.

    The batches stay in host memory: the engine copies what it needs to the device itself (the ids queued as one
    asynchronous copy), and reads the rest (which labels count, where padding and documents start, the
    embedding's rows) where it is, on the host. Moved to a GPU first, each of those reads would be a device sync
    per micro-batch.

    With several ranks, rank r of N yields batches r, r + N, r + 2N, ... (Accelerate's default
    sharding): one round of N batches is one global batch of N x the loader's batch size. A last,
    incomplete round is dropped (every rank must take the same number of steps).
    """

    def __init__(self, loader: torch.utils.data.DataLoader, device: torch.device, state: GradientState,
                 num_processes: int = 1, process_index: int = 0) -> None:
        self.loader = loader
        self._device = device
        self._state = state
        self._n = num_processes
        self._rank = process_index
        if num_processes > 1:
            try:
                extra = len(loader) % num_processes
            except TypeError:
                extra = 0  # an iterable dataset without a length: its rounds are counted as they come
            if extra:
                warnings.warn(f"the dataloader's {len(loader)} batches do not split evenly over {num_processes} "
                              f"processes: the last {extra} are dropped every epoch", stacklevel=3)
        self.epoch_rng_state: torch.Tensor | None = None

    def _generator(self) -> torch.Generator | None:
        loader = self.loader.inner if isinstance(self.loader, _Skip) else self.loader
        batches = getattr(loader, "batch_sampler", None)
        sampler = getattr(batches.inner if isinstance(batches, _Skip) else batches, "sampler", None)
        gen = getattr(sampler, "generator", None)
        return gen if gen is not None else getattr(loader, "generator", None)

    def set_epoch_rng_state(self, state: torch.Tensor | None) -> None:
        """Rewind the sampler's generator to where an epoch began, so that epoch's order comes again."""
        gen = self._generator()
        if state is not None and gen is not None:
            gen.set_state(state)

    def _mine(self) -> Iterator[Any]:
        if self._n == 1:
            yield from self.loader
            return
        round_: list[Any] = []
        for batch in self.loader:
            round_.append(batch)
            if len(round_) == self._n:
                yield round_[self._rank]
                round_ = []

    def __iter__(self) -> Iterator[Any]:
        self._state.end_of_dataloader = False
        gen = self._generator()
        # The order of this epoch is drawn from the generator when iteration starts: remember where it stood, so a
        # checkpoint taken mid-epoch resumes the same order (save_state / load_state, then skip_first_batches).
        self.epoch_rng_state = gen.get_state() if gen is not None else None
        it = self._mine()
        try:
            current = next(it)
        except StopIteration:
            return
        while True:
            # Look one batch ahead so the last batch is known to be last while it is being used.
            try:
                upcoming = next(it)
            except StopIteration:
                self._state.end_of_dataloader = True
                yield current
                break
            yield current
            current = upcoming
        self._state.end_of_dataloader = False

    def __len__(self) -> int:
        return len(self.loader) // self._n

    def __getattr__(self, name: str) -> Any:
        return forward_attr(self, "loader", name)
