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
refuses, naming the numbers. FP32, hi/lo or bf16 masters with gradient slabs (a non-owned layer's buffers are one
scratch layer of each kind the master mode keeps, host/store.py; the per-layer update of hilo / bf16 unpacks and packs
the owned layers only).

Several ranks per node (LOCAL_WORLD_SIZE > 1: `NodesShareByNodeStore`, host/node_store.py SpanningNodeStore): the
owner of a layer is a node, which holds its block of layers in its shared memory as a node's store does, one of its
ranks owning each; the node's ranks take the node path (node_path.py SpanningWeights: each rank's shard of an own
layer copied host-to-device and broadcast to the same local rank of every other node, then all-gathered in each
node; NodeGrads: reduce-scattered in the node, each shard reduced to the owner node's peer). Above, for one rank per
node, the classes here carry it alone (NodesShareStore, SharedWeights).

The speculative step runs with speculative_step True, each layer speculated by its owner rank only
(update/speculative.py); "auto" stays off for these stores (speculative.resolve says why).

Collective calls outside training (`NodesShareStore.join`): an evaluation forward loads the other nodes' layers by
the owners' broadcasts, and the model object's `state_dict()` gathers them from their owners, so every rank must run
them together. Each starts with a join of every rank (a tiny all-gather on a group of its own whose timeout is
JOIN_S): a rank that runs one alone (an evaluation on rank 0 only) is refused within JOIN_S, naming itself and what
to do, instead of waiting on a broadcast no owner sends until the watchdog fires.
"""

from __future__ import annotations

import collections
import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...costs.modes import GradSlab, HostMaster
from ...costs.residency import Residency
from ..host.codec import master_codec
from ..host.node_store import NodeStore, SpanningNodeStore, Topology, node_layout, node_place
from ..host.preflight import HostMemoryError, available_host_bytes, host_store_bytes, model_host_bytes
from ..pipeline.schedule import LayerPipeline
from ..runtime.stream import Streams
from . import node_path
from .distributed import DataParallel
from .ranks import OneRank

SHARED = node_path.SHARED
# How long a rank waits for the others at a collective call outside training (an evaluation forward, the model
# object's state_dict) before it refuses: the ranks come to these from the same point of their loops, so a few
# seconds apart at most; a rank alone waits for nothing that comes (the watchdog would end it much later).
JOIN_S = 10.0
# The calls joined, each on a group of its own (a timed-out join closes its group: gloo's pairs are shut on both
# ends, so every later join of that kind fails at once, on every rank, instead of meeting a stale message).
JOINS = {"forward": "an evaluation forward (the model in eval mode)",
         "state_dict": "the model object's state_dict() (save_pretrained's)"}
HOW = {"forward": "run every evaluation on every rank (each its share of the batches, as Trainer.evaluate does), "
                  "or keep it out of the nodes' shared store (an engine of its own)",
       "state_dict": "call it on every rank (write the files on one: save_pretrained(..., is_main_process=rank == 0)), "
                     "or use engine.save_checkpoint / the faces' save, which do"}


class RanksOutOfStep(RuntimeError):
    """A collective call of the nodes' shared store that the other ranks did not join (one rank alone)."""


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


def store_bytes(numels: list[int], n_globals: int, compute_dtype: torch.dtype, master: HostMaster = HostMaster.FP32,
                grad: GradSlab | None = GradSlab.FLOAT32) -> tuple[list[int], int]:
    """(each layer's host bytes, the resident parameters' bytes) of one whole store with AdamW: the master (FP32, or
    the hilo / bf16 mode's), gradient slab, m and v (and the bf16 shadow of an FP32 master in bf16 compute), the
    preflight's count (host/preflight.py)."""
    per = sum(host_store_bytes(1, compute_dtype, 1, master, grad).values())  # a layer parameter
    glob = sum(host_store_bytes(1, compute_dtype, 0, master, grad).values())  # a resident parameter: FP32, no shadow
    return [n * per for n in numels], n_globals * glob


def share_bytes(layer_bytes: list[int], globals_bytes: int, numels: list[int], owned: tuple[int, int],
                compute_dtype: torch.dtype, master: HostMaster = HostMaster.FP32, local_world: int = 1) -> int:
    """One node's host bytes when the nodes share one store: its layers' state, the replicated resident parameters
    and the scratch the other layers' parameters view: one layer of each buffer the master mode keeps per layer
    (host/codec.py shared_kinds: FP32 master, and its bf16 shadow in bf16 compute; the bf16 half, the lo half and
    a tie table of the layer's length in hilo; the bf16 master), plus, in hilo / bf16, the one-layer FP32 scratch
    of the per-layer update (master and gradient). With `local_world` G > 1 ranks on the node: the node's layers and
    the scratch once (the node's shared memory), the resident parameters and the update scratch once per rank, and
    the node path's two FP32 transit layers (node_store.py SpanningNodeStore)."""
    a, b = owned
    shadow = torch.bfloat16 if compute_dtype == torch.bfloat16 else None
    per = sum(torch.empty((), dtype=dt).element_size() for _, dt in master_codec(master).shared_kinds(shadow))
    update = 8 if master is not HostMaster.FP32 else 0
    transit = 8 if local_world > 1 else 0
    return (sum(layer_bytes[a:b]) + local_world * globals_bytes +
            max(numels) * (per + local_world * update + transit))


class NodesShareStore:
    """What the host store and the data-parallel ranks need of the nodes sharing one store: which layers this rank's
    node owns, its groups, and (for the start line) the ranges. Stands where a node's NodeStore stands (engine.node,
    dp.node): one rank per node, so the node's own store is this rank's (several: NodesShareByNodeStore)."""

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
        self.world_group = self.node_group  # one rank per node: the nodes' group is the job's
        self.owner_of = [r for r, (a, b) in enumerate(ranges) for _ in range(a, b)]
        self.make_joins(dp)

    def make_joins(self, dp: DataParallel) -> None:
        """The joins' groups (collective: every rank, in the same order)."""
        self.join_s = min(JOIN_S, 0.9 * dp.watchdog_s)
        join = datetime.timedelta(seconds=self.join_s)
        self.join_groups = {kind: dist.new_group(backend="gloo", timeout=join) for kind in JOINS}
        self.joined = dict.fromkeys(JOINS, 0)
        self.refused: dict[str, str] = {}  # kind -> why this rank refuses every later join of it


    def other_layers(self, store: Any, layers_prefix: str, dp: DataParallel) -> dict[str, torch.Tensor]:
        """The other nodes' layers by name, whole (other_nodes_layers): what the ranks' state_dict adds."""
        return other_nodes_layers(self, store, layers_prefix, dp)
    def owns(self, layer: int) -> bool:
        return self.first <= layer < self.stop

    def node_owns(self, layer: int) -> bool:
        """Whether this rank's node holds the layer (one rank per node: this rank)."""
        return self.owns(layer)

    def owner_rank(self, layer: int) -> int:
        return self.owner_of[layer]

    def make_staging(self, numel: int) -> None:
        """No node-shared staging: the gradients go to their owner by a reduce."""

    def barrier(self) -> None:
        dist.barrier(group=self.node_group)

    def join(self, kind: str) -> None:
        """Every rank at this collective call (`kind`, one of JOINS) within `join_s` seconds; else RanksOutOfStep on
        this rank, naming it and what to do. Counted per kind: ranks that ran different numbers of them are refused
        too (their broadcasts would pair the wrong layers)."""
        what = JOINS[kind]
        if kind in self.refused:
            raise RanksOutOfStep(self.refused[kind])
        mine = torch.tensor([self.joined[kind]], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        try:
            dist.all_gather(every, mine, group=self.join_groups[kind])
        except Exception as exc:  # gloo's timeout here, or (another rank's timed out first) the group shut
            head = (f"rank {self.rank} of {self.world} ran {what} alone: the other ranks did not join it within "
                    f"{self.join_s:.0f} s" if "timed out" in str(exc).lower() else
                    f"rank {self.rank} of {self.world} cannot run {what}: another rank ran one alone earlier and was "
                    f"refused, which shut this join ({exc})")
            self.refused[kind] = (
                f"{head}. With nodes sharing one store each layer "
                f"lives on its owner node and comes from it by a collective, so every rank runs the same ones: "
                f"{HOW[kind]}. (This rank refuses every later one: the ranks are out of step at it.)")
            raise RanksOutOfStep(self.refused[kind]) from exc
        self.joined[kind] += 1
        counts = [int(t) for t in every]
        if len(set(counts)) > 1:
            self.refused[kind] = (f"rank {self.rank}: the ranks have run different numbers of {what} "
                                  f"({dict(enumerate(counts))}): one ran one alone; every rank runs the same ones: "
                                  f"{HOW[kind]}")
            raise RanksOutOfStep(self.refused[kind])

    def describe(self) -> str:
        mine = f"layers {self.first}-{self.stop - 1}" if self.stop > self.first else "no layers"
        return f"node {self.rank} owns {mine} of {len(self.owner_of)}"


class NodesShareByNodeStore(SpanningNodeStore, NodesShareStore):
    """Nodes sharing one store with several ranks per node: a node's store over its block of layers
    (node_store.py SpanningNodeStore), with the joins of NodesShareStore at the collective calls outside training
    (an evaluation forward, the model object's state_dict), which the model object runs for either kind."""

    def __init__(self, dp: DataParallel, ranges: list[tuple[int, int]]) -> None:
        SpanningNodeStore.__init__(self, dp.rank, dp.group, dp.timeout, dp.watchdog_s, ranges)
        self.make_joins(dp)


def host_store(dp: DataParallel | None, config: Any, model: torch.nn.Module,
               layers: list[torch.nn.Module]) -> NodeStore | NodesShareStore | None:
    """The engine's host store arrangement across ranks (engine.node): a node's shared store (node_store.py), the
    nodes' one store shared between them, or each rank its own (None). Collective where `dp` is given."""
    numels = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    n_globals = sum(p.numel() for p in model.parameters()) - sum(numels)  # tied weights once
    dtype = torch.bfloat16 if config.compute_dtype == "bfloat16" else torch.float32
    master, grad = config.master_mode, config.grad_slab
    layer_bytes, glob = store_bytes(numels, n_globals, dtype, master, grad)
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
    n, local = len(nodes), len(nodes[0])
    ranges = layer_ranges(numels, n)
    shares = [share_bytes(layer_bytes, glob, numels, r, dtype, master, local) for r in ranges]
    why = None
    if n < 2:
        why = "one node has no other to share with"
    elif max(shares) > budget:
        enough = next((m for m in range(n + 1, len(numels) + 1) if max(
            share_bytes(layer_bytes, glob, numels, r, dtype, master, local)
            for r in layer_ranges(numels, m)) <= budget), None)
        why = (f"each of {n} nodes' share needs up to {_size(max(shares))} (its layers, the replicated resident "
               f"parameters {_size(glob)} and a layer of scratch); " +
               (f"{enough} nodes' shares would fit" if enough else "no number of nodes' shares fits"))
    elif config.optimizer_in_backward:
        why = "they keep gradient slabs (optimizer_in_backward is true; set optimizer_in_backward=false)"
    elif local > 1:
        why = several_ranks_refusal(config)
    if why is not None:
        if not given:
            return usual()  # the host preflight refuses it, by component
        raise HostMemoryError(f"one whole host store needs {_size(whole)} and {what} is {_size(budget)}; the nodes "
                              f"cannot share one store: {why}. Add nodes, raise the budget or set nvme_path")
    if local > 1:  # each node's block of layers in its shared memory, its ranks on the node path (SpanningNodeStore)
        return dp.share_host_store(lambda: NodesShareByNodeStore(dp, ranges))
    shared = NodesShareStore(dp, ranges)
    dp.node = shared
    return shared


def several_ranks_refusal(config: Any) -> str | None:
    """Why nodes sharing one store cannot run with several ranks per node with these settings (None: they can). Each
    node's ranks take the node path (weights by shard, the owner node's shards broadcast to their peers, gradients
    reduce-scattered in the node and reduced to the owner node's peer), each of the node's layers updated whole by
    one of its ranks; what is not built for it is refused by name."""
    if node_path.requested_path(config) == node_path.PER_RANK:
        return ("data_parallel_path='per_rank' with several ranks per node (each node's ranks load its share by "
                "shard on the node path; set data_parallel_path='auto' or 'node')")
    return None


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
    r = config.residency
    kept = not isinstance(r, Residency) or r.weights > 0
    spans = getattr(node, "spans_nodes", False)
    if spans and kept:
        raise ValueError(f"nodes sharing one store stream every layer from its owner node (residency={r!r} keeps some "
                         "on the device, not built for several ranks per node): set residency='stream'")
    if spans or not isinstance(node, NodesShareStore):
        return node_path.attach(pipeline, streams, dp, node, ranks, config)
    if kept:
        raise ValueError(f"nodes sharing one store stream every layer from its owner (residency={r!r} keeps some on "
                         "the device, loaded from a host master only the owner has): set residency='stream'")
    weights = SharedWeights(node, pipeline, dp)
    pipeline.use_weights(weights)
    return node_path.DataPath(SHARED, f"{node.describe()} ({len(node.ranges)} nodes; each layer's weights broadcast "
                              "from its owner, its gradients reduced to it; resident parameters replicated)", weights)


def join_forwards(model: nn.Module, embed: nn.Module, node: NodesShareStore) -> RemovableHandle:
    """Join every rank at each evaluation forward (the model in eval mode), engine(...) and the model's own (generate)
    alike: both start at the embedding, before any layer is loaded. Training forwards are not joined: their
    backward's reduces are collective anyway (as on any data-parallel path)."""
    def before(module: nn.Module, args: tuple) -> None:
        if module is embed and not model.training:  # a copy of the model (deepcopy keeps hooks) is no engine's
            node.join("forward")

    return embed.register_forward_pre_hook(before)


def other_nodes_layers(node: NodesShareStore, store: Any, layers_prefix: str,
                       dp: DataParallel) -> dict[str, torch.Tensor]:
    """The other nodes' layers' FP32 master values by name, each layer broadcast from its owner into a fresh tensor
    (collective, joined: every rank calls it; a rank alone is refused within JOIN_S). The owner reads its layer's
    values through the master mode (host/codec.py: the FP32 master, or hi and lo joined in hilo, the bf16 master
    widened), one layer at a time."""
    node.join("state_dict")
    out: dict[str, torch.Tensor] = {}
    for i, g in enumerate(store.layers):
        owner = node.owner_rank(i)
        flat = (torch.cat([g.read_slot(s).reshape(-1) for s in g.slots]) if g.owned else
                torch.empty(g.numel, dtype=torch.float32))
        dp.guarded(f"taking layer {i}'s weights from its owner rank {owner} for a state_dict",
                   lambda flat=flat, owner=owner: dist.broadcast(flat, src=owner, group=node.world_group))
        if not node.node_owns(i):  # (a layer of this node's that another of its ranks owns: its shared master)
            out.update({f"{layers_prefix}.{i}.{s.name}": g.view(flat, s) for s in g.slots})
    return out
