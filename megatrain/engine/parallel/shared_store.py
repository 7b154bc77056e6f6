"""Nodes sharing one store (docs/DISTRIBUTED.md section 5b): where one node's host cannot hold the model's host state
but 1/N of it fits, each of the N nodes owns the host state of a contiguous 1/N of the decoder layers (FP32 master,
gradient slab, Adam m and v) and nothing of the others'.

- Weights: a layer's owner copies it from its master into a ring slot (the h2d stream, as any streamed layer), then
  the owner broadcasts the slot to the other nodes' same slot on the gather stream (the network is one more streamed
  tier). The pipeline issues the next layers' loads while a layer computes, so the broadcast of the next layer is in
  flight during this one's compute, double-buffered like the host link by the same ring (k slots, `freed` gating).
  On the CPU the broadcast is gloo's; on GPUs it is NCCL's, into the device slot itself (the one place that says so:
  `SharedWeights.gather`).
- Gradients: each node's staged gradient of a layer is reduced (a reduce, not an all-reduce) to the layer's owner,
  whose slab adds the sum / world (ranks.py NodesShare), and whose update alone touches the layer.
- The resident parameters (embedding, final norm, head) stay replicated on every node, averaged as in the per-rank
  path: small beside the layers (`share_bytes` counts them in each node's share).
- A non-owned layer has no host state: its parameters are views of one scratch buffer of the largest layer (the
  optimizer never sees a gradient for them, so it makes no state for them; writes into it, as placement's packing of
  the initial weights, go nowhere that is read).

The engine chooses this mode by itself (`host_store`): when `host_budget_bytes` (or, without one, the smallest host
memory any rank measures) cannot hold one whole store but each node's share fits; when even the share does not fit it
refuses, naming the numbers. One rank per node (LOCAL_WORLD_SIZE=1) for now; FP32 masters only.
"""

from __future__ import annotations

import collections
import datetime
from typing import Any

import torch
import torch.distributed as dist

from ...costs.residency import Residency
from ..host.node_store import NodeStore, Topology, node_layout, node_place
from ..host.preflight import HostMemoryError, available_host_bytes, host_store_bytes, model_host_bytes
from ..pipeline.schedule import LayerPipeline
from ..runtime.stream import Streams
from . import node_path
from .distributed import DataParallel
from .ranks import OneRank

SHARED = "nodes share one store"


def _size(n: float) -> str:
    return f"{int(n):,} bytes ({n / 2**30:.2f} GiB)" if n >= 2**30 else f"{int(n):,} bytes ({n / 2**20:.2f} MiB)"


def layer_ranges(numels: list[int], nodes: int) -> list[tuple[int, int]]:
    """Each node's contiguous layers [a, b): cut where the running parameter count crosses k/N of the total, so the
    shares' bytes are as even as whole layers allow."""
    total, cuts, run = sum(numels), [0], 0
    for i, n in enumerate(numels):
        run += n
        while len(cuts) < nodes and run * nodes >= total * len(cuts) and i + 1 < len(numels):
            cuts.append(i + 1)
    cuts += [len(numels)] * (nodes + 1 - len(cuts))
    return [(cuts[k], cuts[k + 1]) for k in range(nodes)]


def store_bytes(numels: list[int], n_globals: int, compute_dtype: torch.dtype) -> tuple[list[int], int]:
    """(each layer's host bytes, the resident parameters' bytes) of one whole store with AdamW: FP32 master, gradient
    slab, m and v (and the bf16 shadow in bf16 compute), the preflight's count (host/preflight.py)."""
    per = sum(host_store_bytes(1, compute_dtype, 1).values())  # a layer parameter
    glob = sum(host_store_bytes(1, compute_dtype, 0).values())  # a resident parameter: no shadow
    return [n * per for n in numels], n_globals * glob


def share_bytes(layer_bytes: list[int], globals_bytes: int, numels: list[int], owned: tuple[int, int],
                compute_dtype: torch.dtype) -> int:
    """One node's host bytes when the nodes share one store: its layers' state, the replicated resident parameters
    and the scratch the other layers' parameters view (one layer of master, and of shadow in bf16)."""
    a, b = owned
    shadow = 2 if compute_dtype == torch.bfloat16 else 0
    return sum(layer_bytes[a:b]) + globals_bytes + max(numels) * (4 + shadow)


class NodesShareStore:
    """What the host store and the data-parallel ranks need of the nodes sharing one store: which layers this rank's
    node owns, its groups, and (for the start line) the ranges. Stands where a node's NodeStore stands (engine.node,
    dp.node): one rank per node, so the node's own store is this rank's."""

    shares_across_nodes = True
    leader = True  # every rank writes its own store (placement's packing)
    cross_group = None

    def __init__(self, dp: DataParallel, ranges: list[tuple[int, int]]) -> None:
        self.rank, self.world = dp.rank, dp.world_size
        self.ranges = ranges
        self.first, self.stop = ranges[self.rank]
        self.topo = Topology(self.rank, self.world, 0, 1, [[r] for r in range(self.world)])
        timeout = datetime.timedelta(seconds=max(0.9 * dp.watchdog_s, 0.1))
        # Collective, in this order on every rank: the weights' broadcasts run on the gather stream's thread, the
        # gradients' reduces on the data-parallel thread (dp.group), the norm and barriers on the training thread.
        # The weights move device to device: NCCL where the job's default group is (GPUs), else gloo.
        weights = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
        self.weights_group = dist.new_group(backend=weights, timeout=timeout)
        self.node_group = dist.new_group(backend="gloo", timeout=timeout)
        self.owner_of = [r for r, (a, b) in enumerate(ranges) for _ in range(a, b)]

    def owns(self, layer: int) -> bool:
        return self.first <= layer < self.stop

    def owner_rank(self, layer: int) -> int:
        return self.owner_of[layer]

    def make_staging(self, numel: int) -> None:
        """No node-shared staging: the gradients go to their owner by a reduce."""

    def barrier(self) -> None:
        dist.barrier(group=self.node_group)

    def describe(self) -> str:
        mine = f"layers {self.first}-{self.stop - 1}" if self.stop > self.first else "no layers"
        return f"node {self.rank} owns {mine} of {len(self.owner_of)}"


def host_store(dp: DataParallel | None, config: Any, model: torch.nn.Module,
               layers: list[torch.nn.Module]) -> NodeStore | NodesShareStore | None:
    """The engine's host store arrangement across ranks (engine.node): a node's shared store (node_store.py), the
    nodes' one store shared between them, or each rank its own (None). Collective where `dp` is given."""
    numels = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    n_globals = sum(p.numel() for p in model.parameters()) - sum(numels)  # tied weights once
    dtype = torch.bfloat16 if config.compute_dtype == "bfloat16" else torch.float32
    layer_bytes, glob = store_bytes(numels, n_globals, dtype)
    whole = sum(layer_bytes) + glob
    budget, given = config.host_budget_bytes, config.host_budget_bytes is not None

    def usual() -> NodeStore | None:  # each node its whole store (or each rank its own)
        return dp.share_host_store() if dp is not None and config.share_host_store else None

    if config.nvme_path is not None:  # the NVMe tier keeps the store within the budget by spilling (spill.py)
        return usual()
    if not given and dp is not None:
        # The smallest host of any rank, with what placement frees as it packs the model (preflight's `freed`).
        mine = available_host_bytes() + model_host_bytes(list(model.parameters()))
        budget = -dp.max_across(-mine, "measuring the ranks' host memory")
    if budget is None or whole <= budget:
        return usual()
    what = "host_budget_bytes" if given else "the smallest rank's available host memory"
    if dp is None or not config.share_host_store:
        if not given:
            return usual()  # the host preflight refuses it, by component
        raise HostMemoryError(f"one whole host store needs {_size(whole)} and {what} is {_size(budget)}: set "
                              "nvme_path (the NVMe tier), or run on several nodes sharing one store "
                              "(data_parallel_host 'auto')")
    every: list[Any] = [None] * dp.world_size
    dist.all_gather_object(every, node_place(), group=dp.group)
    nodes = node_layout([e[0] for e in every], [e[1] for e in every], [e[2] for e in every],
                        check_local_rank=False)
    n = len(nodes)
    ranges = layer_ranges(numels, n)
    shares = [share_bytes(layer_bytes, glob, numels, r, dtype) for r in ranges]
    why = None
    if n < 2:
        why = "one node has no other to share with"
    elif any(len(ranks) > 1 for ranks in nodes):
        why = (f"{len(nodes[0])} ranks per node (sharing one store across nodes takes one rank per node, "
               "LOCAL_WORLD_SIZE=1, for now)")
    elif max(shares) > budget:
        enough = next((m for m in range(n + 1, len(numels) + 1) if max(
            share_bytes(layer_bytes, glob, numels, r, dtype) for r in layer_ranges(numels, m)) <= budget), None)
        why = (f"each of {n} nodes' share needs up to {_size(max(shares))} (its layers, the replicated resident "
               f"parameters {_size(glob)} and a layer of scratch); " +
               (f"{enough} nodes' shares would fit" if enough else "no number of nodes' shares fits"))
    elif config.master_mode.value != "fp32" or config.optimizer_in_backward:
        why = (f"they keep FP32 masters with gradient slabs (host_master {config.master_mode.value!r}, "
               f"optimizer_in_backward {config.optimizer_in_backward}; set host_master='fp32' and "
               "optimizer_in_backward=false)")
    if why is not None:
        if not given:
            return usual()  # the host preflight refuses it, by component
        raise HostMemoryError(f"one whole host store needs {_size(whole)} and {what} is {_size(budget)}; the nodes "
                              f"cannot share one store: {why}. Add nodes, raise the budget or set nvme_path")
    shared = NodesShareStore(dp, ranges)
    dp.node = shared
    return shared


class SharedWeights:
    """The pipeline's ShardedWeights for nodes sharing one store: a layer's owner copies the whole layer into its
    ring slot, then every rank takes the slot's contents from the owner by a broadcast."""

    def __init__(self, node: NodesShareStore, pipeline: LayerPipeline, dp: DataParallel) -> None:
        self.node, self.dp = node, dp
        # The loads' layers, in the order they are issued: the copies (h2d thread) and the broadcasts (gather
        # thread) run in that order on every rank, each broadcast after its copy (the pipeline's protocol passes
        # the source, not the layer: a non-owned layer's source is a view of the scratch of its own).
        self.pending: collections.deque[int] = collections.deque()
        self.layer_of: dict[int, int] = {}
        for i, g in enumerate(pipeline.store.layers):
            src = g.stream_source
            if src is not g.stream_source:
                raise RuntimeError("a layer's stream source is not one tensor from call to call: the nodes' shared "
                                   "store cannot tell its loads apart")
            self.layer_of[id(src)] = i
        self.broadcast_bytes = 0

    def padded(self, numel: int) -> int:
        return numel

    def copy_shard(self, buffer: torch.Tensor, src: torch.Tensor, numel: int) -> int:
        layer = self.layer_of[id(src)]
        self.pending.append(layer)
        if not self.node.owns(layer):
            return 0  # its weights come from the owner (gather)
        buffer[:numel].copy_(src, non_blocking=True)
        return numel * src.element_size()

    def gather(self, buffer: torch.Tensor, numel: int) -> int:
        layer = self.pending.popleft()
        owner = self.node.owner_rank(layer)
        # gloo on the CPU; on GPUs the same call on an NCCL group moves the owner's device slot into the others'.
        t = buffer[:numel]
        t = t if t.dtype in (torch.float32, torch.int64) else t.view(torch.uint8)  # gloo has no bf16: its bits
        self.dp.guarded(f"broadcasting layer {layer}'s weights from its owner rank {owner}",
                        lambda: dist.broadcast(t, src=owner, group=self.node.weights_group))
        if owner == self.node.rank:
            return 0
        nbytes = numel * buffer.element_size()
        self.broadcast_bytes += nbytes
        return nbytes


def attach(pipeline: LayerPipeline, streams: Streams, dp: DataParallel | None, node: Any, ranks: OneRank,
           config: Any) -> node_path.DataPath:
    """The data path: nodes sharing one store load each streamed layer from its owner (SharedWeights); any other
    arrangement is node_path.attach's."""
    if not isinstance(node, NodesShareStore):
        return node_path.attach(pipeline, streams, dp, node, ranks, config)
    r = config.residency
    if not isinstance(r, Residency) or r.weights > 0:
        raise ValueError(f"nodes sharing one store stream every layer from its owner (residency={r!r} keeps some on "
                         "the device, loaded from a host master only the owner has): set residency='stream'")
    weights = SharedWeights(node, pipeline, dp)
    pipeline.use_weights(weights)
    return node_path.DataPath(SHARED, f"{node.describe()} ({len(node.ranges)} nodes; each layer's weights broadcast "
                              "from its owner, its gradients reduced to it; resident parameters replicated)", weights)
