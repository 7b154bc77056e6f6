"""The layer pipeline's issue order, defined once: the engine's LayerPipeline (engine/schedule.py) executes
these steps and the planner's simulator (planner/pipeline_sim.py) replays them on its timelines, so the
order a plan predicts is the order a run issues.

With k device buffers, reaching a layer issues the weight copies of it and of the next k-1 layers that
are not resident yet, each into a buffer that holds none of them; at the forward/backward turn the last k
layers are still resident, so backward starts without a copy (and so does the next micro-batch's forward,
unless the optimizer changed the masters in between: `DeviceBuffers.invalidate`).
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


@dataclass(frozen=True)
class Step:
    op: str
    layer: int
    slot: int = -1  # the device buffer, for LOAD, WAIT, FORWARD and BACKWARD


class DeviceBuffers:
    """Which layer each of the k device buffers holds; it carries over from phase to phase."""

    def __init__(self, k: int) -> None:
        self.resident: list[int | None] = [None] * k

    def invalidate(self) -> None:
        """The masters changed (optimizer step, load): every resident copy is stale."""
        self.resident = [None] * len(self.resident)

    def acquire(self, order: list[int], n: int) -> Iterator[Step]:
        """Reach layer order[n]: LOAD what of order[n : n + k] is not resident, then WAIT for order[n]."""
        window = order[n: n + len(self.resident)]
        for layer in window:
            if layer in self.resident:
                continue
            slot = next(s for s, r in enumerate(self.resident) if r not in window)
            self.resident[slot] = layer
            yield Step(LOAD, layer, slot)
        yield Step(WAIT, order[n], self.resident.index(order[n]))


def forward_steps(buffers: DeviceBuffers, n_layers: int) -> Iterator[Step]:
    """One forward over the layers, in issue order."""
    order = list(range(n_layers))
    for n, i in enumerate(order):
        yield from buffers.acquire(order, n)
        slot = buffers.resident.index(i)
        yield Step(SAVE_INPUT, i)
        yield Step(FORWARD, i, slot)


def backward_steps(buffers: DeviceBuffers, n_layers: int) -> Iterator[Step]:
    """One backward over the layers, last first, in issue order: the next layer's input is prefetched
    before this layer's own is waited for, so its copy runs under this layer's compute."""
    order = list(reversed(range(n_layers)))
    for n, i in enumerate(order):
        yield from buffers.acquire(order, n)
        slot = buffers.resident.index(i)
        if n + 1 < len(order):
            yield Step(PREFETCH_INPUT, order[n + 1])
        yield Step(FETCH_INPUT, i)
        yield Step(BACKWARD, i, slot)
        yield Step(SEND_GRAD, i)
        yield Step(DROP_INPUT, i)
