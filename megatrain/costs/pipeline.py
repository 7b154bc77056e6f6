"""The layer pipeline's issue order, defined once: the engine's LayerPipeline (engine/pipeline/schedule.py) executes
these steps and the planner's simulator (planner/pipeline_sim.py) replays them on its timelines, so the
order a plan predicts is the order a run issues.

With k device buffers, reaching a layer issues the weight copies of it and of the next k-1 layers that
are not resident yet, each into a buffer that holds none of them; at the forward/backward turn the last k
layers are still resident, so backward starts without a copy (and so does the next micro-batch's forward,
unless the optimizer changed the masters in between: `DeviceBuffers.invalidate`).

Residency (costs/residency.py) changes two things. A *kept* layer has a device buffer of its own: it is
copied once after each change of the masters and serves every forward and backward until the next, so it
takes no ring buffer and its compute gives the ring time to fill with the streamed layers ahead. Its copies are
issued before any ring prefetch of the same pass (`DeviceBuffers.acquire`). A layer whose
*graph* is kept runs its forward with autograd recording (FORWARD_KEEP) and its backward from that graph
(BACKWARD_KEPT): no input saved, no recompute. A graph holds its weights, so graph layers are kept layers.
An *offloaded* graph (residency `offload`) sends its saved activations to the host after its forward
(SEND_GRAPH, the d2h stream) and, in backward, has them brought back one layer ahead (PREFETCH_GRAPH, the h2d
stream, issued before the backward of the layer after it) and waits for them before its own (FETCH_GRAPH).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

LOAD = "load"  # copy the layer's weights into device buffer `slot` (the h2d stream)
WAIT = "wait"  # the compute stream waits for the layer's copy into `slot`
SAVE_INPUT = "save_input"  # forward: keep the layer's input for its backward (sent to the host when offloaded)
FORWARD = "forward"  # the layer's forward from buffer `slot`
PREFETCH_INPUT = "prefetch_input"  # backward: bring the next layer's input back (when offloaded)
FETCH_INPUT = "fetch_input"  # backward: the layer's own input, waited for
BACKWARD = "backward"  # the layer's recompute + backward from buffer `slot`
SEND_GRAD = "send_grad"  # the layer's weight gradients leave for its host slab (the d2h stream)
DROP_INPUT = "drop_input"  # backward: the layer's input is no longer needed
FORWARD_KEEP = "forward_keep"  # the layer's forward recording its autograd graph for backward (a kept layer)
BACKWARD_KEPT = "backward_kept"  # the layer's backward from the graph its forward kept: no recompute
SEND_GRAPH = "send_graph"  # forward: an offloaded graph's saved activations leave for the host (the d2h stream)
PREFETCH_GRAPH = "prefetch_graph"  # backward: bring the next layer's offloaded graph back (the h2d stream)
FETCH_GRAPH = "fetch_graph"  # backward: the layer's own offloaded graph, waited for


@dataclass(frozen=True)
class Step:
    op: str
    layer: int
    slot: int = -1  # the device buffer, for LOAD, WAIT, FORWARD and BACKWARD


class DeviceBuffers:
    """Which layer each device buffer holds; it carries over from phase to phase. Slots 0..k-1 are the ring the
    streamed layers share; each kept layer has slot k + its rank among the kept layers."""

    def __init__(self, k: int, kept: frozenset[int] = frozenset()) -> None:
        self.k = k
        self.kept = frozenset(kept)
        self.kept_slot = {layer: k + j for j, layer in enumerate(sorted(self.kept))}
        self.resident: list[int | None] = [None] * (k + len(self.kept))

    def invalidate(self) -> None:
        """The masters changed (optimizer step, load): every resident copy is stale."""
        self.resident = [None] * len(self.resident)

    def _window(self, order: list[int], n: int) -> list[int]:
        """The layers to have copied on reaching order[n]: the kept ones among order[n : n + k] and the next k
        streamed ones (with every layer streamed: order[n : n + k])."""
        want, streamed, near = [], 0, max(self.k, 1)
        for j, layer in enumerate(order[n:]):
            if j >= near and streamed >= self.k:
                break
            if layer in self.kept:
                if j < near:
                    want.append(layer)
            elif streamed < self.k:
                want.append(layer)
                streamed += 1
        return want

    def acquire(self, order: list[int], n: int) -> Iterator[Step]:
        """Reach layer order[n]: LOAD what of its window is not resident, then WAIT for order[n]. Every kept layer
        still to come that is not resident is loaded first, ahead of the ring's prefetches: the copy queue is one
        FIFO and a streamed layer's copy waits for that layer's host update, so a kept layer's refresh queued
        behind it would wait for an update it does not need. Kept layers come first in the forward, so this is
        also the order their compute needs them."""
        window = self._window(order, n)
        ahead = [layer for layer in order[n:] if layer in self.kept and layer not in self.resident]
        for layer in ahead + [layer for layer in window if layer not in ahead]:
            if layer in self.resident:
                continue
            if layer in self.kept:
                slot = self.kept_slot[layer]
            else:
                slot = next(s for s in range(self.k) if self.resident[s] not in window)
            self.resident[slot] = layer
            yield Step(LOAD, layer, slot)
        yield Step(WAIT, order[n], self.resident.index(order[n]))


def forward_steps(buffers: DeviceBuffers, n_layers: int, graphs: frozenset[int] = frozenset(),
                  offloaded: frozenset[int] = frozenset()) -> Iterator[Step]:
    """One forward over the layers, in issue order (`graphs`: the layers whose autograd graph is kept;
    `offloaded`: those of them whose saved activations go to the host)."""
    order = list(range(n_layers))
    for n, i in enumerate(order):
        yield from buffers.acquire(order, n)
        slot = buffers.resident.index(i)
        if i in graphs:
            yield Step(FORWARD_KEEP, i, slot)
            if i in offloaded:
                yield Step(SEND_GRAPH, i)
            continue
        yield Step(SAVE_INPUT, i)
        yield Step(FORWARD, i, slot)


def backward_steps(buffers: DeviceBuffers, n_layers: int, graphs: frozenset[int] = frozenset(),
                   offloaded: frozenset[int] = frozenset()) -> Iterator[Step]:
    """One backward over the layers, last first, in issue order: the next layer's input (or offloaded graph) is
    prefetched before this layer's own is waited for, so its copy runs under this layer's compute. A kept graph
    needs neither its weights copied nor its input."""
    order = list(reversed(range(n_layers)))
    for n, i in enumerate(order):
        nxt = order[n + 1] if n + 1 < len(order) else None
        if i in graphs:
            if i in offloaded:  # its own copy back first (a no-op where the layer before issued it): the lane is FIFO
                yield Step(PREFETCH_GRAPH, i)
            if nxt is not None and nxt not in graphs:
                yield Step(PREFETCH_INPUT, nxt)
            if nxt in offloaded:
                yield Step(PREFETCH_GRAPH, nxt)
            if i in offloaded:
                yield Step(FETCH_GRAPH, i)
            yield Step(BACKWARD_KEPT, i, buffers.kept_slot[i])
            yield Step(SEND_GRAD, i)
            continue
        yield from buffers.acquire(order, n)
        slot = buffers.resident.index(i)
        if nxt is not None and nxt not in graphs:
            yield Step(PREFETCH_INPUT, nxt)
        if nxt in offloaded:
            yield Step(PREFETCH_GRAPH, nxt)
        yield Step(FETCH_INPUT, i)
        yield Step(BACKWARD, i, slot)
        yield Step(SEND_GRAD, i)
        yield Step(DROP_INPUT, i)
