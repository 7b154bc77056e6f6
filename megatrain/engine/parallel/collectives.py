"""The node path's collectives (docs/DISTRIBUTED.md): which rank owns which elements of a layer's flat buffer,
the all-gather of the weights and the FP32 reduce-scatter of the gradients over a process group, and the
node's process groups. The one module that knows what each backend provides.

The engine's node path (node_path.py) calls it. The shard map itself is costs/shards.py's (plain arithmetic the
planner shares), re-exported here.

The backends. NCCL and gloo have both collectives in every torch this package supports (>= 2.4): torch 2.13
names them `all_gather_single` / `reduce_scatter_single` (the older `all_gather_into_tensor` /
`reduce_scatter_tensor` still run there, with a deprecation warning; torch before the rename has only those).
Measured on this CPU with torch 2.13: gloo's reduce-scatter is itself an all-reduce of the whole input and a
slice (its ring's sum order depends on the rank, so with 4 ranks it differs from a sequential sum in the last
bit), and it sums bf16 in bf16; its all-gather runs in place (the input a slice of the output). Any other
backend takes the stand-ins (`stand_in_for`, the one place that decides).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...costs.shards import (  # noqa: F401 - the map's names, re-exported where the collectives are
    DEFAULT_CHUNK,
    GRANULE,
    ShardMap,
    default_chunk,
    padded_numel,
    shard_ranges,
)
from ..host.node_store import node_layout, node_place

# Backends with a native all-gather into one tensor and reduce-scatter of one tensor (torch >= 2.4).
NATIVE_BACKENDS = frozenset({"nccl", "gloo"})

# torch's names: the `*_single` ones where this torch has them (2.13 warns on the old ones), else the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# -- the collectives ----------------------------------------------------------------------------------------------

@dataclass
class CollectiveStats:
    """What this rank's collectives moved, in bytes, as the node path's ring moves them (the stand-ins move more;
    they are counted the same): `gathered_bytes` the other ranks' pieces this rank received by all-gathers,
    `scattered_bytes` the FP32 pieces of its input that went to the other ranks by reduce-scatters."""

    gathered_bytes: int = 0
    scattered_bytes: int = 0


def _backend_of(group: dist.ProcessGroup | None, device: torch.device) -> str:
    """The backend that runs `group`'s collectives on `device` ("cpu:gloo,cuda:nccl" names one per device type)."""
    name = str(dist.get_backend(group))
    for part in name.split(","):
        dev, sep, backend = part.partition(":")
        if sep and dev == device.type:
            return backend
    return name


def stand_in_for(group: dist.ProcessGroup | None, device: torch.device, forced: bool | None = None) -> bool:
    """Whether `group`'s collectives on `device` take the stand-ins: the one place that decides (`forced`: a test's
    choice). A backend without a native all-gather into one tensor and reduce-scatter of one tensor gets
    `dist.all_gather` into views of the output (the same bytes, exact) and an all-reduce of the whole input and a
    slice (the same sum, twice the bytes of a ring reduce-scatter: a stand-in for tests and odd
    backends, not a path to run at scale)."""
    if forced is not None:
        return forced
    return _backend_of(group, device) not in NATIVE_BACKENDS


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                    stats: CollectiveStats | None = None, stand_in: bool | None = None) -> None:
    """out <- every rank's `shard` of `group`, in group-rank order; `shard` may be this rank's slice of `out`
    (in place, as the ring slot's shard copy lands). Exact: bytes are moved, not summed."""
    world = dist.get_world_size(group)
    _check_pair("all_gather_into", out, shard, world)
    if shard.dtype != out.dtype:
        raise ValueError(f"all_gather_into: shard dtype {shard.dtype} differs from out's {out.dtype}")
    if stand_in_for(group, out.device, stand_in):
        dist.all_gather(list(out.chunk(world)), shard, group=group)
    else:
        _ALL_GATHER(out, shard, group=group)
    if stats is not None:
        stats.gathered_bytes += (world - 1) * shard.numel() * shard.element_size()


def reduce_scatter_into(out: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                        stats: CollectiveStats | None = None, stand_in: bool | None = None) -> None:
    """out (FP32) <- this rank's piece (the group rank's world-th of `flat`) of the sum over `group` of every
    rank's `flat`, summed in FP32 (a bf16 or fp16 `flat` is widened first: the backends sum in the tensor's
    dtype). An FP32 `flat` is the collective's input as it is: its contents afterwards are unspecified (the
    stand-in sums into it). `out` must not overlap `flat` unless it is that piece of it."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_pair("reduce_scatter_into", flat, out, world)
    if out.dtype != torch.float32:
        raise ValueError(f"reduce_scatter_into: out is {out.dtype}; it must be torch.float32 (the sum is FP32)")
    if not flat.is_floating_point():
        raise ValueError(f"reduce_scatter_into: flat is {flat.dtype}; gradients are floating point")
    if flat.dtype != torch.float32:
        flat = flat.to(torch.float32)
    if stand_in_for(group, out.device, stand_in):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        out.copy_(flat.chunk(world)[rank])
    else:
        _REDUCE_SCATTER(out, flat, op=dist.ReduceOp.SUM, group=group)
    if stats is not None:
        stats.scattered_bytes += (world - 1) * out.numel() * out.element_size()


def gather_layer(buf: torch.Tensor, smap: ShardMap, group: dist.ProcessGroup | None = None, *,
                 stats: CollectiveStats | None = None, stand_in: bool | None = None) -> None:
    """`buf` (a layer's padded flat buffer) whole on every rank, from each rank's own ranges of it (`smap`):
    one in-place all-gather per chunk."""
    _check_layer("gather_layer", buf, smap, group)
    rank = dist.get_rank(group)
    for (a, length), (s, e) in zip(smap.chunks(), smap.ranges(rank)):
        all_gather_into(buf[a:a + length], buf[s:e], group, stats=stats, stand_in=stand_in)


def reduce_scatter_layer(out: torch.Tensor, flat: torch.Tensor, smap: ShardMap,
                         group: dist.ProcessGroup | None = None, *, stats: CollectiveStats | None = None,
                         stand_in: bool | None = None) -> None:
    """out (FP32, smap.shard_numel) <- the FP32 sum over `group` of every rank's `flat` (a layer's padded flat
    gradients, any float dtype) at this rank's ranges, in order: one reduce-scatter per chunk, each chunk
    widened into an FP32 copy (`flat` itself is left as it was)."""
    _check_layer("reduce_scatter_layer", flat, smap, group)
    if out.numel() != smap.shard_numel:
        raise ValueError(f"reduce_scatter_layer: out has {out.numel()} elements; this map's shard has "
                         f"{smap.shard_numel}")
    at = 0
    for a, length in smap.chunks():
        piece = length // smap.world
        chunk = flat[a:a + length].to(torch.float32, copy=True)
        reduce_scatter_into(out[at:at + piece], chunk, group, stats=stats, stand_in=stand_in)
        at += piece


def _check_pair(what: str, whole: torch.Tensor, piece: torch.Tensor, world: int) -> None:
    for name, t in (("whole", whole), ("piece", piece)):
        if not t.is_contiguous():
            raise ValueError(f"{what}: the {name} tensor is not contiguous; collectives read flat memory")
    if whole.numel() != world * piece.numel():
        raise ValueError(f"{what}: {whole.numel()} elements is not world={world} x {piece.numel()}; pad the "
                         "layer with padded_numel() and cut it with ShardMap")
    if whole.device != piece.device:
        raise ValueError(f"{what}: tensors on {whole.device} and {piece.device}; both must be on one device")


def _check_layer(what: str, buf: torch.Tensor, smap: ShardMap, group: dist.ProcessGroup | None) -> None:
    world = dist.get_world_size(group)
    if smap.world != world:
        raise ValueError(f"{what}: the map is for world={smap.world}, the group has {world} ranks")
    if buf.dim() != 1 or buf.numel() != smap.padded:
        raise ValueError(f"{what}: buffer of shape {tuple(buf.shape)}; it must be flat with the map's padded "
                         f"{smap.padded} elements ({smap.numel} padded to a multiple of {world} x {smap.granule})")


# -- the node's groups --------------------------------------------------------------------------------------------

@dataclass
class NodeGroups:
    """This rank's place on the node path: its node's groups of G ranks and its peers' groups across nodes (the
    same local index on every node; None with one node), one of each per stream that issues collectives.

    Why one group per stream: every rank must issue a group's collectives in the same order, and the weights'
    gathers and the gradients' reduce-scatters are issued by two streams (threads on the CPU) that interleave
    differently on each rank; NCCL also runs one group's collectives one after another, where two groups let a
    layer's gather (the recompute's) overlap another's reduce-scatter."""

    gather_group: dist.ProcessGroup  # the weights' all-gathers (the gather stream)
    scatter_group: dist.ProcessGroup  # the gradients' reduce-scatters (the scatter stream)
    cross_gather: dist.ProcessGroup | None  # across nodes: a layer's weights from its owner node (section 5b)
    cross_scatter: dist.ProcessGroup | None  # across nodes: the gradient shard's all-reduce / reduce (5a, 5b)
    nodes: list[list[int]]  # global ranks of every node, each in local order
    node: int  # this rank's node
    local: int  # this rank's index in its node: its shard (its rank in the node's groups)

    @property
    def local_world(self) -> int:
        return len(self.nodes[0])


def node_groups(device: torch.device, timeout: datetime.timedelta) -> NodeGroups:
    """Build the node path's groups: collective over the default group's ranks (every rank makes every group, in
    the same order). NCCL on a GPU, gloo on the CPU; the groups are their own, apart from the host store's gloo
    groups (node_store.py), so the device collectives never interleave with the host threads' ones."""
    if not dist.is_initialized():
        raise ValueError("node_groups needs the default process group: call init_process_group first")
    every: list[tuple[str, int | None, int | None] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, node_place())
    nodes = node_layout([e[0] for e in every], [e[1] for e in every], [e[2] for e in every])
    backend = "nccl" if device.type == "cuda" else "gloo"
    peers = [[n[j] for n in nodes] for j in range(len(nodes[0]))]

    def groups(members: list[list[int]]) -> dist.ProcessGroup:
        return dist.new_subgroups_by_enumeration(members, timeout=timeout, backend=backend)[0]

    gather, scatter = groups(nodes), groups(nodes)
    cross_gather, cross_scatter = (groups(peers), groups(peers)) if len(nodes) > 1 else (None, None)
    rank = dist.get_rank()
    node = next(i for i, n in enumerate(nodes) if rank in n)
    return NodeGroups(gather, scatter, cross_gather, cross_scatter, nodes, node, nodes[node].index(rank))
