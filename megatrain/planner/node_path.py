"""The node path of docs/DISTRIBUTED.md, per GPU: what one local rank's copies, collectives and host adds cost
per streamed layer when a layer crosses the host link once per node.

Planned, not yet run by the engine (which runs the per-rank path, planner/multi.py's other branch).

With G GPUs per node in NVLink domains of D (the profile's nvlink_gpus, at most G):
  weights    each rank copies its 1/G shard host->device, the node all-gathers: across domains (G/D - 1)/G of
             the layer over this GPU's PCIe link (peer to peer, beside its own shard), within its domain
             (D - 1)/D over NVLink. Two stages of one double-buffered pipeline: the slower sets the pace.
  gradients  FP32 (4 B/param), reduce-scattered the same way; the rank's 1/G shard goes device->host. At the
             first micro-batch after zero_grad the shard lands in the slab itself (a DMA into the pinned slab:
             0 + g, the norm taken on the GPU); later micro-batches land in staging and the rank's reducer adds
             them (read 4, read + write the slab). A bf16 slab always goes through staging (read 4, write 2).
  NVLink     one resource for both collectives: in backward the recompute's all-gather and the reduce-scatter
             run together, so each is charged at half the rate (conservative in the forward, where only the
             gather runs).
  network    (nodes sharing one store) a layer another node owns arrives over the network: S/G per GPU at its
             share of the node's network, a third stage of the same pipeline; its gradient shard goes back to
             the owner the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..costs import residency as kept
from .hardware import GB, Hardware, _is_bf16
from .point import Point

NODE = "node"
PER_RANK = "per-rank"
# Bytes per parameter of the FP32 gradient the reduce-scatter moves and the shard carries to the host.
GRAD_WIRE_BYTES = 4
# The node path's device buffers beyond one GPU's plan: two FP32 chunk buffers of CHUNK_ELEMENTS (the
# reduce-scatter's input, double-buffered) and their shards.
CHUNK_ELEMENTS = 32 * 2**20


@dataclass(frozen=True)
class NodeShare:
    """One GPU's share of a layer's trip on the node path."""

    gpus: int  # G
    domain: int  # D: GPUs per NVLink domain, 2 <= D <= G
    nvlink_bps: float  # per direction, the collectives' achieved bus bandwidth
    net_bps: float = 0.0  # this GPU's share of the node's network (nodes sharing one store), 0: none
    foreign: float = 0.0  # fraction of the layers another node owns (nodes sharing one store)

    @property
    def link_fraction(self) -> float:
        """Of a layer's bytes, what crosses this GPU's PCIe link: its shard, and the other domains' shards."""
        G, D = self.gpus, self.domain
        return 1 / G + (math.ceil(G / D) - 1) / G

    @property
    def nvlink_fraction(self) -> float:
        return (self.domain - 1) / self.domain

    def _lane(self, nbytes: float, link_bps: float) -> float:
        nv = nbytes * self.nvlink_fraction / (self.nvlink_bps / 2) if self.nvlink_fraction else 0.0
        t = max(nbytes * self.link_fraction / link_bps, nv)
        if self.net_bps and self.foreign:
            t = max(t, nbytes / self.gpus / self.net_bps)  # a foreign layer's shard over this GPU's NIC
        return t

    def weights_s(self, layer_params: int, c: int, link_bps: float) -> float:
        return self._lane(layer_params * c, link_bps)

    def grads_s(self, layer_params: int, link_bps: float) -> float:
        return self._lane(layer_params * GRAD_WIRE_BYTES, link_bps)

    def nvlink_bytes(self, layer_params: int, c: int, loads: int, grads: int) -> float:
        """Bytes this GPU receives over NVLink for `loads` layer loads and `grads` layer reductions."""
        return (loads * layer_params * c + grads * layer_params * GRAD_WIRE_BYTES) * self.nvlink_fraction

    def nvlink_s(self, layer_params: int, c: int, loads: int, grads: int) -> float:
        return self.nvlink_bytes(layer_params, c, loads, grads) / self.nvlink_bps if self.nvlink_bps else 0.0


def reducer_bytes_per_param(p: Point) -> float:
    """Host bytes per layer parameter of this rank's shard that its reducer moves, averaged over the step's
    micro-batches (see the module's docstring)."""
    if _is_bf16(p.host_grad_dtype):
        return GRAD_WIRE_BYTES + 2
    g = max(1, p.grad_accum)
    return (g - 1) / g * (GRAD_WIRE_BYTES + 8)  # the first micro-batch lands in the slab by DMA


def path_for(hw: Hardware, gpus_per_node: int) -> tuple[str, str]:
    """(NODE or PER_RANK, why) for `gpus_per_node` GPUs of profile `hw`, as the engine's "auto" would choose
    (docs/DISTRIBUTED.md, section 9)."""
    G = gpus_per_node
    if G == 1:
        return PER_RANK, "one GPU per node: nothing to share a layer's trip with"
    if hw.unified_memory:
        return PER_RANK, "a CPU device: the planner keeps the per-rank model (the engine's gloo stand-in is a test path)"
    if not hw.nvlink_gbs or hw.nvlink_gpus < 2:
        return PER_RANK, (f"profile {hw.name!r} has no NVLink between its GPUs (nvlink_gbs): an all-gather would "
                          "cross the PCIe links it saves")
    d = min(hw.nvlink_gpus, G)
    return NODE, (f"one trip per layer per node: {G} GPUs, NVLink {hw.nvlink_gbs:g} GB/s"
                  + (f" in domains of {d} (the rest over PCIe)" if d < G else ""))


def node_share(hw: Hardware, gpus_per_node: int, nodes: int = 1, shared_store: bool = False) -> NodeShare:
    """The node path's share for one GPU of `hw` (path_for must have said NODE)."""
    G = gpus_per_node
    net = (hw.network_gbs or 0.0) * GB / G if shared_store and nodes > 1 else 0.0
    return NodeShare(G, min(hw.nvlink_gpus, G), hw.nvlink_gbs * GB, net, (nodes - 1) / nodes if net else 0.0)


def collective_device_bytes(p: Point, gpus: int) -> int:
    """Device bytes the node path adds to one GPU's plan: the reduce-scatter's two FP32 chunk buffers and their
    shards (docs/DISTRIBUTED.md, section 7)."""
    chunk = min(CHUNK_ELEMENTS, p.model.layer_params())
    return int(2 * GRAD_WIRE_BYTES * chunk * (1 + 1 / gpus))


# -- Residency for the node (docs/DISTRIBUTED.md, section 4) ----------------------------------------------------------
# As the engine's node path keeps it: of a Residency(weights=K, activations=M) the first M layers are kept whole
# with their graphs (the graph holds the gathered weights until backward) and the other K - M kept sharded, each
# GPU holding its 1/G of the layer's compute-dtype bytes. A sharded layer loads through the ring in every pass a
# streamed layer would, by the all-gather alone (its shard placed from HBM), and crosses the host link once per
# step: the refresh of this GPU's shard after the update.

# The device memory row of the layers kept sharded (planner/multi.py node_memory)
KEPT_SHARDS = "kept layers' shards (node path)"


def shard_bytes(layer_bytes: int, gpus: int) -> int:
    """Device bytes one layer kept sharded holds on each GPU."""
    return -(-layer_bytes // gpus)


def fill(n_layers: int, layer_bytes: int, graph_bytes: int, room: int | None, gpus: int,
         graphs_allowed: bool) -> kept.Residency:
    """The engine's "auto" on the node path: costs/residency.py's fill (kept weights first, then graphs) with a kept
    layer costing its shard and a graph its graph plus the rest of its layer (kept whole); the ring stays (the
    sharded layers load through it), so keeping every layer frees nothing."""
    kb = shard_bytes(layer_bytes, gpus)
    return kept.plan(n_layers, kb, graph_bytes + layer_bytes - kb, room, 0, graphs_allowed)


def frontier(n_layers: int, layer_bytes: int, graph_bytes: int, room: int | None, gpus: int,
             graphs_allowed: bool, samples: int) -> list[kept.Residency]:
    """Placements that fill `room`, from the most sharded layers to the most graphs (kept whole), `samples` of
    them: for each graph count, as many sharded layers as still fit. Which gains more (a graph its layer's
    recompute, a shard its link time) is the replay's to say, as on one GPU (planner/placement.py)."""
    first = fill(n_layers, layer_bytes, graph_bytes, room, gpus, graphs_allowed)
    if room is None or not graphs_allowed:
        return [first]
    kb = shard_bytes(layer_bytes, gpus)
    most = min(n_layers, room // max(graph_bytes + layer_bytes, 1))
    counts = sorted({first.activations + round(i * (most - first.activations) / max(1, samples - 1))
                     for i in range(samples)}) if most > first.activations else [first.activations]
    out = []
    for a in counts:
        w = min(n_layers, a + (room - a * (graph_bytes + layer_bytes)) // max(kb, 1))
        if w >= a:
            out.append(kept.Residency(int(w), int(a)))
    return out or [first]


def sharded_load_s(share: NodeShare, layer_params: int, c: int, link_bps: float) -> float:
    """One pass's load of a layer kept sharded: the all-gather from HBM (the other domains' shards still cross
    this GPU's PCIe link peer to peer), no host copy."""
    nbytes = layer_params * c
    nv = nbytes * share.nvlink_fraction / (share.nvlink_bps / 2) if share.nvlink_fraction else 0.0
    return max(nbytes * (share.link_fraction - 1 / share.gpus) / link_bps, nv)

