"""Residency: which decoder layers stay on the device, planned from the device budget.

Streaming every layer's weights twice a step and recomputing every layer in backward is what a model far
larger than the device needs; a model that fits (or partly fits) pays for it for nothing. A *kept* layer's
compute-dtype weights get a device buffer of their own, copied once after each optimizer step and used by
every forward and backward until the next (one copy per step instead of two per micro-batch). A layer whose
*graph* is kept runs its forward recording autograd's graph and backpropagates through it: no recompute.
A graph holds its layer's weights, so graph layers are kept layers; both are the first layers of the model
(their compute at the start of the forward hides the ring's first copies, and they end the backward).

Both are the same ops in the same order as streaming with recompute, so losses and gradients are
bit-identical (tests/unit/test_residency.py). An *offloaded* graph is a kept graph whose saved tensors (its
activations, not its weights) go to host memory as its forward finishes and come back one layer ahead of its
backward (engine/pipeline/saved_offload.py): still no recompute, the same tensors (a copy), and device memory
for them O(1) in their count (OFFLOADED_GRAPHS_IN_FLIGHT); worth it where the link moves a layer's saved
tensors faster than the layer recomputes (NVLink-C2C), not over PCIe (tests/unit/test_offloaded_graphs.py). An
*optimizer-resident* layer (also the first ones, all of them
kept) has its FP32 master, gradient slab and Adam state on the device, updated there by torch's AdamW: no gradient
copy to the host, no weight copy back (engine/update/resident.py; tests/unit/test_optimizer_residency.py).
Plain arithmetic, no torch: the engine's per-batch plan (costs/memory.py) and the planner use this one model.
"""

from __future__ import annotations

from dataclasses import dataclass

# The one word a setting is left to its rule with ("auto"), defined here, below the config package that re-exports
# it (megatrain/config/schema.py), because the per-batch rules here and in costs/memory.py read it too.
AUTO = "auto"
STREAM = "stream"
# Offloaded graphs the device holds at once: one layer's saved tensors on their way to the host while the next
# layer records its own, and in backward one layer's brought back ahead while the one after it backpropagates.
OFFLOADED_GRAPHS_IN_FLIGHT = 2
KEYS = ("weights", "activations", "offload", "optimizer")


@dataclass(frozen=True)
class Residency:
    """The first `weights` layers keep their weights on the device; the first `activations` of them keep their
    forward's autograd graph for backward; the first `optimizer` of them keep their FP32 master and Adam state
    there too, updated on the device. The first `offload` of the graph layers keep their graph with its saved
    activations in host memory (`offloaded`)."""

    weights: int = 0
    activations: int = 0
    optimizer: int = 0
    offload: int = 0

    def __post_init__(self) -> None:
        for name in KEYS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"residency {name}={v!r} must be an int >= 0 (a count of layers)")
        if self.activations > self.weights:
            raise ValueError(f"residency activations={self.activations} > weights={self.weights}: a kept graph "
                             f"holds its layer's weights, so keep at least as many layers' weights")
        if self.optimizer > self.weights:
            raise ValueError(f"residency optimizer={self.optimizer} > weights={self.weights}: an optimizer-resident "
                             f"layer's weights live on the device, so set weights >= {self.optimizer}")
        if self.offload > self.activations:
            raise ValueError(f"residency offload={self.offload} > activations={self.activations}: an offloaded graph "
                             f"is one of the kept graphs (its saved tensors moved to host memory), so set "
                             f"activations >= {self.offload} or offload <= {self.activations}")

    @property
    def updated_on_device(self) -> frozenset[int]:
        """The layers whose master and Adam state live and update on the device."""
        return frozenset(range(self.optimizer))

    @property
    def kept(self) -> frozenset[int]:
        return frozenset(range(self.weights))

    @property
    def graphs(self) -> frozenset[int]:
        return frozenset(range(self.activations))

    @property
    def offloaded(self) -> frozenset[int]:
        """The graph layers whose saved tensors wait for backward in host memory: the first `offload` of them. They
        run forward before any graph kept on the device is recorded and backward after every one of those is
        freed, so the device never holds the kept graphs and offloaded ones in flight at once (`device_graphs`).
        Their copies out run at the start of the forward, where the d2h lane is idle, and their copies back at the
        end of the backward, after the streamed layers' weight copies: the h2d lane is theirs."""
        return frozenset(range(self.offload))

    @property
    def device_graphs(self) -> int:
        """Layers' worth of graph bytes the device holds at most: the graphs kept there (all of them at the
        forward/backward turn), or the offloaded ones in flight (OFFLOADED_GRAPHS_IN_FLIGHT), never both."""
        return max(self.activations - self.offload, min(self.offload, OFFLOADED_GRAPHS_IN_FLIGHT))

    def capped(self, n_layers: int) -> Residency:
        a = min(self.activations, n_layers)
        return Residency(min(self.weights, n_layers), a, min(self.optimizer, n_layers), min(self.offload, a))

    def without_graphs(self) -> Residency:
        """The same kept weights and optimizer layers, every layer recomputed (a batch that cannot keep graphs)."""
        return Residency(self.weights, 0, self.optimizer)

    def describe(self, n_layers: int) -> str:
        if self.weights == 0:
            return f"residency: stream all {n_layers} layers (weights copied per pass, every layer recomputed)"
        line = (f"residency: {self.weights} of {n_layers} layers' weights on the device, {self.activations} "
                f"keep their activations (not recomputed)")
        if self.optimizer:
            line += f", {self.optimizer} update on the device (FP32 master and Adam state there)"
        if self.offload:
            line += (f", {self.offload} of those graphs' saved activations offloaded to host memory (copied, not "
                     f"recomputed)")
        return line

    def to_dict(self) -> dict[str, int]:
        """The counts as a setting writes them ("optimizer" and "offload" only where set: a setting written before
        they existed reads the same)."""
        out = {"weights": self.weights, "activations": self.activations}
        if self.offload:
            out["offload"] = self.offload
        return {**out, "optimizer": self.optimizer} if self.optimizer else out


def parse(value: object) -> str | Residency:
    """A `residency` setting as written: "auto", "stream", {"weights": n, "activations": m, "offload": j,
    "optimizer": k} or a Residency."""
    if isinstance(value, Residency):
        return value
    if value == STREAM:
        return Residency(0, 0)
    if value == AUTO:
        return AUTO
    if isinstance(value, dict):
        unknown = set(value) - set(KEYS)
        if unknown or "weights" not in value:
            raise ValueError(f"residency={value!r}: give {{'weights': n, 'activations': m, 'offload': j, "
                             f"'optimizer': k}} (layers counted from the first; activations and optimizer <= weights, "
                             f"offload <= activations, default 0), 'auto' or 'stream'")
        return Residency(value["weights"], value.get("activations", 0), value.get("optimizer", 0),
                         value.get("offload", 0))
    raise ValueError(f"residency={value!r} is not a residency: use 'auto' (plan from the device budget), 'stream' "
                     f"(every layer streamed and recomputed) or {{'weights': n, 'activations': m, 'optimizer': k}}")


def as_written(value: str | Residency) -> str | dict[str, int]:
    """A residency as a config writes it: "auto" as it is, "stream" for none kept, else the counts."""
    if not isinstance(value, Residency):
        return value
    return STREAM if value == Residency() else value.to_dict()


def plan(n_layers: int, layer_bytes: int, graph_bytes: int, room: int | None, ring_bytes: int,
         graphs_allowed: bool, weights_cap: int | None = None, optimizer: int = 0, share: int = 1) -> Residency:
    """The "auto" residency for `room` free device bytes (None: no limit) beyond a batch's working set: kept
    weights first (the cheaper bytes, and a graph needs them), then graphs in what is left. Keeping every
    layer frees the ring of streaming buffers (`ring_bytes`). `graphs_allowed`: False for a batch whose layers
    are tiled or whose boundary activations are offloaded (their backward has its own schedule).
    `weights_cap`: weights are planned once per run (at the first batch) and only ever shrink afterwards.
    `optimizer`: the layers updated on the device (fixed when the engine is built, plan_optimizer): kept whatever
    the room (their weights are their device master's shadow, which cannot stream).
    `share`: the node path's G ranks (docs/DISTRIBUTED.md section 4): a kept layer is kept sharded, 1/G of its bytes
    on each device (engine/pipeline/kept_shards.py), so the room holds G times as many, but a graph's layer is kept
    whole (its gathered weights held until backward), a graph costing the rest of its layer's bytes too, and the
    ring stays (the sharded layers load through it)."""
    optimizer = min(optimizer, n_layers)
    cap = n_layers if weights_cap is None else min(weights_cap, n_layers)
    cap = max(cap, optimizer)
    if room is None:
        return Residency(cap, cap if graphs_allowed else 0, optimizer)
    if share > 1:
        kept_bytes = -(-layer_bytes // share)
        weights = max(optimizer, min(cap, (room - optimizer * (layer_bytes - kept_bytes)) // max(kept_bytes, 1)))
        left = room - weights * kept_bytes - optimizer * (layer_bytes - kept_bytes)
        # the optimizer layers are whole already: their graphs cost the graph alone
        cheap = max(0, min(optimizer, left // max(graph_bytes, 1))) if graphs_allowed else 0
        left -= cheap * graph_bytes
        more = left // max(graph_bytes + layer_bytes - kept_bytes, 1) if graphs_allowed and cheap == optimizer else 0
        return Residency(int(weights), int(max(0, min(weights, cheap + more))), optimizer)
    weights = max(optimizer, min(cap, room // max(layer_bytes, 1)))
    left = room - weights * layer_bytes + (ring_bytes if weights == n_layers else 0)
    graphs = max(0, min(weights, left // max(graph_bytes, 1))) if graphs_allowed else 0
    return Residency(int(weights), int(graphs), optimizer)


# Device bytes per parameter an optimizer-resident layer holds beyond its kept compute-dtype weights: the FP32
# master (4), Adam's m and v (8) and the FP32 gradient slab (4).
OPTIMIZER_BYTES_PER_PARAM = 16


def optimizer_bytes_per_param(grad_itemsize: int = 4) -> int:
    """OPTIMIZER_BYTES_PER_PARAM for a gradient slab of `grad_itemsize` bytes: a bf16 slab (2) is widened into an
    FP32 work buffer for the device's AdamW (update/resident.py move: `grad_work`), 4 B/param beside it: 18."""
    if grad_itemsize not in (2, 4):
        raise ValueError(f"grad_itemsize={grad_itemsize!r}: a gradient slab is FP32 (4) or bf16 (2)")
    return 12 + grad_itemsize + (4 if grad_itemsize < 4 else 0)


def plan_optimizer(n_layers: int, layer_numel: int, itemsize: int, room: int | None,
                   bytes_per_param: int = OPTIMIZER_BYTES_PER_PARAM) -> int:
    """The "auto" count of optimizer-resident layers for `room` device bytes (None: no limit, every layer): each
    takes `bytes_per_param` (optimizer_bytes_per_param) per parameter and `itemsize` more (its kept weights, where
    `room` does not hold them already), and they are the first layers."""
    if room is None:
        return n_layers
    per_layer = layer_numel * (itemsize + bytes_per_param)
    return int(max(0, min(n_layers, room // max(per_layer, 1))))
