"""Residency: which decoder layers stay on the device, planned from the device budget.

Streaming every layer's weights twice a step and recomputing every layer in backward is what a model far
larger than the device needs; a model that fits (or partly fits) pays for it for nothing. A *kept* layer's
compute-dtype weights get a device buffer of their own, copied once after each optimizer step and used by
every forward and backward until the next (one copy per step instead of two per micro-batch). A layer whose
*graph* is kept runs its forward recording autograd's graph and backpropagates through it: no recompute.
A graph holds its layer's weights, so graph layers are kept layers; both are the first layers of the model
(their compute at the start of the forward hides the ring's first copies, and they end the backward).

Both are the same ops in the same order as streaming with recompute, so losses and gradients are
bit-identical (tests/unit/test_residency.py). Plain arithmetic, no torch: the engine's per-batch plan
(costs/memory.py) and the planner use this one model.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO, STREAM = "auto", "stream"


@dataclass(frozen=True)
class Residency:
    """The first `weights` layers keep their weights on the device; the first `activations` of them keep their
    forward's autograd graph for backward."""

    weights: int = 0
    activations: int = 0

    def __post_init__(self) -> None:
        for name in ("weights", "activations"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"residency {name}={v!r} must be an int >= 0 (a count of layers)")
        if self.activations > self.weights:
            raise ValueError(f"residency activations={self.activations} > weights={self.weights}: a kept graph "
                             f"holds its layer's weights, so keep at least as many layers' weights")

    @property
    def kept(self) -> frozenset[int]:
        return frozenset(range(self.weights))

    @property
    def graphs(self) -> frozenset[int]:
        return frozenset(range(self.activations))

    def capped(self, n_layers: int) -> Residency:
        return Residency(min(self.weights, n_layers), min(self.activations, n_layers))

    def describe(self, n_layers: int) -> str:
        if self.weights == 0:
            return f"residency: stream all {n_layers} layers (weights copied per pass, every layer recomputed)"
        return (f"residency: {self.weights} of {n_layers} layers' weights on the device, {self.activations} "
                f"keep their activations (not recomputed)")

    def to_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "activations": self.activations}


def parse(value: object) -> str | Residency:
    """A `residency` setting as written: "auto", "stream", {"weights": n, "activations": m} or a Residency."""
    if isinstance(value, Residency):
        return value
    if value == STREAM:
        return Residency(0, 0)
    if value == AUTO:
        return AUTO
    if isinstance(value, dict):
        unknown = set(value) - {"weights", "activations"}
        if unknown or "weights" not in value:
            raise ValueError(f"residency={value!r}: give {{'weights': n, 'activations': m}} (layers counted from "
                             f"the first; activations <= weights, default 0), 'auto' or 'stream'")
        return Residency(value["weights"], value.get("activations", 0))
    raise ValueError(f"residency={value!r} is not a residency: use 'auto' (plan from the device budget), 'stream' "
                     f"(every layer streamed and recomputed) or {{'weights': n, 'activations': m}}")


def plan(n_layers: int, layer_bytes: int, graph_bytes: int, room: int | None, ring_bytes: int,
         graphs_allowed: bool, weights_cap: int | None = None) -> Residency:
    """The "auto" residency for `room` free device bytes (None: no limit) beyond a batch's working set: kept
    weights first (the cheaper bytes, and a graph needs them), then graphs in what is left. Keeping every
    layer frees the ring of streaming buffers (`ring_bytes`). `graphs_allowed`: False for a batch whose layers
    are tiled or whose boundary activations are offloaded (their backward has its own schedule).
    `weights_cap`: weights are planned once per run (at the first batch) and only ever shrink afterwards."""
    cap = n_layers if weights_cap is None else min(weights_cap, n_layers)
    if room is None:
        return Residency(cap, cap if graphs_allowed else 0)
    weights = max(0, min(cap, room // max(layer_bytes, 1)))
    left = room - weights * layer_bytes + (ring_bytes if weights == n_layers else 0)
    graphs = max(0, min(weights, left // max(graph_bytes, 1))) if graphs_allowed else 0
    return Residency(int(weights), int(graphs))
