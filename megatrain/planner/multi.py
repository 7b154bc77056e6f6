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
  so  host(N, M) = host(one GPU) + (N - 1) x per-rank terms + N x transit   (transit only when N x M > 1).
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

from ..config.schema import left_auto
from ..costs.pinning import pinned_bytes
from .hardware import GB, GIB, Hardware, resolve_hardware
from .memory import Memory, check_fit
from .point import Point, layer_grad_bytes, make_point, master_bytes
from .point_plan import plan_point
from .prediction import Plan
from .step_time import IDLE_COMM, Time, megatrain_time

# The per-rank FP32 buffer a layer's gradients travel through on their way to the owner's slab: two of the
# largest layer, so one can be reduced while the next lands.
TRANSIT_LAYERS = 2
# Host bytes per parameter to average the resident parameters' gradients across a node's ranks: read a
# rank's FP32 gradient, read + write the sum (12), then copy the mean back (8).
GLOBALS_REDUCE_BYTES = 20
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
    layer_state: dict[str, int]  # host bytes held once per node
    per_rank: dict[str, int]  # host bytes each rank holds (x N per node), transit buffer included

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def fits(self) -> bool:
        return self.rank.fits

    @property
    def host_node_bytes(self) -> int:
        return self.rank.memory.host_total

    @property
    def step_s(self) -> float:
        return self.rank.time.step_s

    @property
    def job_tokens_per_step(self) -> int:
        return self.world_size * self.rank.point.tokens_per_step

    @property
    def job_tokens_per_s(self) -> float:
        return self.job_tokens_per_step / self.step_s

    @property
    def scaling_efficiency(self) -> float:
        return self.job_tokens_per_s / (self.world_size * self.single.tokens_per_s)

    def summary(self) -> dict[str, Any]:
        """The data-parallel figures as flat columns (predicted rows, JSON)."""
        return {"gpus_per_node": self.gpus_per_node, "nodes": self.nodes, "world_size": self.world_size,
                "host_node_bytes": self.host_node_bytes, "host_layer_state_bytes": sum(self.layer_state.values()),
                "host_per_rank_bytes": sum(self.per_rank.values()),
                "device_bytes_per_gpu": self.rank.memory.device_total, "fits": self.rank.feasible,
                "rank_step_s": self.step_s, "job_tokens_per_s": self.job_tokens_per_s,
                "single_gpu_tokens_per_s": self.single.tokens_per_s,
                "scaling_efficiency": self.scaling_efficiency,
                "rank_link_gbs": self.rank.hardware.link_gbs_achieved,
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
    if gpus_per_node * nodes > 1 and backend != "megatrain":
        raise ValueError(f"--gpus-per-node/--nodes plan the megatrain backend's data parallel only, not {backend!r}")


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
    LP = m.num_layers * m.layer_params()
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


def node_memory(pl: Plan, gpus_per_node: int, nodes: int = 1) -> tuple[Memory, dict[str, int], dict[str, int]]:
    """(the node's Memory, its once-per-node bytes, one rank's bytes) for a one-GPU plan `pl`. The device
    side stays one GPU's; on a CPU "device" the other ranks' device allocations come out of host memory."""
    n, hw, mem = gpus_per_node, pl.hardware, pl.memory
    layer, rank = split_host(pl)
    shared = shares_host_store(pl.point)
    copies = 1 if shared else n  # a replicated store: every rank holds the layers' state too
    rank["rank runtime"] = int(hw.rank_runtime_gib * GIB)
    rank["grad transit (data parallel)"] = transit_bytes(pl.point) if n * nodes > 1 and shared else 0
    host = {k: copies * layer.get(k, 0) + n * rank.get(k, 0) for k in pl.memory.host}
    host["runtime"] = layer["runtime"] + (n - 1) * rank["rank runtime"]
    host["grad transit (data parallel)"] = n * rank["grad transit (data parallel)"]
    if mem.unified and n > 1:
        host["other ranks' device (CPU device)"] = (n - 1) * (mem.device_total - mem.shared)
    # the streamed layers' pinned copies are the node's; every rank pins its own staging (and its resident
    # masters where the upload copies from them: FP32 compute)
    layer_pinned = 0
    if mem.pinned:
        m = pl.point.model
        layer_pinned = pinned_bytes(m.layer_sizes(), 0, pl.point.c, False, 0)[
            "streamed layers"]
    pinned = copies * layer_pinned + n * (mem.pinned - layer_pinned)
    return (Memory(host, dict(mem.device), mem.unified, mem.shared, pinned), layer,
            {k: v for k, v in rank.items() if v})


def comm_time(p: Point, hw: Hardware, rank_time: Time, gpus_per_node: int, nodes: int) -> Comm:
    """The gradient reduction a rank's step adds (the module's docstring); `hw`: the node's profile."""
    m, n, M = p.model, gpus_per_node, nodes
    L, PL = m.num_layers, m.layer_params()
    G = m.param_count() - L * PL
    intra = (n - 1) * G * GLOBALS_REDUCE_BYTES / hw.host_bw_bps
    if M == 1:
        return Comm(intra, 0.0, 0.0, 0.0, 0)
    ring = 2 * (M - 1) / M * 4  # bytes per parameter each node sends
    net = hw.network_gbs * GB
    # The engine reduces every micro-batch's layer gradients as they leave its backward (no local slab to hold
    # them until the step): k = grad_accum all-reduces per step, each hidden under its own micro-batch's backward.
    k = max(1, p.grad_accum)
    layers_s, globals_s = ring * L * PL / net, ring * G / net
    bwd = rank_time.backward_s / k  # one micro-batch's backward
    exposed = k * max(n * layers_s / L, layers_s - bwd * (L - 1) / L)
    return Comm(intra, k * layers_s, globals_s, exposed, int(ring * (k * L * PL + G)))


def plan_point_multi(p: Point, hw: Hardware, gpus_per_node: int = 1, nodes: int = 1) -> MultiPlan:
    """A megatrain point on N GPUs per node x M nodes sharing one host store per node."""
    check_topology(hw, gpus_per_node, nodes, p.backend)
    if gpus_per_node * nodes > 1 and left_auto(p.speculative_step):
        p = dataclasses.replace(p, speculative_step=False)  # the engine's "auto": off with several ranks
    if gpus_per_node * nodes > 1:
        p = dataclasses.replace(p, data_parallel=True)  # no optimizer residency (engine/update/resident.py)
    single = plan_point(p, hw)
    n = gpus_per_node
    if n * nodes == 1:
        layer, rank = split_host(single)
        return MultiPlan(1, 1, single, single, Comm(0.0, 0.0, 0.0, 0.0, 0), layer, {k: v for k, v in rank.items() if v})
    st = single.time
    rhw = rank_hardware(hw, n, st.h2d_bytes / max(1, st.h2d_bytes + st.d2h_bytes))
    # the rank with the most layers sets the pace; a replicated store updates every layer on every rank
    owned = math.ceil(p.model.num_layers / n) if shares_host_store(p) else p.model.num_layers
    # each layer's reduction by the rank's own reducer threads, as one GPU's (host_work.py), at its view of the host
    t = megatrain_time(p, rhw, single.long_context.offload, owned_layers=owned,
                       residency=single.long_context.residency)
    comm = comm_time(p, hw, t, n, nodes)  # every rank takes part at once: the whole host's bandwidth
    busy = {**t.busy_s, "host reduce (globals)": comm.intra_globals_s,
            "network": comm.network_layers_s + comm.network_globals_s}
    bottleneck = "network" if busy["network"] > max(busy["compute"], busy["link h2d"], busy["link d2h"]) else t.bottleneck
    idle = {**t.idle_s, IDLE_COMM: comm.added_s}
    t = dataclasses.replace(t, step_s=t.step_s + comm.added_s, busy_s=busy, bottleneck=bottleneck, idle_s=idle)
    mem, layer, rank = node_memory(single, n, nodes)
    ok, reasons = check_fit(mem, hw)
    reasons = [r.replace("host:", f"host (per node, {n} GPUs):", 1) for r in reasons]
    rank_plan = Plan(p, rhw, mem, t, ok, reasons, dict(single.decisions), list(single.warnings), single.long_context,
                     list(single.refused))
    return MultiPlan(n, nodes, single, rank_plan, comm, layer, rank)


def plan_multi(model: Any, context: int, batch: int = 1, grad_accum: int = 1, dtype: str = "bfloat16",
               hardware: str | Hardware | dict = "h200-pcie", *, gpus_per_node: int = 1, nodes: int = 1,
               network_gbs: float | None = None, gpus_per_host_link: int | None = None,
               link_gbs: float | None = None, host_memory_gib: float | None = None,
               device_memory_gib: float | None = None, **knobs: Any) -> MultiPlan:
    """plan() for a data-parallel job: N GPUs per node (sharing the node's host), M nodes."""
    p = make_point(model, context, batch, grad_accum, dtype, "megatrain", **knobs)
    hw = node_hardware(resolve_hardware(hardware, link_gbs, host_memory_gib, device_memory_gib), network_gbs,
                       gpus_per_host_link)
    return plan_point_multi(p, hw, gpus_per_node, nodes)

