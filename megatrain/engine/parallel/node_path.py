"""The node path (docs/DISTRIBUTED.md): which data path a data-parallel engine runs, and the objects that make the
node path's layer loads one trip per layer per node.

Landed so far (DISTRIBUTED.md "Steps to land it", steps 2-4 and 6; section 4's sharded keeping). Weights: each of
the node's G ranks copies its 1/G of a streamed layer's flat buffer host-to-device (`NodeWeights.copy_shard`, its ranges of the shard map,
costs/shards.py) and the node's ranks all-gather the rest on the gather stream (`NodeWeights.gather`,
collectives.py); the recompute in backward loads, so gathers, again. A kept layer (the residency setting) is kept
sharded (section 4): this rank's shard stays on its device, refreshed from its own ranges once per change of the
masters (`NodeWeights.refresh`), and each load is its placement into the slot and the gather
(engine/pipeline/kept_shards.py). Gradients (`NodeGrads`): reduce-scattered in
FP32 on the scatter stream, each rank's shard copied to the host. The update (`plan`): by shard where it can run
(engine/update/by_shard.py: each rank's ranges of every layer in its own slab, its update thread updating them,
the Adam state once in the node's memory); else (the optimizer in backward, a hi/lo or bf16 master, NVMe, an
optimizer other than torch's Adam/AdamW) each layer's owner adds the node's one landed buffer into its slab and
updates the whole layer (ranks.py SharedStore). Either way the node path needs the shared host store.

Which path runs (`plan`, before the store is built): `data_parallel_path` "node" asks for the node path and is
refused where it cannot run; "per_rank" the per-rank path; "auto" (the default) the node path with its update by
shard where both can run, else the per-rank path, and the start line (`DataPath.describe`) says which and why.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...config.schema import AUTO, rule_or
from ...config.settle import LATER
from ...costs.shards import ShardMap, padded_numel
from ..host.node_store import NodeStore
from ..host.store import FlatGroup
from ..pipeline.schedule import LayerPipeline
from ..runtime.stream import DONE, Event, Streams
from ..update.optim import unsupported_reason
from .collectives import CollectiveStats, NodeGroups, gather_layer, node_groups, reduce_scatter_into
from .distributed import DataParallel
from .ranks import OneRank

CHUNK: int | None = None  # elements per chunk of the shard map (None: costs/shards.default_chunk); tests cut small
# "auto" on a CPU device: the gloo ranks stand in for a node's GPUs only where asked ("node"), as the planner models a
# CPU device (planner/node_path.py path_for); a test of "auto"'s choice turns this on to stand in for a GPU node.
AUTO_ON_CPU = False
NODE, PER_RANK = "node", "per_rank"
SHARED = "nodes share one store"


class NodeWeights:
    """The pipeline's ShardedWeights on the node path: this rank's shard copy and the node's all-gather of a layer,
    with the shard map of each layer size made once. `stats` counts the node path's collectives since the start
    (collect_stats' figures per step are the gather and scatter streams' counters). `dp`: the job whose error a
    failed collective raises (None: the collective's own)."""

    def __init__(self, groups: NodeGroups, chunk: int | None = None, dp: DataParallel | None = None) -> None:
        self.groups = groups
        self.dp = dp
        self.world, self.rank = groups.local_world, groups.local
        self.chunk = chunk
        self.stats = CollectiveStats()
        self._maps: dict[int, ShardMap] = {}

    def map(self, numel: int) -> ShardMap:
        m = self._maps.get(numel)
        if m is None:
            m = self._maps[numel] = ShardMap.of(numel, self.world, self.chunk)
        return m

    def padded(self, numel: int) -> int:
        return padded_numel(numel, self.world)

    def copy_shard(self, buffer: torch.Tensor, src: torch.Tensor, numel: int) -> int:
        nbytes = 0
        for a, b in self.map(numel).owned(self.rank):  # the padding is no parameter: nothing to copy there
            buffer[a:b].copy_(src[a:b], non_blocking=True)
            nbytes += (b - a) * src.element_size()
        return nbytes

    # -- a layer kept sharded (DISTRIBUTED.md section 4; schedule.py KeptShards) ----------------------------
    def shard_numel(self, numel: int) -> int:
        return self.map(numel).shard_numel

    def refresh(self, shard: torch.Tensor, src: torch.Tensor, numel: int) -> int:
        """This rank's ranges of the layer's masters (`src`, its host stream source) into its packed device shard:
        the only host-to-device copy of a layer kept sharded, once per change of the masters; the bytes copied.
        The padding stays as it was: no parameter, never read."""
        nbytes, at = 0, 0
        for a, b in self.map(numel).ranges(self.rank):
            end = min(b, numel)
            if a < end:
                shard[at: at + end - a].copy_(src[a:end], non_blocking=True)
                nbytes += (end - a) * src.element_size()
            at += b - a
        return nbytes

    def place(self, buffer: torch.Tensor, shard: torch.Tensor, numel: int) -> None:
        """The packed shard into this rank's ranges of a ring slot, on the device, where the in-place gather reads
        them (as a streamed layer's shard copy lands there)."""
        at = 0
        for a, b in self.map(numel).ranges(self.rank):
            buffer[a:b].copy_(shard[at: at + b - a], non_blocking=True)
            at += b - a

    def gather(self, buffer: torch.Tensor, numel: int) -> int:
        m = self.map(numel)
        before = self.stats.gathered_bytes
        self.guard("all-gathering a layer's weights across the node",
                   lambda: gather_layer(buffer[: m.padded], m, self.groups.gather_group, stats=self.stats))
        return self.stats.gathered_bytes - before

    def guard(self, what: str, work: Callable[[], object]) -> None:
        """Run one of the node path's collectives. A peer that died or hung fails it (at the groups' timeout, just
        under the watchdog's) with the data-parallel error naming this rank and the likely cause, as the per-rank
        path's averages do, and marks the job broken: the other streams' collectives then fail at once with it
        instead of each waiting out its own timeout."""
        if self.dp is None:
            work()
        else:  # the job's own error: the per-rank path's message, so a fault reads the same on either path
            self.dp.guarded(what, work)


class SpanningWeights(NodeWeights):
    """NodeWeights where the nodes share one store (docs/DISTRIBUTED.md section 5b, several ranks per node): a
    layer's owner node copies it by shard as a node does, each of its ranks then broadcasts its shard to the peers
    with its local index on the other nodes (the cross-node gather group), and every node all-gathers the shards.
    The pipeline hands over the layer's host source, not its index: the sources are told apart by identity (another
    node's layer is a view of the node's scratch of its own), and the copies (h2d thread) and broadcasts (gather
    thread) run in the order the loads are issued, the same on every rank. `broadcast_bytes`: what this rank
    received from the owner nodes' peers."""

    def __init__(self, groups: NodeGroups, node: object, pipeline: LayerPipeline, chunk: int | None = None,
                 dp: DataParallel | None = None) -> None:
        super().__init__(groups, chunk, dp)
        self.node = node
        self.pending: collections.deque[int] = collections.deque()
        self.layer_of = {id(g.stream_source): i for i, g in enumerate(pipeline.store.layers)}
        if len(self.layer_of) != len(pipeline.store.layers):
            raise RuntimeError("two layers stream from one host tensor: the nodes' shared store cannot tell their "
                               "loads apart")
        self.broadcast_bytes = 0

    def copy_shard(self, buffer: torch.Tensor, src: torch.Tensor, numel: int) -> int:
        layer = self.layer_of[id(src)]
        self.pending.append(layer)
        if not self.node.node_owns(layer):
            return 0  # its shards come from the owner node's peers (gather)
        return super().copy_shard(buffer, src, numel)

    def gather(self, buffer: torch.Tensor, numel: int) -> int:
        layer = self.pending.popleft()
        m = self.map(numel)
        src = self.node.peer(layer)

        def broadcast() -> None:
            for a, b in m.ranges(self.rank):  # gloo has no bf16: its bits
                t = buffer[a:b] if buffer.dtype in (torch.float32, torch.int64) else buffer[a:b].view(torch.uint8)
                dist.broadcast(t, src=src, group=self.groups.cross_gather)

        self.guard(f"broadcasting layer {layer}'s shard from its owner node's rank {src}", broadcast)
        got = 0 if self.node.node_owns(layer) else m.shard_numel * buffer.element_size()
        self.broadcast_bytes += got
        return got + super().gather(buffer, numel)


class NodeGrads:
    """The pipeline's ShardedGrads on the node path (DISTRIBUTED.md section 2). On the scatter stream, a layer's
    gradients are laid out as its flat buffer in FP32 a chunk at a time (the shard map's chunks: one FP32 chunk
    buffer, not a layer's) and each chunk reduce-scattered over the node's scatter group into this rank's shard (two
    shard buffers in turn; with several nodes the shard is then all-reduced among the peers). On the d2h stream the
    shard goes into this rank's ranges of one of the node's two shared transit buffers, and on the data-parallel
    thread the layer's owner adds that one buffer into its slab (NodeStore.add_transit): no host sum of G slots.
    `stats` counts what the reduce-scatters sent."""

    def __init__(self, groups: NodeGroups, weights: NodeWeights, streams: Streams, dp: DataParallel,
                 node: NodeStore, max_numel: int, device: torch.device,
                 grad_dtypes: tuple[torch.dtype, ...] = ()) -> None:
        self.groups, self.weights, self.streams, self.dp, self.node = groups, weights, streams, dp, node
        self.rank, self.world = groups.local, groups.local_world
        self.stats = weights.stats  # one count of the node path's collectives
        scatter = streams.add_scatter()
        self._scatter_stream = scatter
        m = weights.map(max_numel)
        # One FP32 chunk (the layer's gradients widened, a chunk at a time: DISTRIBUTED.md section 2) and two shards.
        self._chunk = torch.empty(min(m.padded, m.chunk), dtype=torch.float32, device=device)
        self._shard = [torch.empty(m.shard_numel, dtype=torch.float32, device=device) for _ in range(2)]
        # bf16 slabs updated by shard: the rounded mean's shard (DISTRIBUTED.md section 2, "a bf16 slab")
        narrow = node.split is not None and any(d == torch.bfloat16 for d in grad_dtypes)
        self._shard_bf16 = ([torch.empty(m.shard_numel, dtype=torch.bfloat16, device=device) for _ in range(2)]
                            if narrow else [None, None])
        self._shard_free: list[Event] = [DONE, DONE]
        self._next = 0
        self._transit = node.transit()
        self._next_transit = 0
        self._last_land: Event = DONE  # a transit buffer is written again only after the previous layer landed

    def send(self, layer: int, group: FlatGroup, grads: list[torch.Tensor | None], after: Event,
             slab_after: tuple[Event, ...]) -> Event:
        m = self.weights.map(group.numel)
        k = self._next
        self._next ^= 1
        shard = self._shard[k][: m.shard_numel]
        if shard.device.type == "cuda":
            for g in grads:
                if g is not None:
                    g.record_stream(self._scatter_stream._stream)  # the allocator must not reuse it mid-scatter
        # Every gradient's [start, end) in the layer's flat layout (a frozen weight's: None, zeros in the sum).
        parts = [(s.offset, s.offset + s.numel, None if g is None else g.reshape(-1))
                 for s, g in zip(group.slots, grads)]

        # The bf16 shard of a bf16 slab updated by shard (the mean, see collectives() below), in the FP32 transit
        # buffer's bytes seen as bf16: each rank still writes and reads only its own ranges of it. Settled before the
        # scatter is queued: its stream may run collectives() at once.
        narrow = (self.node.split is not None and group.grad is not None and group.grad.dtype == torch.bfloat16)
        shard_bf16 = self._shard_bf16[k] if narrow else None
        spans = getattr(self.node, "spans_nodes", False)

        def collectives() -> None:
            at = 0
            for a, length in m.chunks():
                # The chunk buffer is reused chunk after chunk: the stream runs its collectives in order.
                chunk = self._chunk[:length]
                fill(chunk, a, parts)
                piece = length // self.world
                reduce_scatter_into(shard[at: at + piece], chunk, self.groups.scatter_group, stats=self.stats)
                at += piece
            if spans:  # nodes sharing one store (section 5b): the node's shard to the owner node's peer
                dist.reduce(shard, dst=self.node.peer(layer), group=self.groups.cross_scatter)
            elif self.groups.cross_scatter is not None:  # several nodes, each holding the model (section 5a)
                dist.all_reduce(shard, op=dist.ReduceOp.SUM, group=self.groups.cross_scatter)
            if narrow:
                # A bf16 slab updated by shard: the mean rounded to bf16 here, not on the host, so the shard crosses
                # the link in 2 bytes, not 4. The same product and the same rounding as the host's add of the FP32
                # sum into a zeroed bf16 slab (slab + sum x 1/W, then bf16), so one micro-batch per step (where a
                # bf16 slab is exact) gives the same bits; a later micro-batch's add rounds twice.
                shard_bf16[: shard.numel()].copy_(shard.mul_(1.0 / self.dp.world_size))

        def scatter() -> int:
            before = self.stats.scattered_bytes
            self.weights.guard(f"reduce-scattering the gradients of layer {layer} across the node", collectives)
            return self.stats.scattered_bytes - before

        scattered = self._scatter_stream.submit(scatter, (after, self._shard_free[k]), "scatter", layer)
        if spans and not self.node.node_owns(layer):
            self._shard_free[k] = scattered  # the sum went to the owner node: nothing lands here
            return scattered
        transit = self._transit[self._next_transit]
        self._next_transit ^= 1
        if narrow:
            transit = transit.view(torch.bfloat16)
        src = shard_bf16 if narrow else shard

        def to_host() -> int:
            nbytes, at = 0, 0
            for s, e in m.ranges(self.rank):
                end = min(e, group.numel)
                if s < end:  # clipped to the layer's parameters: the padding stays on the device
                    transit[s:end].copy_(src[at: at + end - s], non_blocking=True)
                    nbytes += (end - s) * src.element_size()
                at += e - s
            return nbytes

        copied = self.streams.d2h.submit(to_host, (scattered, self._last_land), "grad", layer)
        self._shard_free[k] = copied
        self._last_land = self.dp.submit_add_transit(layer, transit[: group.numel], group.grad,
                                                     (copied, *slab_after))
        return self._last_land


def fill(chunk: torch.Tensor, start: int, parts: list[tuple[int, int, torch.Tensor | None]]) -> None:
    """chunk <- the layer's flat elements [start, start + len(chunk)), widened to FP32, from its gradients `parts`
    ((begin, end, flat gradient or None) in the flat layout); zeros where no gradient reaches (a frozen weight,
    the padding)."""
    end = start + chunk.numel()
    covered = start
    for b, e, g in parts:
        lo, hi = max(b, start), min(e, end)
        if lo >= hi:
            continue
        if lo > covered:
            chunk[covered - start: lo - start].zero_()
        dst = chunk[lo - start: hi - start]
        if g is None:
            dst.zero_()
        else:
            dst.copy_(g[lo - b: hi - b])
        covered = hi
    if covered < end:
        chunk[covered - start:].zero_()  # the padding: summed like the rest, never read


@dataclass
class DataPath:
    """The data path this engine runs and why: what the start line and collect_stats() say."""

    name: str  # NODE or PER_RANK ("one process" for a lone process)
    why: str
    weights: NodeWeights | None = None

    def describe(self) -> str:
        return f"{self.name}: {self.why}"


def requested_path(config: object) -> str | None:
    """The configured data path (EngineConfig's `data_parallel_path`, checked there): NODE or PER_RANK as set, None
    where it is left to the rule ("auto": `plan`)."""
    return rule_or(getattr(config, "data_parallel_path", AUTO), lambda: None)


def why_not_split(config: object, optimizer: object) -> str | None:
    """Why the node path's update by shard (engine/update/by_shard.py) cannot run with these settings and this
    optimizer argument (None: it can)."""
    if getattr(config, "optimizer_in_backward", False):
        return "the optimizer in backward updates whole layers as their gradients land"
    if getattr(config, "nvme_path", None) is not None:
        return "the NVMe tier spills whole layers"
    if getattr(config, "host_master", "fp32") != "fp32":
        return f"host_master={config.host_master!r} (a hi/lo or bf16 master is whole-layer state; 'fp32' splits)"
    if optimizer is LATER:
        return ("the optimizer is handed over later (a face's prepare(model) then prepare(optimizer)): the update by "
                "shard is built over the optimizer given with the model")
    if isinstance(optimizer, torch.optim.Optimizer):
        return unsupported_reason(optimizer)
    if optimizer is not None and callable(optimizer):
        return "an optimizer factory (its type is known only once built; give the optimizer or use the default)"
    return None


def _why_not_ranks(dp: DataParallel | None, node: NodeStore | None, device: torch.device) -> str | None:
    """What the ranks and this torch must be for the node path (None: they are)."""
    if dp is None:
        return "one process"
    if node is None:
        return "each rank has its own host store (data_parallel_host='replicated'); the node path reads the node's one"
    if node.topo.local_world < 2:
        return "one rank per node: no node's ranks to share a layer's trip"
    if device.type == "cuda" and not torch.distributed.is_nccl_available():
        return "no NCCL in this torch for the GPUs' all-gather"
    return None


def why_not_node_early(dp: DataParallel | None, node: NodeStore | None, device: torch.device) -> str | None:
    """Why the node path cannot run here, from what is known before the store is built (None: it can)."""
    reason = _why_not_ranks(dp, node, device)
    if reason is not None:
        return reason
    if device.type == "cuda":
        n = min(node.topo.local_world, torch.cuda.device_count())
        for a in range(n):
            for b in range(n):
                if a != b and not torch.cuda.can_device_access_peer(a, b):
                    return f"no peer access (NVLink) between GPU {a} and GPU {b}"
    return None


def plan(node: NodeStore | None, dp: DataParallel | None, config: object, optimizer: object,
         device: torch.device) -> None:
    """Choose the data path before the host store is built (the update by shard changes which slabs each rank
    holds) and record it on the node's store for `attach`. "node" where it cannot run is refused; "auto" takes the
    node path only where its update by shard runs too, else the per-rank path."""
    if node is None:
        return
    asked = requested_path(config)
    reason = why_not_node_early(dp, node, device)
    if getattr(node, "spans_nodes", False):  # nodes sharing one store, several ranks each (shared_store.py)
        if reason is not None:
            raise ValueError(f"nodes sharing one store with several ranks per node take the node path, which cannot "
                             f"run here: {reason}")
        node.path = (NODE, "nodes sharing one store, several ranks per node")
        return
    if asked == NODE and reason is not None:
        raise ValueError(f"data_parallel_path='node' cannot run here: {reason}; use 'auto' or 'per_rank'")
    split = why_not_split(config, optimizer) if reason is None else reason
    if asked == NODE and split is not None and callable(optimizer) and why_not_split(config, None) is None:
        split = None  # asked for: a factory's optimizer is split, refused once built if it is not Adam/AdamW (choose.py)
    if asked == PER_RANK:
        node.path = (PER_RANK, "asked for")
    elif asked is None and device.type != "cuda" and not AUTO_ON_CPU:
        node.path = (PER_RANK, "'auto' on a CPU device: gloo ranks stand in for GPUs where data_parallel_path='node' "
                               "asks for it")
    elif asked is None and split is not None:
        node.path = (PER_RANK, f"'auto': {split}")
    else:
        node.path = (NODE, "asked for" if asked == NODE else "'auto'")
        if split is None:
            node.split_by_shard(CHUNK)


def why_not_node(dp: DataParallel | None, node: NodeStore | None, pipeline: LayerPipeline) -> str | None:
    """Why the node path cannot run here (None: it can)."""
    return _why_not_ranks(dp, node, pipeline.device)


def attach(pipeline: LayerPipeline, streams: Streams, dp: DataParallel | None, node: NodeStore | None,
           ranks: OneRank, config: object) -> DataPath:
    """Choose the data path and, for the node path, hand the pipeline its shard copies and gathers. Collective
    where it takes the node path (the node's groups are made over every rank): every rank calls it at the same
    point of the engine's construction, with the same setting."""
    if dp is None:
        return DataPath("one process", "no data parallel")
    reason = why_not_node(dp, node, pipeline)
    chosen, why = node.path if node is not None and node.path is not None else (PER_RANK, reason or "asked for")
    if chosen != NODE:
        return DataPath(PER_RANK, f"every rank streams every layer ({reason or why})")
    if reason is not None:
        raise ValueError(f"data_parallel_path='node' cannot run here: {reason}; use 'auto' or 'per_rank'")
    groups = node_groups(pipeline.device, dp.timeout)
    if groups.local_world != node.topo.local_world or groups.nodes != node.topo.node_ranks:
        raise ValueError(f"the node path's nodes {groups.nodes} differ from the shared host store's "
                         f"{node.topo.node_ranks}: set LOCAL_WORLD_SIZE and GROUP_RANK alike on every rank")
    spans = getattr(node, "spans_nodes", False)
    weights = SpanningWeights(groups, node, pipeline, CHUNK, dp) if spans else NodeWeights(groups, CHUNK, dp)
    pipeline.use_weights(weights)
    G = groups.local_world
    link = "over NVLink" if pipeline.device.type == "cuda" else "gloo ranks standing in for GPUs"
    # The gradients' node path replaces the shared store's per-rank sink (ranks.py SharedStore._reduce_to_owner);
    # the optimizer in backward's sink (an update behind each layer's reduction) still takes the per-rank way.
    if pipeline.grad_sink is not None and pipeline.grad_sink == ranks.grad_sink:
        dtypes = tuple({g.grad.dtype for g in pipeline.store.layers if g.grad is not None})
        pipeline.grad_shards = NodeGrads(groups, weights, streams, dp, node, pipeline.max_numel, pipeline.device,
                                         dtypes)
        grads = ("gradients reduce-scattered in FP32, each rank's shard to its ranges of its slab, each rank "
                 f"updating its 1/{G} of every layer" if node.split is not None else
                 "gradients reduce-scattered in FP32, each rank's shard to the layer's one slab, its owner updating it")
        if spans:
            grads = ("gradients reduce-scattered in FP32 in the node, each shard reduced to the owner node's peer, "
                     "to the layer's one slab there, its owner updating it")
    else:
        grads = "gradients per rank to the layer's owner (the optimizer in backward)"
    if spans:
        return DataPath(SHARED, f"{node.describe()} ({len(node.ranges)} nodes, {G} ranks per node, {link}); each "
                        f"layer's weights by shard on its owner node, broadcast to the peers and all-gathered in each "
                        f"node, {grads} ({why})", weights)
    return DataPath(NODE, f"one trip per layer per node, {G} ranks per node ({link}); weights by shard and "
                    f"all-gather, {grads} ({why})", weights)
