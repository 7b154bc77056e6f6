"""Layers kept sharded on the node path (docs/DISTRIBUTED.md section 4).

On one device a kept layer has a device buffer of its own, copied whole once per change of the masters. On the node
path each of the node's G ranks can instead keep only its shard of the layer (its ranges of the shard map, packed:
1/G of the padded layer) on its device. Such a layer takes a ring slot in the passes a streamed layer would (the
schedule, costs/pipeline.py, is the streamed layers'), but its load is the all-gather alone: the shard placed into
the slot on the device, the rest gathered from the other ranks' shards. No host-to-device copy but the refresh: at
the layer's first load after the masters changed, this rank's own ranges of the host masters into its shard (1/G of
the layer once per step, where a streamed layer copies its 1/G in each pass that loads it). A rank reads only the
ranges its own update wrote (the update by shard), so the refresh waits for this rank's update of the layer alone.

Which kept layers are sharded (`ShardKeeper.split`): those without a kept graph (a graph holds its layer's gathered
weights until backward, where a ring slot would be reused) and not updated on the device (their weights are their
device master's shadow); those stay whole. Kept layers are planned by the residency setting (costs/residency.py):
an explicit count keeps that many, "auto" fills the device budget (its planning of sharded bytes: see the doc).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ...costs.residency import Residency
from ..host.store import HostStore
from ..runtime.stream import DONE, Event, Streams


class KeptShardWeights(Protocol):
    """The node path's weights (schedule.ShardedWeights) that can keep a layer sharded: node_path.NodeWeights."""

    world: int

    def shard_numel(self, numel: int) -> int:
        """Elements of this rank's packed shard of a layer of `numel` (1/G of the padded layer)."""

    def refresh(self, shard: torch.Tensor, src: torch.Tensor, numel: int) -> int:
        """Copy this rank's ranges of `src` (the layer's host stream source) into `shard`; the bytes copied."""

    def place(self, buffer: torch.Tensor, shard: torch.Tensor, numel: int) -> None:
        """Copy `shard` into this rank's ranges of `buffer` (device to device), ready for `gather`."""

    def gather(self, buffer: torch.Tensor, numel: int) -> int:
        """Every rank's shard of the layer into `buffer` (its own already there); the bytes received."""


def keeps_shards(weights: object) -> bool:
    """Whether the pipeline's sharded weights can keep a layer sharded (node_path.NodeWeights; not the shared store
    across nodes' SharedWeights, whose layers are each one owner's)."""
    return all(callable(getattr(weights, name, None)) for name in ("shard_numel", "refresh", "place"))


class ShardKeeper:
    """This rank's device shards of the layers kept sharded, and their refreshes and loads."""

    def __init__(self, store: HostStore, streams: Streams, dtype: torch.dtype, device: torch.device) -> None:
        self.store, self.streams, self.dtype, self.device = store, streams, dtype, device
        self.weights: KeptShardWeights | None = None  # set by the pipeline's use_weights where it keeps shards
        self.shards: dict[int, torch.Tensor] = {}  # layer -> this rank's packed shard on the device
        self._current: set[int] = set()  # shards refreshed since the masters last changed
        self._ready: dict[int, Event] = {}  # each shard's last refresh
        self._read: dict[int, Event] = {}  # each shard's last placement into a slot: its next refresh waits for it

    @property
    def nbytes(self) -> int:
        """Device bytes of the kept shards, as allocated."""
        return sum(t.numel() * t.element_size() for t in self.shards.values())

    def split(self, r: Residency, whole_now: frozenset[int]) -> tuple[frozenset[int], frozenset[int]]:
        """(layers kept whole, layers kept sharded) of residency `r` (every kept layer whole off the node path), the
        layers kept whole now being `whole_now`. A plan without graphs (a non-training forward's, which may come
        between a training forward and its backward; a tiled batch's) leaves a whole layer it keeps whole: the kept
        graphs of that backward read their layers' slots."""
        if self.weights is None:
            return r.kept, frozenset()
        whole = frozenset(range(max(r.activations, r.optimizer)))
        if r.activations == 0:
            whole |= whole_now & r.kept
        return whole, r.kept - whole

    def drop(self, sharded: frozenset[int]) -> dict[int, torch.Tensor]:
        """Give up the shards of layers not in `sharded`, before any new buffer is allocated; the ones that stay
        (still current where they were) for `allocate`."""
        stay = {i: t for i, t in self.shards.items() if i in sharded}
        self._current &= set(stay)
        self.shards = {}
        return stay

    def allocate(self, sharded: frozenset[int], stay: dict[int, torch.Tensor]) -> None:
        """A device shard for each layer of `sharded` (the ones in `stay` kept as they are). Never the host's own
        memory, as an aliased whole layer on a CPU device is: the shard is a packed copy of this rank's ranges."""
        self.shards = {i: stay[i] if i in stay else
                       torch.empty(self.weights.shard_numel(self.store.layers[i].numel), dtype=self.dtype,
                                   device=self.device) for i in sorted(sharded)}

    def invalidate(self) -> None:
        """The masters changed: every shard is refreshed at its layer's next load."""
        self._current.clear()

    def load(self, layer: int, buffer: Callable[[], torch.Tensor], free: Event, updated: Event) -> Event:
        """Layer `layer` into the ring slot `buffer()` (looked up when the gather runs, as the pipeline's loads do)
        once `free` (the slot's last reader) is done: its shard refreshed first where the masters changed (on the h2d
        stream, after `updated`, the layer's update, and after the last gather that read the old shard), then placed
        and all-gathered on the gather stream. Returns the slot's `loaded` event."""
        group, weights, shard = self.store.layers[layer], self.weights, self.shards[layer]
        if layer not in self._current:
            def refresh() -> int:
                return weights.refresh(shard, group.stream_source, group.numel)

            self._ready[layer] = self.streams.h2d.submit(refresh, (self._read.get(layer, DONE), updated), "refresh",
                                                         layer)
            self._current.add(layer)

        def gather() -> int:
            slot = buffer()
            weights.place(slot, shard, group.numel)
            return weights.gather(slot, group.numel)

        self._read[layer] = self.streams.gather.submit(gather, (free, self._ready[layer]), "gather", layer)
        return self._read[layer]
