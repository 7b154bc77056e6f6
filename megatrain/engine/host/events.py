"""The per-layer events: which queued host job each layer's gradients, update and weights wait for.

Gradients land, are averaged, updated and zeroed by jobs on host threads (stream.py), never on the
caller's. Whatever reads or writes a layer's slab or master orders itself by these events, made once per
engine and handed to everyone who queues such jobs (the layer pipeline, the update path, the ranks'
reductions, the resident gradients' sink). Writers replace an entry (`events.landed[i] = job`), never a list.

- landed[i]: the last job that adds into layer i's gradient slab (the pipeline's reduction, then the average
  across ranks or the reduction to the layer's owner; with the optimizer in backward, the layer's update,
  which consumes the staged gradients). Whoever reads the slab (the optimizer, a norm, a checkpoint) waits
  for it.
- zeroed[i]: layer i's queued gradient zeroing: the next reduction into the slab waits for it.
- updated[i]: layer i's queued update (a shared store: its owner's "updated" token): the next load of the
  layer's weights waits for it.
- globals_landed: the resident parameters' gradient jobs queued since the last wait for them.
- slabs: what those jobs know about each layer's slab (zeroed by a flag, its norm as it landed; slab_state.py).
"""

from __future__ import annotations

from ..runtime.stream import DONE, Event
from .slab_state import SlabState


class LayerEvents:
    def __init__(self, num_layers: int, watchdog_s: float) -> None:
        self.landed: list[Event] = [DONE] * num_layers
        self.zeroed: list[Event] = [DONE] * num_layers
        self.updated: list[Event] = [DONE] * num_layers
        self.globals_landed: list[Event] = []
        self.watchdog_s = watchdog_s
        self.slabs = SlabState(num_layers)  # each layer slab's "fresh" flag and norm, kept by the jobs that write it

    def wait_grads(self) -> None:
        """Block until every layer's (and the resident parameters') gradients have landed in their host slabs."""
        for event in self.landed:
            event.host_wait(self.watchdog_s)
        self.wait_global_grads()

    def wait_global_grads(self) -> None:
        """Block until the resident parameters' gradients have landed in their slab."""
        while self.globals_landed:
            self.globals_landed[0].host_wait(self.watchdog_s)
            self.globals_landed.pop(0)
