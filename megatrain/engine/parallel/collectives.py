"""The node path's collectives (docs/DISTRIBUTED.md): which rank owns which elements of a layer's flat buffer,
the all-gather of the weights and the FP32 reduce-scatter of the gradients over a process group, and the
node's process groups. The one module that knows what each backend provides.

Nothing in the engine calls it yet (DISTRIBUTED.md, "Steps to land it": step 1).

The shard map. A layer's flat buffer of `numel` elements is padded to a multiple of world·granule elements
(`padded_numel`) and cut into chunks of `chunk` elements (a multiple of world·granule; the last chunk is
shorter, but still such a multiple). Rank r owns the r-th of the world equal pieces of every chunk: one
contiguous range per chunk, the same number of elements on every rank. With one chunk (a layer shorter than
`chunk`) rank r owns [r·n/G, (r+1)·n/G), DISTRIBUTED.md section 1's map. Chunks bound the FP32 buffers of the
gradients' reduce-scatter (section 2); the weights' gather uses the same map, so a rank's shard copy reads
exactly the masters it updates. The granule keeps every piece's start aligned (64 elements: 128 bytes in bf16,
256 in FP32) for the copy engines and NCCL. Padding is not a parameter: an update skips it (`ShardMap.owned`).

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
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..host.node_store import node_key, topology_of

GRANULE = 64  # elements: every shard piece starts at a multiple (128 B in bf16, 256 B in FP32)
DEFAULT_CHUNK = 32 * 2**20  # elements per reduce-scatter chunk: 128 MiB of FP32 (DISTRIBUTED.md section 2)

# Backends with a native all-gather into one tensor and reduce-scatter of one tensor (torch >= 2.4).
NATIVE_BACKENDS = frozenset({"nccl", "gloo"})

# torch's names: the `*_single` ones where this torch has them (2.13 warns on the old ones), else the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# -- the shard map ------------------------------------------------------------------------------------------------

def padded_numel(numel: int, world: int, granule: int = GRANULE) -> int:
    """`numel` rounded up to a multiple of world·granule: what a layer's flat buffer holds on the node path."""
    _check_positive(world=world, granule=granule)
    if numel < 0:
        raise ValueError(f"numel={numel} must be >= 0")
    unit = world * granule
    return -(-numel // unit) * unit


def default_chunk(world: int, granule: int = GRANULE) -> int:
    """DEFAULT_CHUNK rounded down to a multiple of world·granule (at least one such unit)."""
    unit = world * granule
    return max(unit, DEFAULT_CHUNK // unit * unit)


@dataclass(frozen=True)
class ShardMap:
    """Which elements of one layer's (padded) flat buffer each of `world` ranks owns; see the module's doc."""

    numel: int  # the layer's elements (its parameters)
    world: int
    chunk: int
    granule: int = GRANULE

    def __post_init__(self) -> None:
        _check_positive(world=self.world, chunk=self.chunk, granule=self.granule)
        if self.numel < 0:
            raise ValueError(f"numel={self.numel} must be >= 0")
        if self.chunk % (self.world * self.granule):
            raise ValueError(f"chunk={self.chunk} elements is not a multiple of world x granule = {self.world} x "
                             f"{self.granule}: every chunk must split into equal aligned pieces; use "
                             f"default_chunk({self.world}) or a multiple of {self.world * self.granule}")

    @classmethod
    def of(cls, numel: int, world: int, chunk: int | None = None, granule: int = GRANULE) -> ShardMap:
        """The map with `chunk` elements per chunk (default_chunk(world) when None)."""
        return cls(numel, world, default_chunk(world, granule) if chunk is None else chunk, granule)

    @property
    def padded(self) -> int:
        return padded_numel(self.numel, self.world, self.granule)

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns (padding included): the same on every rank."""
        return self.padded // self.world

    def chunks(self) -> list[tuple[int, int]]:
        """(start, length) of every chunk of the padded buffer, in order; every length a multiple of world."""
        return [(a, min(self.chunk, self.padded - a)) for a in range(0, self.padded, self.chunk)]

    def ranges(self, rank: int) -> list[tuple[int, int]]:
        """[start, end) of rank `rank`'s piece of every chunk, in the padded buffer's coordinates."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank={rank} is outside a map of world={self.world}")
        out = []
        for a, length in self.chunks():
            piece = length // self.world
            out.append((a + rank * piece, a + (rank + 1) * piece))
        return out

    def owned(self, rank: int) -> list[tuple[int, int]]:
        """rank `rank`'s ranges clipped to the layer's parameters (no padding; empty ranges dropped): what its
        update reads and writes."""
        return [(a, min(b, self.numel)) for a, b in self.ranges(rank) if a < self.numel]


def shard_ranges(numel: int, world: int, chunk: int | None = None,
                 granule: int = GRANULE) -> list[list[tuple[int, int]]]:
    """Every rank's [start, end) ranges of a layer of `numel` elements (padded coordinates): the ownership map."""
    m = ShardMap.of(numel, world, chunk, granule)
    return [m.ranges(r) for r in range(world)]


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


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"{name}={v} must be >= 1")


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


def node_layout(keys: Sequence[str], local_world: Sequence[int | None],
                local_rank: Sequence[int | None]) -> list[list[int]]:
    """Global ranks of every node, from every rank's node key (node_store.node_key: host name and the launcher's
    node rank), LOCAL_WORLD_SIZE and LOCAL_RANK (None where unset). A host's ranks in rank order are one node, or
    several of LOCAL_WORLD_SIZE where it says so (ranks standing in for several nodes on one machine); a rank's
    index in its node must be its LOCAL_RANK where set. Nodes in order of their first rank."""
    sizes = {w for w in local_world if w is not None}
    if len(sizes) > 1:
        raise ValueError(f"ranks disagree on LOCAL_WORLD_SIZE ({sorted(sizes)}): every node needs the same number "
                         "of ranks on the node path; launch the same --nproc-per-node on every node")
    size = sizes.pop() if sizes else None
    nodes = []
    for host in topology_of(keys):
        step = size or len(host)
        if len(host) % step:
            raise ValueError(f"{len(host)} ranks on {keys[host[0]]!r} is not a multiple of LOCAL_WORLD_SIZE={step}")
        nodes += [host[i:i + step] for i in range(0, len(host), step)]
    counts = sorted({len(n) for n in nodes})
    if len(counts) > 1:
        raise ValueError(f"nodes run different numbers of ranks ({[len(n) for n in nodes]}); the node path needs "
                         "the same number on every node")
    for n in nodes:
        for index, r in enumerate(n):
            if local_rank[r] is not None and local_rank[r] != index:
                raise ValueError(f"rank {r} has LOCAL_RANK={local_rank[r]} but is rank {index} of its node "
                                 f"{n}: the launcher numbers a node's ranks otherwise than in rank order")
    return sorted(nodes, key=lambda n: n[0])


def node_groups(device: torch.device, timeout: datetime.timedelta) -> NodeGroups:
    """Build the node path's groups: collective over the default group's ranks (every rank makes every group, in
    the same order). NCCL on a GPU, gloo on the CPU; the groups are their own, apart from the host store's gloo
    groups (node_store.py), so the device collectives never interleave with the host threads' ones."""
    if not dist.is_initialized():
        raise ValueError("node_groups needs the default process group: call init_process_group first")
    world = dist.get_world_size()
    mine = (node_key(), _env_int("LOCAL_WORLD_SIZE"), _env_int("LOCAL_RANK"))
    every: list[tuple[str, int | None, int | None] | None] = [None] * world
    dist.all_gather_object(every, mine)
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


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "")
    if raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
