"""The node path (docs/DISTRIBUTED.md): which data path a data-parallel engine runs, and the objects that make the
node path's layer loads one trip per layer per node.

Landed so far (DISTRIBUTED.md "Steps to land it", step 2): the weights. Each of the node's G ranks copies its
1/G of a streamed layer's flat buffer host-to-device (`NodeWeights.copy_shard`, its ranges of the shard map,
costs/shards.py) and the node's ranks all-gather the rest on the gather stream (`NodeWeights.gather`,
collectives.py); the recompute in backward loads, so gathers, again. Gradients still go the per-rank way
(ranks.py SharedStore: every rank's whole gradient to the layer's owner), so the node path needs the shared host
store: the shard copies read the node's one store, which the layers' owners update.

Which path runs: `data_parallel_path` "node" asks for the node path and is refused where it cannot run; "auto"
(the default) and "per_rank" run the per-rank path until DISTRIBUTED.md step 6 makes "auto" choose. Until
EngineConfig has the field, the setting is read from the environment (DATA_PATH_ENV), where a launcher passes it
to every rank alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ...costs.shards import ShardMap, padded_numel
from ..host.node_store import NodeStore
from ..pipeline.schedule import LayerPipeline
from ..runtime.stream import Streams
from .collectives import CollectiveStats, NodeGroups, gather_layer, node_groups
from .distributed import DataParallel

DATA_PATH_ENV = "MEGATRAIN_DATA_PARALLEL_PATH"
NODE, PER_RANK, AUTO = "node", "per_rank", "auto"


class NodeWeights:
    """The pipeline's ShardedWeights on the node path: this rank's shard copy and the node's all-gather of a layer,
    with the shard map of each layer size made once. `stats` counts what the gathers received."""

    def __init__(self, groups: NodeGroups, chunk: int | None = None) -> None:
        self.groups = groups
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

    def gather(self, buffer: torch.Tensor, numel: int) -> int:
        m = self.map(numel)
        before = self.stats.gathered_bytes
        gather_layer(buffer[: m.padded], m, self.groups.gather_group, stats=self.stats)
        return self.stats.gathered_bytes - before

    def reset_counters(self) -> None:
        self.stats = CollectiveStats()


@dataclass
class DataPath:
    """The data path this engine runs and why: what the start line and collect_stats() say."""

    name: str  # NODE or PER_RANK ("one process" for a lone process)
    why: str
    weights: NodeWeights | None = None

    def describe(self) -> str:
        return f"{self.name}: {self.why}"

    def stats(self) -> dict[str, float]:
        """The node path's collective bytes since the last reset (none on the per-rank path)."""
        if self.weights is None:
            return {}
        s = self.weights.stats
        return {"gathered_bytes": s.gathered_bytes, "scattered_bytes": s.scattered_bytes}

    def reset_counters(self) -> None:
        if self.weights is not None:
            self.weights.reset_counters()


def requested_path(config: object) -> str:
    """The configured data path: EngineConfig's `data_parallel_path` where it has one, else DATA_PATH_ENV, else
    "auto"."""
    value = getattr(config, "data_parallel_path", None) or os.environ.get(DATA_PATH_ENV, "") or AUTO
    if value not in (NODE, PER_RANK, AUTO):
        raise ValueError(f"data_parallel_path={value!r}: use {AUTO!r}, {NODE!r} or {PER_RANK!r}")
    return value


def why_not_node(dp: DataParallel | None, node: NodeStore | None, pipeline: LayerPipeline) -> str | None:
    """Why the node path cannot run here (None: it can)."""
    if dp is None:
        return "one process"
    if node is None:
        return "each rank has its own host store (data_parallel_host='replicated'); the node path reads the node's one"
    if node.topo.local_world < 2:
        return "one rank per node: no node's ranks to share a layer's trip"
    if pipeline.device.type == "cuda" and not torch.distributed.is_nccl_available():
        return "no NCCL in this torch for the GPUs' all-gather"
    return None


def attach(pipeline: LayerPipeline, streams: Streams, dp: DataParallel | None, node: NodeStore | None,
           config: object) -> DataPath:
    """Choose the data path and, for the node path, hand the pipeline its shard copies and gathers. Collective
    where it takes the node path (the node's groups are made over every rank): every rank calls it at the same
    point of the engine's construction, with the same setting."""
    if dp is None:
        return DataPath("one process", "no data parallel")
    asked = requested_path(config)
    reason = why_not_node(dp, node, pipeline)
    if asked != NODE:
        why = reason or ("asked for" if asked == PER_RANK else "the default until the node path lands whole "
                         "(docs/DISTRIBUTED.md step 6)")
        return DataPath(PER_RANK, f"every rank streams every layer ({why})")
    if reason is not None:
        raise ValueError(f"data_parallel_path='node' cannot run here: {reason}; use 'auto' or 'per_rank'")
    groups = node_groups(pipeline.device, dp.timeout)
    if groups.local_world != node.topo.local_world or groups.nodes != node.topo.node_ranks:
        raise ValueError(f"the node path's nodes {groups.nodes} differ from the shared host store's "
                         f"{node.topo.node_ranks}: set LOCAL_WORLD_SIZE and GROUP_RANK alike on every rank")
    weights = NodeWeights(groups)
    pipeline.use_weights(weights)
    streams.gather.trace = streams.trace
    G = groups.local_world
    link = "over NVLink" if pipeline.device.type == "cuda" else "gloo ranks standing in for GPUs"
    return DataPath(NODE, f"one trip per layer per node, {G} ranks per node ({link}); weights by shard and "
                    "all-gather, gradients per rank to the layer's owner", weights)
