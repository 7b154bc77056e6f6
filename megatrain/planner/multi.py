"""Data parallel over N GPUs per node and M nodes, with one host store per node.

What a node holds (host memory):
  once per node   the decoder layers' state: host master (by mode), bf16 shadow, FP32 gradient slab and
                  Adam m + v (the optimizer is sharded by layer across the node's ranks: rank r updates its
                  layers, and each layer's gradients are reduced into its owner's slab), and the runtime
                  reserve of the profile (OS + the first process);
  per rank (x N)  the resident parameters (embedding, final norm, head) with their own FP32 master, gradient
                  and Adam state, the staging buffers and offloaded activations of its own micro-batch,
                  one layer's optimizer scratch, a further process's runtime (rank_runtime_gib; the first
                  one is in the reserve), and with more than one rank in the job an FP32 gradient transit
                  buffer of 2 x the largest layer (TRANSIT_LAYERS).
  so  host(N, M) = host(one GPU) + (N - 1) x per-rank terms + N x transit   (transit only when N x M > 1),
  the speculative step's rollback copies apart: once per node (each rank its 1/G ranges of a speculated layer on
  the node path, its owner the whole of it on the per-rank path), as many layers as fit what the node has left
  (node_speculation, costs/rollback.py's rule); with nodes sharing one store only as set, each node its own layers'.
Each node holds its own full copy: its GPUs stream every layer over their own host links every step
anyway, and sharding across nodes would add an all-gather of the weights over the network each step.

What a GPU sees (its view of the shared host, `rank_hardware`):
  link    min(link / gpus_per_host_link, (host DRAM bw / N) x h2d / (h2d + d2h)): each GPU's DMA traffic
          both ways has to come out of its share of the host's DRAM bandwidth; the weight stream (h2d, the
          lane that bounds the step) is charged as if that share carried all of it;
  host    DRAM bandwidth / N for the gradient adds and the optimizer (they run on every rank at once);
  CPU     on a CPU "device" (unified memory) the ranks also share the cores: compute rates / N.
The per-GPU step is the one-GPU pipeline replayed with that view (step_time.megatrain_time), with the
optimizer running over the rank's own ceil(L / N) layers plus its resident parameters. Then:
  intra-node reduce  each layer's gradients are added into its owner's slab by the reduce lane of each
                     rank's pipeline, at the rank's share of host bandwidth: overlapped with backward, what is
                     left is in the drain. The resident parameters' gradients are averaged across the node's
                     ranks through host memory after backward: (N - 1) x G x 20 B / host bw (read, add,
                     write back; not overlapped).
  inter-node         the owners of a layer (the same local rank on each node) all-reduce its gradient once per
                     micro-batch (k = grad_accum per step: no rank keeps a layer's local gradients until the
                     step), a ring: 2 (M - 1) / M x 4 B per parameter over the node's network. A layer's
                     all-reduce starts when its micro-batch's backward has produced it, so of each micro-batch's
                     layers' total A only max(N A / L, A - bwd_mb (L - 1) / L) adds to the step, k times (N A / L:
                     the last layer on its owner's NIC, one of N); the resident parameters' all-reduce comes
                     after the step's last backward and adds in full.
Every host mode shares the node's store (data_parallel_host 'auto'): the hilo halves and their tie tables, bf16
masters, bf16 slabs (the owner's); with the optimizer in backward each owner also averages a layer's gradients
into one of two FP32 buffers of the largest layer that its update reads (in the transit term).
  job tokens/s = N M tokens_per_step / step;  scaling efficiency = job tokens/s / (N M x one-GPU tokens/s).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..config.schema import AUTO, rule_or
from ..costs import residency as kept
from ..costs.modes import HostMaster, rollback_bytes_per_param
from ..costs.pinning import pinned_bytes
from ..costs.rollback import layers_that_fit, rollback_budget
from .auto_mode import plan_point
from .hardware import GB, GIB, Hardware, resolve_hardware
from .host_work import host_cores
from .memory import Memory, check_fit
from .node_path import (
    KEPT_SHARDS,
    NODE,
    PER_RANK,
    NodeShare,
    collective_device_bytes,
    node_share,
    path_for,
    shard_bytes,
    sharded_load_s,
)
from .node_path import fill as node_fill
from .node_path import frontier as node_frontier
from .placement import PREFER_ENGINE_WITHIN, Placement
from .point import (
    Point,
    layer_grad_bytes,
    make_point,
    master_bytes,
    placeholder_mode,
    rollback_bytes,
    settled,
    with_point,
)
from .prediction import Plan
from .step_time import IDLE_COMM, Time, megatrain_time
from .zero3_node import zero3_rank

# The per-rank FP32 buffer a layer's gradients travel through on their way to the owner's slab: two of the
# largest layer, so one can be reduced while the next lands.
TRANSIT_LAYERS = 2
# Node-path placements replayed along the frontier from the most shards to the most graphs (node_residency): each
# costs four replays (two placements, two passes for the rank's DMA share) inside the host-mode search.
NODE_FRONTIER_SAMPLES = 5
# Host bytes per parameter to average the resident parameters' gradients across a node's ranks: read a
# rank's FP32 gradient, read + write the sum (12), then copy the mean back (8).
GLOBALS_REDUCE_BYTES = 20
ROLLBACK = "speculative rollback copy"  # planner/memory.py's row
LAYER_STATE_KEYS = ("master weights", "gradients", "adam m", "adam v", "bf16 shadow (streams)")


@dataclass(frozen=True)
class Comm:
    """The gradient reduction of one optimizer step, in seconds per rank."""

    intra_globals_s: float  # the resident parameters' average through host memory (after backward)
    network_layers_s: float  # inter-node all-reduce of the layers' gradients, total (the node's network)
    network_globals_s: float  # inter-node all-reduce of the resident parameters' gradients
    network_exposed_s: float  # what of the layers' all-reduce is not hidden under backward
    network_bytes: int  # bytes each node sends (= receives) per step

    @property
    def added_s(self) -> float:
        return self.intra_globals_s + self.network_exposed_s + self.network_globals_s


@dataclass
class MultiPlan:
    gpus_per_node: int
    nodes: int
    single: Plan  # one GPU with the whole host to itself: the reference of the scaling efficiency
    rank: Plan  # one rank: the node's host memory, its GPU's device memory, its step with the reduction
    comm: Comm
    layer_state: dict[str, int]  # host bytes held once per node (1/store_nodes of them with a shared store)
    per_rank: dict[str, int]  # host bytes each rank holds (x N per node), transit buffer included
    path: str = PER_RANK  # the data path planned: node_path.NODE or PER_RANK
    path_why: str = ""
    store_nodes: int = 1  # nodes sharing one host store (1: each node holds its own)
    auto: Any = None  # host mode "auto" for the node (auto_mode.AutoChoice), None where a mode was given
    single_added_s: float = 0.0  # what the NVMe tier adds to one GPU alone in the same mode (the reference)

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def fits(self) -> bool:
        """The node's verdict: with host mode "auto", the chosen mode's (NVMe tier included)."""
        return self.auto.fits if self.auto is not None else self.rank.feasible

    @property
    def nvme_added_s(self) -> float:
        """What the NVMe tier adds to the step of the chosen mode (0 without it)."""
        return self.auto.nvme.get("added_s", 0.0) if self.auto is not None and self.auto.mode.nvme else 0.0

    @property
    def host_node_bytes(self) -> int:
        return self.rank.memory.host_total

    @property
    def step_s(self) -> float:
        return self.rank.time.step_s + self.nvme_added_s

    @property
    def job_tokens_per_step(self) -> int:
        return self.world_size * self.rank.point.tokens_per_step

    @property
    def job_tokens_per_s(self) -> float:
        return self.job_tokens_per_step / self.step_s

    @property
    def single_step_s(self) -> float:
        """One GPU alone with the whole host, in the same mode (its NVMe time included where the mode spills)."""
        return self.single.time.step_s + self.single_added_s

    @property
    def scaling_efficiency(self) -> float:
        return self.job_tokens_per_s / (self.world_size * self.single.point.tokens_per_step / self.single_step_s)

    def _node_residency(self) -> dict[str, int]:
        """The node path's placement (node_residency): layers kept sharded, and kept whole with their graphs."""
        lc = self.rank.long_context
        if self.path != NODE or lc is None:
            return {}
        return {"kept_sharded_layers": lc.residency.weights - lc.residency.activations,
                "kept_whole_layers": lc.residency.activations}

    def summary(self) -> dict[str, Any]:
        """The data-parallel figures as flat columns (predicted rows, JSON)."""
        return {"gpus_per_node": self.gpus_per_node, "nodes": self.nodes, "world_size": self.world_size,
                "host_node_bytes": self.host_node_bytes, "host_layer_state_bytes": sum(self.layer_state.values()),
                "host_per_rank_bytes": sum(self.per_rank.values()),
                "device_bytes_per_gpu": self.rank.memory.device_total, "fits": self.fits,
                "data_path": self.path, "data_path_why": self.path_why, "store_nodes": self.store_nodes,
                "rank_step_s": self.step_s, "job_tokens_per_s": self.job_tokens_per_s,
                "single_gpu_tokens_per_s": self.single.tokens_per_s,
                "scaling_efficiency": self.scaling_efficiency,
                "rank_link_gbs": self.rank.hardware.link_gbs_achieved,
                "rank_h2d_bytes_per_step": self.rank.time.h2d_bytes, **self._node_residency(),
                "rank_host_bw_gbs": self.rank.hardware.host_memory_bw_gbs_achieved,
                **{k: v for k, v in dataclasses.asdict(self.comm).items()}}


def check_topology(hw: Hardware, gpus_per_node: int, nodes: int, backend: str = "megatrain") -> None:
    """Refuse a node shape the profile cannot have, naming the value and the fix."""
    for name, flag, v in (("gpus_per_node", "--gpus-per-node", gpus_per_node), ("nodes", "--nodes", nodes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} {v!r} ({name}): must be a whole number >= 1 (1 = a single "
                             f"{'GPU' if name == 'gpus_per_node' else 'node'})")
    if gpus_per_node > hw.gpus_per_node:
        raise ValueError(f"--gpus-per-node {gpus_per_node}: profile {hw.name!r} has {hw.gpus_per_node} GPU(s) per "
                         f"node (its gpus_per_node); use at most {hw.gpus_per_node}, or load a profile with more "
                         "(--hardware-file, gpus_per_node)")
    if nodes > 1 and not hw.network_gbs:
        raise ValueError(f"--nodes {nodes}: profile {hw.name!r} has no network between nodes (network_gbs); "
                         "pass --network-gbs GB/s per node per direction")
    if gpus_per_node * nodes > 1 and backend not in ("megatrain", "zero3"):
        raise ValueError(f"--gpus-per-node/--nodes plan megatrain's data parallel and ZeRO-3 offload, not {backend!r}")


def node_hardware(hw: Hardware, network_gbs: float | None = None, gpus_per_host_link: int | None = None) -> Hardware:
    """The profile with the user's node overrides (each refused when not positive)."""
    changes: dict[str, Any] = {}
    if network_gbs is not None:
        if not network_gbs > 0:
            raise ValueError(f"--network-gbs {network_gbs!r}: must be > 0 (GB/s per node per direction)")
        changes["network_gbs"] = float(network_gbs)
    if gpus_per_host_link is not None:
        if isinstance(gpus_per_host_link, bool) or not isinstance(gpus_per_host_link, int) or gpus_per_host_link < 1:
            raise ValueError(f"--gpus-per-host-link {gpus_per_host_link!r}: must be a whole number >= 1")
        changes["gpus_per_host_link"] = gpus_per_host_link
    return hw.with_(**changes) if changes else hw


def node_profile(hw: Hardware, gpus_per_node: int) -> Hardware:
    """The node's host as one: a profile whose every GPU has its own host (host_per_gpu, Grace Hopper) has
    gpus_per_node of them (memory, bandwidth, cores and reserve); otherwise the profile itself."""
    if not hw.host_per_gpu or gpus_per_node == 1:
        return hw
    n = gpus_per_node
    changes: dict[str, Any] = {"host_memory_gib": hw.host_memory_gib * n,
                               "host_memory_bw_gbs_achieved": hw.host_memory_bw_gbs_achieved * n,
                               "host_reserved_gib": hw.host_reserved_gib * n, "host_cores": host_cores(hw) * n}
    if hw.host_optimizer_gbs:
        changes["host_optimizer_gbs"] = hw.host_optimizer_gbs * n
    if hw.cpu_adam_params_per_s:
        changes["cpu_adam_params_per_s"] = hw.cpu_adam_params_per_s * n
    return dataclasses.replace(hw.with_(**changes), name=f"{hw.name}, {n} per node")


def rank_hardware(hw: Hardware, gpus_per_node: int, h2d_share: float) -> Hardware:
    """One GPU's view of a host it shares with gpus_per_node - 1 others (see the module's docstring);
    `h2d_share`: h2d / (h2d + d2h) of the GPU's link bytes per step. One GPU: the profile itself."""
    n = gpus_per_node
    if n == 1:
        return hw
    link = min(hw.link_gbs_achieved / min(hw.gpus_per_host_link, n), hw.host_memory_bw_gbs_achieved / n * h2d_share)
    changes: dict[str, Any] = {"link_gbs_achieved": link,
                               "host_memory_bw_gbs_achieved": hw.host_memory_bw_gbs_achieved / n}
    if hw.host_optimizer_gbs:
        changes["host_optimizer_gbs"] = hw.host_optimizer_gbs / n
    if hw.unified_memory:  # the "devices" are the host's own cores
        changes.update(peak_bf16_tflops=hw.peak_bf16_tflops / n, peak_fp32_tflops=hw.peak_fp32_tflops / n,
                       device_memory_bw_gbs=hw.device_memory_bw_gbs / n)
    return dataclasses.replace(hw.with_(**changes), name=f"{hw.name}, 1 of {n} GPUs per node")


def split_host(pl: Plan) -> tuple[dict[str, int], dict[str, int]]:
    """(held once per node, held by every rank) of a one-GPU plan's host bytes. The first rank's runtime
    stays in the node part (the profile's reserve covers the OS and one process)."""
    p, m = pl.point, pl.point.model
    # the host-updated layers' state (memory.py): a layer whose optimizer is on the device holds none here (one
    # GPU alone; several ranks keep every layer's optimizer on the host)
    K = pl.long_context.residency.optimizer if pl.long_context is not None else 0
    LP = (m.num_layers - K) * m.layer_params()
    mb, shadow = master_bytes(p)
    layer = {"master weights": LP * mb, "gradients": LP * layer_grad_bytes(p), "adam m": LP * 4, "adam v": LP * 4,
             "bf16 shadow (streams)": LP * shadow, "runtime": pl.memory.host["runtime"]}
    rank = {k: v - layer.get(k, 0) for k, v in pl.memory.host.items() if k != "runtime"}
    return layer, rank


def shares_host_store(p: Point) -> bool:
    """Whether the engine gives this point one host store per node (EngineConfig.share_host_store with
    data_parallel_host 'auto'): every host mode."""
    return True


def transit_bytes(p: Point) -> int:
    """A rank's FP32 gradient transit: its staging slots, and with the optimizer in backward the two averaged
    layers its updates read (engine/parallel/ranks.py SharedStore.sink)."""
    return TRANSIT_LAYERS * p.model.layer_params() * 4 * (2 if p.optimizer_in_backward else 1)


def node_speculation(pl: Plan, gpus_per_node: int, nodes: int = 1, path: str = PER_RANK, store_nodes: int = 1) -> int:
    """How many decoder layers the node's ranks speculate (engine/update/speculative.py, "Several ranks"): as set,
    or for "auto" (settled as one process settles it) the first host-updated layers in forward order whose rollback
    copies fit what the node's host has left beside everything else it holds (node_memory without them), by
    costs/rollback.py's rule (rollback_budget, layers_that_fit), as resolve sizes them. The node holds one copy of
    each (its ranks' ranges of it on the node path, its owner's on the per-rank path), a replicated store one per
    rank. Nodes sharing one store speculate as set only ("auto" stays off there: the copies are the host memory the
    share was cut to save), each node its own block of layers, each layer's copy held once by its owner rank."""
    p, lc = pl.point, pl.long_context
    K = lc.residency.optimizer if lc is not None else 0
    host = p.model.num_layers - K
    if p.backend != "megatrain" or p.optimizer_in_backward or host <= 0:
        return 0
    if store_nodes > 1 and nodes > 1:
        return math.ceil(host / store_nodes) if p.engine.speculation_set else 0
    if p.engine.speculation_set is not None:
        return host if p.engine.speculation_set else 0
    hw = node_profile(pl.hardware, gpus_per_node)
    if settled(p, hw).speculative_step is False:
        return 0
    mem = node_memory(pl, gpus_per_node, nodes, path, store_nodes, None, 0)[0]
    held = mem.host_total_incl_device if mem.unified else mem.host_total
    copies = 1 if shares_host_store(p) else gpus_per_node
    per_param = rollback_bytes_per_param(HostMaster(p.host_master), p.c == 2)
    return layers_that_fit(p.model.layer_sizes()[K:], copies * per_param, rollback_budget(hw.host_bytes - held))


def node_memory(pl: Plan, gpus_per_node: int, nodes: int = 1, path: str = PER_RANK,
                store_nodes: int = 1, residency: kept.Residency | None = None,
                speculated: int | None = None) -> tuple[Memory, dict[str, int], dict[str, int]]:
    """(the node's Memory, its once-per-node bytes, one rank's bytes) for a one-GPU plan `pl`. The device
    side stays one GPU's (plus the node path's collective buffers); on a CPU "device" the other ranks' device
    allocations come out of host memory. `store_nodes`: nodes sharing one store, each holding the layer state of
    its ceil(L / store_nodes) layers. `residency` (node path): the node's placement (node_residency), whose sharded
    layers hold 1/G of their bytes on each GPU and keep the ring. `speculated`: the layers the node's ranks
    speculate (None: node_speculation's count), their rollback copies held once per node (once per rank with a
    replicated store)."""
    n, hw, mem = gpus_per_node, pl.hardware, pl.memory
    layer, rank = split_host(pl)
    shared = shares_host_store(pl.point)
    copies = 1 if shared else n  # a replicated store: every rank holds the layers' state too
    rank.pop(ROLLBACK, None)  # one GPU's count, against one GPU's host: the node's is its own (node_speculation)
    L = pl.point.model.num_layers
    part = math.ceil(L / store_nodes) / L
    layer = {k: (v if k == "runtime" else int(v * part)) for k, v in layer.items()}
    rank["rank runtime"] = int(hw.rank_runtime_gib * GIB)
    node_path = path == NODE or store_nodes > 1
    rank["grad transit (data parallel)"] = (transit_bytes(pl.point) if n * nodes > 1 and shared and not node_path
                                            else 0)
    if node_path and rank.get("pinned grad staging"):
        # the rank's FP32 shard, 1/G of a layer, lands in its staging (docs/DISTRIBUTED.md, section 2)
        rank["pinned grad staging"] = int(rank["pinned grad staging"] * 4 / pl.point.c / n)
    if path == NODE and rank.get("fp32 scratch (one layer)"):
        rank["fp32 scratch (one layer)"] //= n  # a rank unpacks and updates its 1/G shard of a layer (section 3)
    host = {k: copies * layer.get(k, 0) + n * rank.get(k, 0) for k in pl.memory.host}
    host["runtime"] = layer["runtime"] + (n - 1) * rank["rank runtime"]
    host["grad transit (data parallel)"] = n * rank["grad transit (data parallel)"]
    if speculated is None:
        speculated = node_speculation(pl, n, nodes, path, store_nodes) if n * nodes > 1 else None
    if speculated is None:  # one GPU: its own plan's copies
        host[ROLLBACK] = mem.host.get(ROLLBACK, 0)
    else:
        K = pl.long_context.residency.optimizer if pl.long_context is not None else 0
        host[ROLLBACK] = copies * rollback_bytes(pl.point, speculated, K)
    if mem.unified and n > 1:
        host["other ranks' device (CPU device)"] = (n - 1) * (mem.device_total - mem.shared)
    # the streamed layers' pinned copies are the node's; every rank pins its own staging (and its resident
    # masters where the upload copies from them: FP32 compute)
    layer_pinned = 0
    if mem.pinned:
        m = pl.point.model
        layer_pinned = int(pinned_bytes(m.layer_sizes(), 0, pl.point.c, False, 0)["streamed layers"] * part)
    pinned = copies * layer_pinned + n * (mem.pinned - layer_pinned)
    device = dict(mem.device)
    if path == NODE:
        device["node path: reduce-scatter buffers"] = collective_device_bytes(pl.point, n)
        if residency is not None:
            lc, p = pl.long_context, pl.point
            device["layer buffers"] = p.num_buffers * lc.layer_bytes  # the sharded layers load through it
            device["kept layers' weights (residency)"] = residency.activations * lc.layer_bytes
            device[KEPT_SHARDS] = (residency.weights - residency.activations) * shard_bytes(
                lc.layer_bytes, n)
            device["kept layers' forward graphs (residency)"] = residency.device_graphs * lc.graph_bytes
        pinned += layer.get("gradients", 0)  # the first micro-batch's shard lands in the slab by DMA: pinned
    return (Memory(host, device, mem.unified, mem.shared, pinned), layer,
            {k: v for k, v in rank.items() if v})


def comm_time(p: Point, hw: Hardware, rank_time: Time, gpus_per_node: int, nodes: int,
              path: str = PER_RANK, store_nodes: int = 1) -> Comm:
    """The gradient reduction a rank's step adds (the module's docstring); `hw`: the node's profile."""
    m, n, M = p.model, gpus_per_node, nodes
    L, PL = m.num_layers, m.layer_params()
    G = m.param_count() - L * PL
    if path == NODE:
        # the resident parameters' FP32 gradients: one all-reduce over NVLink (across domains over PCIe)
        rate = hw.nvlink_gbs * GB if min(hw.nvlink_gpus, n) >= n else min(hw.nvlink_gbs * GB, hw.link_bps)
        intra = 2 * (n - 1) / n * 4 * G / rate
    else:
        intra = (n - 1) * G * GLOBALS_REDUCE_BYTES / hw.host_bw_bps
    if M == 1:
        return Comm(intra, 0.0, 0.0, 0.0, 0)
    ring = 2 * (M - 1) / M * 4  # bytes per parameter each node sends
    net = hw.network_gbs * GB
    k = max(1, p.grad_accum)
    globals_s = ring * G / net
    if store_nodes > 1:
        # nodes sharing one store: the weights' broadcast from the owner and the shards' reduce to it are lanes
        # of the pipeline (node_path.py): counted in the step already, listed here
        foreign = (M - 1) / M
        moved = foreign * L * PL * (2 * p.c * k + 4 * k)  # two loads (forward, recompute) and one reduce per mb
        return Comm(intra, moved / net, globals_s, 0.0, int(moved + ring * G))
    # The engine reduces every micro-batch's layer gradients as they leave its backward (no local slab to hold
    # them until the step): k = grad_accum all-reduces per step, each hidden under its own micro-batch's backward.
    layers_s = ring * L * PL / net
    bwd = rank_time.backward_s / k  # one micro-batch's backward
    # per-rank path: the last layer's all-reduce on its owner's NIC (one of N); node path: on every NIC
    last = layers_s / L * (1 if path == NODE else n)
    exposed = k * max(last, layers_s - bwd * (L - 1) / L)
    return Comm(intra, k * layers_s, globals_s, exposed, int(ring * (k * L * PL + G)))


def _rank_time(p: Point, hw: Hardware, single: Plan, n: int, nodes: int, path: str, store_nodes: int,
               residency: kept.Residency | None = None, speculated: int = 0) -> tuple[Hardware, Time]:
    """One rank's view of the node and its pipeline's step, on the data path planned; `residency` (node path): the
    placement as the node keeps it (node_path.py: the graph layers whole, the other kept layers sharded), else the
    one-GPU plan's; `speculated`: the node's speculated layers (node_speculation), each rank its part of them."""
    st = single.time
    lc = single.long_context
    if path != NODE and store_nodes == 1:
        rhw = rank_hardware(hw, n, st.h2d_bytes / max(1, st.h2d_bytes + st.d2h_bytes))
        # the rank with the most layers sets the pace; a replicated store updates every layer on every rank
        owned = math.ceil(p.model.num_layers / n) if shares_host_store(p) else p.model.num_layers
        # each layer's reduction by the rank's own reducer threads, as one GPU's (host_work.py), at its view of the host
        return rhw, megatrain_time(p, rhw, lc.offload, owned_layers=owned, residency=lc.residency,
                                   speculated=speculated, owner_stride=n if shares_host_store(p) else 1)
    share = node_share(hw, n, nodes, store_nodes > 1) if path == NODE else NodeShare(
        n, 1, 0.0, (hw.network_gbs or 0.0) * GB / n, (nodes - 1) / nodes)
    r = lc.residency if residency is None or path != NODE else residency
    h2d = 0.5  # its DMA's split between the two directions, from the node path's own bytes (two passes)
    for _ in range(2):
        rhw = rank_hardware(hw, n, h2d)
        if n > 1:
            rhw = rhw.with_(host_cores=max(1, host_cores(hw) // n))  # its team: cores / G (DISTRIBUTED.md, 3)

        def replay(res: kept.Residency, rhw: Hardware = rhw) -> Time:
            # 1/G of every layer the node owns: all of them, or 1/store_nodes of them with a store shared by the
            # nodes (the other nodes update theirs at the same time)
            return megatrain_time(p, rhw, lc.offload, owned_layers=p.model.num_layers / n / store_nodes,
                                  residency=res, node=share, speculated=speculated)
        t = replay(r)
        if residency is not None and path == NODE and r.weights > r.activations:
            t = _sharded_time(p, rhw, share, t, replay(kept.Residency(r.activations, r.activations)))
        # rank_hardware charges its lanes at the busier direction's share of the DRAM bandwidth: the FP32 gradient
        # shards (4 B/param) outweigh the weights' (2 B/param, fewer still kept sharded), and that lane then carries
        # all of the DMA's bytes; the share of the lighter one would slow the heavier as the weights' bytes fall
        h2d = max(t.h2d_bytes, t.d2h_bytes) / max(1, t.h2d_bytes + t.d2h_bytes)
    return rhw, t


def _sharded_time(p: Point, rhw: Hardware, share: NodeShare, held: Time, streamed: Time) -> Time:
    """The step with the sharded layers kept sharded, from two replays: `held` keeps them as the one-GPU pipeline
    keeps a layer (one load per step: the refresh of this GPU's shard and its gather, the host bytes exact), and
    `streamed` streams them (every pass's gather: the NVLink bytes exact). A sharded layer's pass loads by its
    gather alone (node_path.sharded_load_s), a part of a streamed load's time: of what streaming them adds to
    the step, that part is charged: never slower than streaming them."""
    PL, c, Bl = p.model.layer_params(), p.c, rhw.link_bps
    load = share.weights_s(PL, c, Bl)
    part = sharded_load_s(share, PL, c, Bl) / load if load else 0.0
    # the passes whose loads the held replay does not make; across NVLink domains their gathers still cross the link
    extra = round((streamed.h2d_bytes - held.h2d_bytes) / (PL * c * share.link_fraction))
    h2d = held.h2d_bytes + int(extra * PL * c * (share.link_fraction - 1 / share.gpus))
    step = streamed.step_s - (1 - part) * max(0.0, streamed.step_s - held.step_s)
    busy = {**held.busy_s, "NVLink": streamed.busy_s.get("NVLink", 0.0), "link h2d": h2d / Bl}
    idle = {**held.idle_s, "other": max(0.0, held.idle_s.get("other", 0.0) + step - held.step_s)}
    return dataclasses.replace(held, step_s=step, busy_s=busy, h2d_bytes=h2d, idle_s=idle)


def node_residency(p: Point, hw: Hardware, single: Plan, n: int, nodes: int, store_nodes: int,
                   speculated: int = 0) -> tuple[kept.Residency, tuple[Hardware, Time], Placement | None]:
    """The node path's placement (docs/DISTRIBUTED.md, section 4), its rank's time and the search (None for counts
    as set): counts
    as set, kept as the engine keeps them on the node; "auto" fills the room the batch leaves (less the node
    path's own buffers) by the replayed gain along node_path.frontier, the engine's fill (shards first) kept
    unless another beats it by more than placement.PREFER_ENGINE_WITHIN, never slower than streaming every layer."""
    lc = single.long_context
    if p.engine.residency_set is not None:
        r = lc.residency
        return r, _rank_time(p, hw, single, n, nodes, NODE, store_nodes, r, speculated), None
    room = None if lc.residency_room is None else max(0, lc.residency_room - collective_device_bytes(p, n))
    S, L = lc.layer_bytes, lc.n_layers
    engine = node_fill(L, S, lc.graph_bytes, room, n, lc.graphs_allowed)
    candidates = [engine, *node_frontier(L, S, lc.graph_bytes, room, n, lc.graphs_allowed, NODE_FRONTIER_SAMPLES),
                  kept.Residency()]
    timed = {r: _rank_time(p, hw, single, n, nodes, NODE, store_nodes, r, speculated)
             for r in dict.fromkeys(candidates)}
    best = min(timed, key=lambda r: timed[r][1].step_s)
    if timed[engine][1].step_s <= min(timed[best][1].step_s / (1 - PREFER_ENGINE_WITHIN), timed[kept.Residency()][1].step_s):
        best = engine
    replayed = {r: (t.step_s, t.h2d_bytes, t.recomputed_layers) for r, (_, t) in timed.items()}
    return best, timed[best], Placement(best, engine, replayed)


def plan_point_multi(p: Point, hw: Hardware, gpus_per_node: int = 1, nodes: int = 1,
                     store_nodes: int = 1, data_path: str = AUTO) -> MultiPlan:
    """A point on N GPUs per node x M nodes, on the data path the profile allows (node_path.path_for; `data_path`
    "per-rank" plans today's engine where the node path could run): a megatrain point with one host store per node
    (or shared by `store_nodes` = M nodes), a zero3 point as DeepSpeed runs it (zero3_node.py)."""
    check_topology(hw, gpus_per_node, nodes, p.backend)
    if rule_or(data_path, lambda: NODE) not in (NODE, PER_RANK):
        raise ValueError(f"data path {data_path!r}: use auto, {NODE} or {PER_RANK}")
    if store_nodes not in (1, nodes):
        raise ValueError(f"store_nodes={store_nodes}: 1 (each node its own store) or the job's {nodes} nodes")
    if p.backend == "megatrain" and p.engine.chooses_host_mode and store_nodes == 1:
        return plan_auto_multi(p, hw, gpus_per_node, nodes, data_path)  # chosen for the node
    single_hw, hw = hw, node_profile(hw, gpus_per_node)
    if p.backend == "zero3":
        return _zero3_multi(placeholder_mode(p), single_hw, hw, gpus_per_node, nodes)
    if gpus_per_node * nodes > 1:
        p = dataclasses.replace(p, data_parallel=True)  # no optimizer residency (engine/update/resident.py)
    single = plan_point(p, single_hw)
    n = gpus_per_node
    path, why = path_for(hw, n)
    if data_path == NODE and path != NODE:
        raise ValueError(f"--data-path node: {why}; plan this node with --data-path per-rank (or auto, which "
                         "falls back to the per-rank path here)")
    if data_path == PER_RANK and path == NODE:
        path, why = PER_RANK, "as asked (--data-path per-rank): every rank streams every layer, today's engine"
    if n * nodes == 1:
        layer, rank = split_host(single)
        return MultiPlan(1, 1, single, single, Comm(0.0, 0.0, 0.0, 0.0, 0), layer, {k: v for k, v in rank.items() if v},
                         PER_RANK, "one GPU")
    if store_nodes > 1 and path != NODE and n > 1:
        raise ValueError(f"nodes sharing one store need the node path ({why})")
    placed = search = None
    spec = node_speculation(single, n, nodes, path, store_nodes)
    if path == NODE and single.long_context is not None:
        placed, (rhw, t), search = node_residency(p, hw, single, n, nodes, store_nodes, spec)
    else:
        rhw, t = _rank_time(p, hw, single, n, nodes, path, store_nodes, speculated=spec)
    comm = comm_time(p, hw, t, n, nodes, path, store_nodes)  # every rank takes part at once: the whole host's bandwidth
    reduce_key = "NVLink all-reduce (globals)" if path == NODE else "host reduce (globals)"
    busy = {**t.busy_s, reduce_key: comm.intra_globals_s, "network": comm.network_layers_s + comm.network_globals_s}
    lanes = [busy["compute"], busy["link h2d"], busy["link d2h"], busy.get("NVLink", 0.0)]
    bottleneck = "network" if busy["network"] > max(lanes) else t.bottleneck
    idle = {**t.idle_s, IDLE_COMM: comm.added_s}
    t = dataclasses.replace(t, step_s=t.step_s + comm.added_s, busy_s=busy, bottleneck=bottleneck, idle_s=idle)
    mem, layer, rank = node_memory(single, n, nodes, path, store_nodes, placed, spec)
    ok, reasons = check_fit(mem, hw)
    where = f"per node, {n} GPUs" + (f", 1/{store_nodes} of the layers' state" if store_nodes > 1 else "")
    reasons = [r.replace("host:", f"host ({where}):", 1) for r in reasons]
    lc = single.long_context if placed is None else dataclasses.replace(single.long_context, residency=placed)
    decisions = dict(single.decisions)
    if placed is not None and "residency" in decisions:
        decisions["residency"] = placed.to_dict()
    rank_plan = Plan(p, rhw, mem, t, ok, reasons, decisions, list(single.warnings), lc,
                     list(single.refused), placement=search)
    if store_nodes > 1:
        why = f"{why}; {store_nodes} nodes share one store (each owns 1/{store_nodes} of the layers)"
    return MultiPlan(n, nodes, single, rank_plan, comm, layer, rank, path, why, store_nodes)


def _zero3_multi(p: Point, single_hw: Hardware, hw: Hardware, gpus: int, nodes: int) -> MultiPlan:
    """ZeRO-3 offload on the node (zero3_node.py's model)."""
    single = plan_point(p, single_hw)
    if gpus * nodes == 1:
        return MultiPlan(1, 1, single, single, Comm(0.0, 0.0, 0.0, 0.0, 0), {}, {}, "zero3", "one GPU")
    st = single.time
    rhw = rank_hardware(hw, gpus, st.h2d_bytes / max(1, st.h2d_bytes + st.d2h_bytes))
    rank, how = zero3_rank(p, single, hw, rhw, gpus, nodes)
    return MultiPlan(gpus, nodes, single, rank, Comm(0.0, 0.0, 0.0, 0.0, 0), {}, {}, "zero3", how)


def plan_auto_multi(p: Point, hw: Hardware, gpus_per_node: int, nodes: int, data_path: str = AUTO) -> MultiPlan:
    """Host mode "auto" for the node (the engine's settle function over the node's plan, auto_mode.settle_mode): the
    first mode that fits with one store per node; with several nodes then one store shared by them (no disk); then
    the NVMe tier."""
    from .auto_mode import AutoChoice, _knobs, settle_mode
    from .nvme_plan import nvme_fit
    from .point_plan import mode_point

    seen: dict[Any, tuple[MultiPlan, bool, dict[str, Any]]] = {}

    def attempt(mode: Any, store_nodes: int) -> bool:
        q = mode_point(p, _knobs(mode, p)) if not p.optimizer_in_backward else with_point(p, **_knobs(mode, p))
        mp = plan_point_multi(q, hw, gpus_per_node, nodes, store_nodes, data_path)
        ok, figures = nvme_fit(mp.rank, node_profile(hw, gpus_per_node)) if mode.nvme else (mp.rank.feasible, {})
        seen[mode] = (mp, ok, figures)
        return ok

    nvme = hw.nvme_gbs is not None
    check_topology(hw, gpus_per_node, nodes, p.backend)  # a bad shape is the user's error, named, not a misfit
    path = rule_or(data_path, lambda: path_for(node_profile(hw, gpus_per_node), gpus_per_node)[0])
    shareable = gpus_per_node == 1 or path == NODE  # nodes share one store on the node path (or one GPU each)
    shareable = shareable and not p.engine.speculation_set  # ... which refuses speculative_step=True
    order = [1] if nodes == 1 or not shareable else [1, nodes]
    for store_nodes in order:
        seen.clear()
        mode, ok = settle_mode(p, lambda m, k=store_nodes: (not m.nvme) and attempt(m, k), False)
        if ok:
            mp = seen[mode][0]
            mp.auto = AutoChoice(mode, True, {})
            return mp
    # then the NVMe tier, one store per node first; where nothing fits, the plan of the least host memory (the
    # store shared by every node) says by how much
    for store_nodes in order:
        seen.clear()
        mode, ok = settle_mode(p, lambda m, k=store_nodes: attempt(m, k), nvme)
        if ok:
            break
    if mode not in seen:
        attempt(mode, order[-1])
    mp, _, figures = seen[mode]
    mp.auto = AutoChoice(mode, ok, figures)
    if mode.nvme:
        alone_ok, alone = nvme_fit(mp.single, hw)
        mp.single_added_s = alone["added_s"] if alone_ok else 0.0
    return mp


def smallest_store_nodes(p: Point, hw: Hardware, gpus_per_node: int, most: int = 64,
                         data_path: str = AUTO) -> MultiPlan | None:
    """The plan on the fewest nodes (2..most) that hold the model in host memory, sharing one store, without
    the NVMe tier (host mode "auto" over the modes that keep everything in memory); None when none up to `most`
    does, or the profile has no network. Starts at the count the layers' state alone needs."""
    from ..costs.host_mode import candidates
    from .auto_mode import AutoChoice, _knobs
    from .point_plan import mode_point

    if not hw.network_gbs:
        return None
    node_hw = node_profile(hw, gpus_per_node)
    starts = {}
    for mode in candidates(p.c == 2, p.grad_accum == 1, False, p.optimizer_in_backward):
        q = mode_point(p, _knobs(mode, p)) if not p.optimizer_in_backward else with_point(p, **_knobs(mode, p))
        try:
            base = plan_point_multi(q, hw, gpus_per_node, 2, 2, data_path)
        except ValueError:
            return None
        state = sum(v for k, v in base.layer_state.items() if k != "runtime") * 2  # the whole store (2 nodes, half each)
        room = node_hw.host_bytes - (base.host_node_bytes - state / 2)
        if room > 0:
            starts[mode] = (max(2, math.ceil(state / room)), q)
    if not starts:
        return None
    # the fewest nodes first, the fastest mode first at each count (candidates' order)
    for nodes in range(min(n for n, _ in starts.values()), most + 1):
        for mode, (start, q) in starts.items():
            if nodes < start:
                continue
            mp = plan_point_multi(q, hw, gpus_per_node, nodes, nodes, data_path)
            if mp.rank.feasible:
                mp.auto = AutoChoice(mode, True, {})
                return mp
        if nodes > max(n for n, _ in starts.values()) + 2:
            break  # more nodes shrink only the layers' state: past the estimates, the rest of the host is what is over
    return None


def plan_multi(model: Any, context: int, batch: int = 1, grad_accum: int = 1, dtype: str = "bfloat16",
               hardware: str | Hardware | dict = "h200-pcie", *, gpus_per_node: int = 1, nodes: int = 1,
               network_gbs: float | None = None, gpus_per_host_link: int | None = None,
               link_gbs: float | None = None, host_memory_gib: float | None = None,
               device_memory_gib: float | None = None, data_path: str = AUTO, **knobs: Any) -> MultiPlan:
    """plan() for a data-parallel job: N GPUs per node (sharing the node's host), M nodes."""
    p = make_point(model, context, batch, grad_accum, dtype, "megatrain", **knobs)
    hw = node_hardware(resolve_hardware(hardware, link_gbs, host_memory_gib, device_memory_gib), network_gbs,
                       gpus_per_host_link)
    return plan_point_multi(p, hw, gpus_per_node, nodes, data_path=data_path)

