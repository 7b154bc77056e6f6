"""One host store per node: the data-parallel ranks of a machine share the decoder layers' weights, and each
rank owns every N-th layer (its gradient slab, its optimizer update, its Adam state).

Why: host memory is what MegaTrain lives on. With a private store per rank, N GPUs on a node would need N
copies of the masters, gradients and Adam state (16 B/param each); here the node holds one of each.

- The layers' FP32 masters (and bf16 shadows) are files in /dev/shm, created by the node's first rank,
  mapped by every rank of the node, and unlinked as soon as all have mapped them: the memory goes back to the
  system when the last rank exits, whatever way it exits.
- Layer i belongs to the node's rank i % N. Every micro-batch's gradients of layer i are summed into the
  owner's slab (each rank's slot in /dev/shm, a node barrier, the owner adds them: `reduce_to_owner`), divided by
  the world size; with several nodes the owners of layer i (the same local index on every node) all-reduce
  that sum first. No other rank has a slab for the layer.
- Only the owner's optimizer ever sees a gradient for the layer's parameters (the others' stay None), so
  torch's optimizers never create Adam state for a layer a rank does not own: the state is sharded without
  the optimizer knowing. The owner updates the shared master in place; the step ends with a node barrier so
  no rank loads a layer its owner is still writing.
- The resident parameters (embedding, final norm, head) stay per rank, averaged as before: every rank holds
  them on its device anyway, and they are a small part of a large model.

On the node path with its update by shard (engine/parallel/node_path.py plan, engine/update/by_shard.py) the
ownership is by range instead (`Split`): every rank owns its ranges of every layer (the shard map's), holds a slab
it writes only there, updates them, and the layers' Adam moments are the node's too (`register_shared_state`).

Across nodes each node holds its own copy (not sharded further): every node's GPUs stream every layer each
step over their own host links, so a node without a layer's weights would fetch them over the network each
step, and one copy per node is what one GPU needs already. Where one node's host cannot hold that copy, the nodes
share one store (parallel/shared_store.py): with several ranks per node each node's store holds its own block of
layers only (`SpanningNodeStore`), the others' weights coming over the network.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from ...costs.pinning import mapped_bytes
from ...costs.shards import ShardMap
from .pinned import host_buffer

SHM_DIR = "/dev/shm"
# The shared buffers a node updated by shard allocates by rank (NodeStore._first_touch): every layer's, by its ranges.
FIRST_TOUCHED = ("layer weights", "optimizer state")
SHARD_KEY = "megatrain_shard_of_rank"  # in an optimizer state_dict taken on a rank other than 0: partial


class Topology(NamedTuple):
    node: int  # this rank's node index
    nodes: int
    local: int  # this rank's index among its node's ranks (ordered by global rank)
    local_world: int
    node_ranks: list[list[int]]  # global ranks of every node


def node_key() -> str:
    """What tells nodes apart: the host name, and the launcher's node rank (two agents on one machine, as a
    multi-node launch tested on one host, are two nodes)."""
    return f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '')}"


def topology_of(keys: Sequence[str]) -> list[list[int]]:
    """Global ranks per node, nodes in order of their first rank."""
    order: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        order.setdefault(key, []).append(rank)
    return list(order.values())


def node_layout(keys: Sequence[str], local_world: Sequence[int | None],
                local_rank: Sequence[int | None], check_local_rank: bool = True) -> list[list[int]]:
    """Global ranks of every node, from every rank's node key (node_store.node_key: host name and the launcher's
    node rank), LOCAL_WORLD_SIZE and LOCAL_RANK (None where unset). A host's ranks in rank order are one node, or
    several of LOCAL_WORLD_SIZE where it says so (ranks standing in for several nodes on one machine); a rank's
    index in its node must be its LOCAL_RANK where set (`check_local_rank`: the node path's devices follow it).
    Nodes in order of their first rank. The shared host store and the node path's groups both read this, so the
    ranks that share a store are the ranks that gather and reduce-scatter together."""
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
    for n in nodes if check_local_rank else ():
        for index, r in enumerate(n):
            if local_rank[r] is not None and local_rank[r] != index:
                raise ValueError(f"rank {r} has LOCAL_RANK={local_rank[r]} but is rank {index} of its node "
                                 f"{n}: the launcher numbers a node's ranks otherwise than in rank order")
    return sorted(nodes, key=lambda n: n[0])


def node_place() -> tuple[str, int | None, int | None]:
    """What this rank tells the others about its place: its node key, LOCAL_WORLD_SIZE and LOCAL_RANK (None where
    the launcher left them unset)."""
    return node_key(), _env_int("LOCAL_WORLD_SIZE"), _env_int("LOCAL_RANK")


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "")
    if raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def page_ranges(numel: int, itemsize: int, ranges: Sequence[tuple[int, int]],
                page: int = mmap.PAGESIZE) -> list[tuple[int, int]]:
    """(offset, length) in bytes of the whole pages inside the element `ranges` (clipped to `numel`) of a buffer of
    `numel` elements: what a rank can allocate of its ranges without taking a page its neighbour's range shares."""
    out = []
    for a, b in ranges:
        lo = -(-a * itemsize // page) * page
        hi = min(b, numel) * itemsize // page * page
        if hi > lo:
            out.append((lo, hi - lo))
    return out


class Split:
    """The node path's update by shard (docs/DISTRIBUTED.md section 3): every local rank owns its ranges of every
    layer (the shard map's, costs/shards.py), not whole layers: its slab's ranges, its team's update of them, its
    share of the node's one Adam state. `chunk`: the shard map's chunk (None: the default)."""

    def __init__(self, node: NodeStore, chunk: int | None) -> None:
        self.node, self.chunk = node, chunk
        self.local, self.world = node.topo.local, node.topo.local_world
        self._ranges: dict[int, list[tuple[int, int]]] = {}

    def ranges(self, numel: int) -> list[tuple[int, int]]:
        """This rank's [start, end) ranges of a layer of `numel` elements (no padding)."""
        got = self._ranges.get(numel)
        if got is None:
            got = self._ranges[numel] = ShardMap.of(numel, self.world, self.chunk).owned(self.local)
        return got


# The layers' shared buffers of a store updated by shard (the tensor objects themselves, held weakly): what tells the
# update path (engine/update) that a store it is handed is split, without a link from the store to its node.
_SPLIT_OF: dict[int, tuple[weakref.ref, Split]] = {}


def split_of(t: torch.Tensor | None) -> Split | None:
    """The update by shard that `t` (a layer's shared master or shadow, as the store holds it) belongs to, or None
    (owners of whole layers, or a private store)."""
    entry = _SPLIT_OF.get(id(t)) if t is not None else None
    return entry[1] if entry is not None and entry[0]() is t else None


def _mark_split(t: torch.Tensor, split: Split) -> None:
    key = id(t)

    def gone(ref: weakref.ref) -> None:
        if _SPLIT_OF.get(key, (None,))[0] is ref:  # not a later tensor's entry under the same id
            del _SPLIT_OF[key]

    _SPLIT_OF[key] = (weakref.ref(t, gone), split)


class NodeStore:
    """This rank's node: its groups, which layers it owns, and the node's shared host buffers."""

    def __init__(self, rank: int, group: dist.ProcessGroup, timeout, watchdog_s: float) -> None:
        world = dist.get_world_size(group)
        every: list[tuple[str, int | None, int | None] | None] = [None] * world
        dist.all_gather_object(every, node_place(), group=group)
        try:
            nodes = node_layout([e[0] for e in every], [e[1] for e in every], [e[2] for e in every],
                                check_local_rank=False)
        except ValueError as exc:
            raise ValueError(f"{exc} (the shared host store; or data_parallel_host='replicated')") from None
        node = next(i for i, n in enumerate(nodes) if rank in n)
        self.topo = Topology(node, len(nodes), nodes[node].index(rank), len(nodes[node]), nodes)
        self.rank, self.world = rank, world
        self.watchdog_s = watchdog_s
        # Collective: every rank makes every group, in the same order.
        self.node_group, _ = dist.new_subgroups_by_enumeration(nodes, timeout=timeout, backend="gloo")
        # The "layer updated" tokens run on a thread of their own: a group of their own keeps them from
        # interleaving with the gradient reductions of the node group.
        self.update_group, _ = dist.new_subgroups_by_enumeration(nodes, timeout=timeout, backend="gloo")
        self._token = torch.zeros(1, dtype=torch.int64)
        self.cross_group = None
        if len(nodes) > 1:
            cross = [[n[j] for n in nodes] for j in range(self.topo.local_world)]
            self.cross_group, _ = dist.new_subgroups_by_enumeration(cross, timeout=timeout, backend="gloo")
        self.staging: list[list[torch.Tensor]] = []  # per local rank, two FP32 slots (make_staging)
        self._slot = 0
        # The node path's update by shard (set by node_path.plan before the store is built): every rank owns its ranges
        # of every layer, so `owns` is True for all of them (each rank has a slab for its ranges and updates them).
        self.split: Split | None = None
        self.path: tuple[str, str] | None = None  # the data path node_path.plan chose, and why

    def split_by_shard(self, chunk: int | None) -> Split:
        """Own every layer by ranges from now on (before the store's layers are made)."""
        self.split = Split(self, chunk)
        return self.split

    # -- ownership ------------------------------------------------------------------------------------
    @property
    def leader(self) -> bool:
        return self.topo.local == 0

    def owner_local(self, layer: int) -> int:
        return layer % self.topo.local_world

    def owns(self, layer: int) -> bool:
        return self.split is not None or self.owner_local(layer) == self.topo.local

    def owner_rank(self, layer: int) -> int:
        return self.topo.node_ranks[self.topo.node][self.owner_local(layer)]

    def barrier(self) -> None:
        dist.barrier(group=self.node_group)

    def publish(self, layer: int) -> None:
        """Every rank of the node, for each layer in the same order: returns once the layer's owner (which calls it
        after its update) has, so its new weights are in the shared store. A collective through the kernel's
        sockets: the owner's writes are visible to the others after it, whatever the CPU's memory ordering. Updated
        by shard, every rank writes its ranges: a barrier, each rank calling it after its own update of the layer
        (a streamed layer's own shard copy needs none, but a layer kept whole on a device, or read whole, does)."""
        if self.split is not None:
            dist.barrier(group=self.update_group)
            return
        dist.broadcast(self._token, src=self.owner_rank(layer), group=self.update_group)

    # -- shared buffers -------------------------------------------------------------------------------
    def buffers(self, specs: Sequence[tuple[int, torch.dtype]], what: str) -> list[torch.Tensor]:
        """One zero-filled host tensor per (numel, dtype), the same memory on every rank of the node."""
        leader_rank = self.topo.node_ranks[self.topo.node][0]
        token = [secrets.token_hex(6) if self.leader else None]
        dist.broadcast_object_list(token, src=leader_rank, group=self.node_group)
        paths = [os.path.join(SHM_DIR, f"megatrain-{token[0]}-{k}") for k in range(len(specs))]
        sizes = [mapped_bytes(n * torch.empty((), dtype=d).element_size()) for n, d in specs]
        touch = self._first_touch(specs, what)
        if touch is None:
            error = [self._create(paths, sizes, what) if self.leader else None]
            dist.broadcast_object_list(error, src=leader_rank, group=self.node_group)
        else:
            error = [self._reserve_by_rank(paths, sizes, touch, what, leader_rank)]
        if error[0] is not None:
            raise MemoryError(error[0])
        out, failed = [], None
        try:
            for path, (n, dtype) in zip(paths, specs):
                fd = os.open(path, os.O_RDWR)
                try:
                    out.append(host_buffer(n, dtype, fd))
                finally:
                    os.close(fd)  # the mapping keeps the file's memory
        except OSError as exc:
            failed = f"rank {self.rank} could not map the node's shared {what}: {exc}"
        errors: list[str | None] = [None] * self.topo.local_world
        dist.all_gather_object(errors, failed, group=self.node_group)
        if self.leader:  # every rank has mapped them (or failed): the names are no longer needed
            for path in paths:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        bad = [e for e in errors if e is not None]
        if bad:
            raise MemoryError(bad[0])
        if self.split is not None and what == "layer weights":
            for t in out:
                _mark_split(t, self.split)
        return out

    def _first_touch(self, specs: Sequence[tuple[int, torch.dtype]], what: str) -> list[list[tuple[int, int]]] | None:
        """This rank's (offset, length) byte ranges of each file to allocate before the leader allocates the rest, or
        None (the leader allocates it all). Updated by shard, a rank's team reads and writes its ranges of every
        layer's weights and Adam state (docs/DISTRIBUTED.md section 3): tmpfs puts a page on the NUMA node of the CPU
        that allocates it, and this rank's threads are on its GPU's node (runtime/numa.py bind_host, before the
        store), so its ranges land in its socket's memory."""
        if self.split is None or what not in FIRST_TOUCHED or self.topo.local_world < 2:
            return None
        return [page_ranges(n, torch.empty((), dtype=d).element_size(), self.split.ranges(n)) for n, d in specs]

    def _reserve_by_rank(self, paths: list[str], sizes: list[int], touch: list[list[tuple[int, int]]], what: str,
                         leader_rank: int) -> str | None:
        """Collective over the node: the leader creates the files unallocated, every rank allocates its `touch`
        ranges, the leader checks that every rank succeeded and allocates the rest (the boundary pages, padding).
        The shortfall message, the same on every rank, or None: nobody maps a file not wholly allocated."""
        made = [self._create(paths, sizes, what, reserve=False) if self.leader else None]
        dist.broadcast_object_list(made, src=leader_rank, group=self.node_group)
        if made[0] is not None:
            return made[0]
        failed = None
        try:
            for path, ranges in zip(paths, touch):
                fd = os.open(path, os.O_RDWR)
                try:
                    for offset, length in ranges:
                        os.posix_fallocate(fd, offset, length)
                finally:
                    os.close(fd)
        except OSError as exc:
            failed = exc
        errors: list[OSError | None] = [None] * self.topo.local_world
        dist.all_gather_object(errors, failed, group=self.node_group)
        error = [None]
        if self.leader:
            error[0] = self._fill(paths, sizes, what, next((e for e in errors if e is not None), None))
        dist.broadcast_object_list(error, src=leader_rank, group=self.node_group)
        return error[0]

    @staticmethod
    def _create(paths: list[str], sizes: list[int], what: str, reserve: bool = True) -> str | None:
        """Create the files with their memory reserved now (a sparse file would SIGBUS on first touch of a page
        /dev/shm cannot supply); an error message naming the shortfall, or None. `reserve` False: sized only, for
        the node's ranks to allocate (`_reserve_by_rank`) before anyone maps them."""
        made = []
        try:
            for path, size in zip(paths, sizes):
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                made.append(path)
                try:
                    if reserve:
                        os.posix_fallocate(fd, 0, size)
                    else:
                        os.ftruncate(fd, size)
                finally:
                    os.close(fd)
        except OSError as exc:
            for path in made:
                os.unlink(path)
            return NodeStore._shortfall(sizes, what, exc)
        return None

    @staticmethod
    def _fill(paths: list[str], sizes: list[int], what: str, failed: OSError | None) -> str | None:
        """The rest of every file allocated, where no rank failed (`failed`: the first rank's error); else, or where
        this fails, the files removed and the shortfall message."""
        try:
            if failed is not None:
                raise failed
            for path, size in zip(paths, sizes):
                fd = os.open(path, os.O_RDWR)
                try:
                    os.posix_fallocate(fd, 0, size)  # allocates only what no rank did
                finally:
                    os.close(fd)
        except OSError as exc:
            for path in paths:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            return NodeStore._shortfall(sizes, what, exc)
        return None

    @staticmethod
    def _shortfall(sizes: list[int], what: str, exc: OSError) -> str:
        st = os.statvfs(SHM_DIR)
        return (f"the node's shared {what} need {sum(sizes) / 2**30:.2f} GiB in {SHM_DIR}, which has "
                f"{st.f_bavail * st.f_frsize / 2**30:.2f} GiB free ({exc}). Enlarge it (in a container: "
                "--shm-size; else mount -o remount,size=...), or set data_parallel_host='replicated'")

    # -- gradients ------------------------------------------------------------------------------------
    def make_staging(self, numel: int) -> None:
        """Every rank's two FP32 gradient slots of `numel` (the largest layer), in the node's shared memory.
        Collective: every rank of the node maps every rank's slots."""
        n = self.topo.local_world
        bufs = self.buffers([(numel, torch.float32)] * (2 * n), "gradient staging")
        self.staging = [bufs[2 * r: 2 * r + 2] for r in range(n)]

    def reduce_to_owner(self, layer: int, grads: torch.Tensor, slab: torch.Tensor | None) -> int:
        """slab += (sum over every rank's `grads` of `layer`) / world, on the layer's owner (who passes its slab);
        the others pass None. Returns the bytes this rank staged.

        Through shared memory, not a collective's sockets (several times slower than a memory add): every rank
        writes its gradients into its own slot, a node barrier, then the owner adds the node's slots. Every rank
        runs these in the same layer order on one thread, two slots in turn, so a slot is written again only
        after the next layer's barrier, which every rank passes only once the owner has finished reading it.
        """
        n = grads.numel()
        slot = self._slot
        self._slot ^= 1
        mine = self.staging[self.topo.local][slot][:n]
        mine.copy_(grads.reshape(-1))  # widened to FP32 here when the device computes in bf16
        dist.barrier(group=self.node_group)  # every rank's slot holds this layer (the barrier orders the memory)
        if slab is not None:
            for r, slots in enumerate(self.staging):
                if r != self.topo.local:
                    mine.add_(slots[slot][:n])
            if self.cross_group is not None:
                dist.all_reduce(mine, op=dist.ReduceOp.SUM, group=self.cross_group)
            slab.add_(mine, alpha=1.0 / self.world)
        return n * mine.element_size()


    # -- gradients on the node path (docs/DISTRIBUTED.md section 2) ----------------------------------------------
    def transit(self) -> list[torch.Tensor]:
        """The node path's two FP32 layer buffers in the node's shared memory: each rank writes its reduce-scattered
        shard of a layer into its own ranges of one (the sum is already taken, on the devices), the layer's owner
        adds the whole into its slab (`add_transit`). They are the first rank's staging slots, which the node path
        leaves unused otherwise (its layers' gradients never go through `reduce_to_owner`)."""
        return self.staging[0]

    def add_transit(self, layer: int, transit: torch.Tensor, slab: torch.Tensor | None) -> int:
        """slab += transit / world on the layer's owner (who passes its slab; the others None), once every rank of
        the node has written its shard of `layer` into `transit`: a node barrier, then one add of one layer (no
        sum of G slots: the ranks' sum was the reduce-scatter's). Returns the bytes the owner read.

        Every rank runs these in the same layer order on one thread, two transit buffers in turn; a rank writes a
        buffer again (its shard of the layer after next) only after this rank passed the next layer's barrier,
        which the owner of this layer reaches only once it has read the buffer (the caller orders that write
        behind this job).

        Updated by shard (`split`): every rank adds its own ranges into its own slab, which only it reads (no
        barrier: nobody waits for another rank's shard)."""
        if self.split is not None:
            if slab is None:
                return 0
            nbytes = 0
            # a bf16 transit holds the mean already, rounded on the device (node_path.NodeGrads): added as it is
            alpha = 1.0 if transit.dtype == torch.bfloat16 else 1.0 / self.world
            for a, b in self.split.ranges(slab.numel()):
                slab[a:b].add_(transit[a:b], alpha=alpha)
                nbytes += (b - a) * transit.element_size()
            return nbytes
        dist.barrier(group=self.node_group)  # every rank's shard is in (the barrier orders the memory)
        if slab is None:
            return 0
        slab.add_(transit, alpha=1.0 / self.world)
        return transit.numel() * transit.element_size()

class SpanningNodeStore(NodeStore):
    """A node's store when the nodes share one store with several ranks per node (docs/DISTRIBUTED.md section 5b):
    the node holds the host state of its own block of layers only (`ranges[node]`), in its shared memory as a node's
    store does (each of those layers owned by one local rank, i % G: its slab, its update, its Adam state), and one
    node-shared scratch layer of each buffer kind that the other nodes' layers' parameters view (no slab, no state:
    their weights come from their owner node by broadcast, parallel/node_path.py). To the host store it is a node's
    store (`shares_across_nodes` False: its layers are the node's shared buffers); `spans_nodes` tells the ranks."""

    spans_nodes = True
    shares_across_nodes = False  # (host/store.py: the node's layers are shared buffers, not a rank's own)

    def __init__(self, rank: int, group: dist.ProcessGroup, timeout, watchdog_s: float,
                 ranges: list[tuple[int, int]]) -> None:
        super().__init__(rank, group, timeout, watchdog_s)
        self.ranges = ranges
        self.first, self.stop = ranges[self.topo.node]
        self.layers = ranges[-1][1]
        self.owner_node_of = [n for n, (a, b) in enumerate(ranges) for _ in range(a, b)]
        # The clip norm's all-reduce over every rank (each layer's slab is on one rank of the job): a gloo group of
        # its own, on the training thread, apart from the gradient thread's groups.
        self.world_group = dist.new_group(backend="gloo", timeout=timeout)
        self.shm_bytes = 0  # what this node's shared memory holds (every rank of the node counts the same)

    def node_owns(self, layer: int) -> bool:
        return self.first <= layer < self.stop

    def owns(self, layer: int) -> bool:
        return self.node_owns(layer) and self.owner_local(layer) == self.topo.local

    def owner_rank(self, layer: int) -> int:
        return self.topo.node_ranks[self.owner_node_of[layer]][self.owner_local(layer)]

    def peer(self, layer: int) -> int:
        """The global rank of this rank's peer (the same local index) on the node that owns `layer`."""
        return self.topo.node_ranks[self.owner_node_of[layer]][self.topo.local]

    def split_by_shard(self, chunk: int | None) -> Split:
        raise ValueError("nodes sharing one store with several ranks per node update each layer whole, by one of the "
                         "owner node's ranks (the update by shard across nodes is not built)")

    def buffers(self, specs: Sequence[tuple[int, torch.dtype]], what: str) -> list[torch.Tensor]:
        """The node's shared buffers: a layer's weights (the specs of host/store.py shared_layers: kind by kind,
        each a spec per layer) only for this node's layers; another node's are views of one scratch per kind."""
        if what != "layer weights":
            got = super().buffers(specs, what)
        else:
            kinds = len(specs) // self.layers
            mine = [k for k in range(len(specs)) if self.node_owns(k % self.layers)]
            scratch = [(max((specs[j * self.layers + i][0] for i in range(self.layers) if not self.node_owns(i)),
                            default=1), specs[j * self.layers][1]) for j in range(kinds)]
            bufs = super().buffers([specs[k] for k in mine] + scratch, what)
            got = [bufs[mine.index(k)] if k in mine else bufs[len(mine) + k // self.layers][: specs[k][0]]
                   for k in range(len(specs))]
            specs = [specs[k] for k in mine] + scratch
        self.shm_bytes += sum(mapped_bytes(n * torch.empty((), dtype=d).element_size()) for n, d in specs)
        return got

    def make_staging(self, numel: int) -> None:
        """The node path's two FP32 transit buffers only (`transit`: staging[0]); no per-rank slots, which only the
        per-rank path's reduce reads."""
        self.staging = [self.buffers([(numel, torch.float32)] * 2, "gradient staging")]

    def describe(self) -> str:
        mine = f"layers {self.first}-{self.stop - 1}" if self.stop > self.first else "no layers"
        return (f"node {self.topo.node} owns {mine} of {self.layers}, local rank {self.topo.local} of "
                f"{self.topo.local_world}")


# -- optimizer state: sharded by the layers' owners, whole in every state_dict ------------------------------
# Updated by shard (engine/update/by_shard.py): per optimizer, the layer parameters whose Adam moments are views of the
# node's shared memory, with those views and this rank's pieces of each (parameter-relative [start, end)); and, on every
# rank but the job's first, their state dicts held here rather than in the optimizer's `state`: the moments are whole
# in rank 0's optimizer, so its state_dict and a sharded save's shard (run/train_state.py, the state of what is in
# `optimizer.state`) carry them once, from rank 0.
_SHARED_STATE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_shared_state(optimizer: torch.optim.Optimizer,
                          shared: dict[torch.Tensor, tuple[dict[str, torch.Tensor], list[tuple[int, int]]]],
                          held: dict[torch.Tensor, dict] | None) -> None:
    """`optimizer`'s layer state lives in the node's shared memory (`shared`, by parameter): its state_dict is whole
    on rank 0 without a gather of it, and a loaded state is copied into those buffers (this rank's pieces). `held`:
    the state dicts this rank keeps out of `optimizer.state` (None on rank 0, which keeps them there)."""
    _SHARED_STATE[optimizer] = shared
    if held is not None:
        _HELD[optimizer] = held


def state_of(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """The state dict the update of parameter `p` reads and writes: `optimizer.state[p]`, or the one this rank
    holds for it (register_shared_state)."""
    held = _HELD.get(optimizer)
    if held is not None and p in held:
        return held[p]
    return optimizer.state[p]


def shard_optimizer_state(optimizer: torch.optim.Optimizer, foreign: set[int], group: dist.ProcessGroup,
                          before: Callable[[], None]) -> None:
    """Make rank 0's `optimizer.state_dict()` whole and `load_state_dict` keep only this rank's share.

    `foreign`: ids of the parameters whose layers other ranks own (they never get a gradient here, so torch
    creates no state for them). state_dict() becomes collective: every rank sends the state of the layers it
    owns to rank 0 (to rank 0 only: a whole copy on every rank would multiply the optimizer's host bytes by
    the ranks at every save), whose dict is whole and loads on any number of ranks. The other ranks' dicts
    hold their own share under SHARD_KEY, and loading one is refused: it would silently drop the rest.
    `before` runs first (the engine's wait for queued collectives: the group is shared with its reduction
    thread). Updated by shard (register_shared_state), the layers' moments are the node's shared buffers: rank 0
    copies them out once every rank's update is done (a barrier after, so no rank updates them before), the
    other ranks send only the rest; a loaded state is copied back into this rank's pieces of those buffers.
    """
    rank = dist.get_rank()

    def whole(opt: torch.optim.Optimizer, sd: dict) -> dict:
        before()
        shared = _SHARED_STATE.get(opt, {})
        params = [p for g in opt.param_groups for p in g["params"]]
        mine = {i: st for i, st in sd["state"].items()
                if id(params[i]) not in foreign and (rank == 0 or params[i] not in shared)}
        parts: list[dict | None] | None = [None] * dist.get_world_size(group) if rank == 0 else None
        dist.gather_object(mine, parts, dst=0, group=group)
        if rank == 0 and shared:
            # every rank's update of its ranges is done (each ran `before` ahead of the gather): a copy, taken
            # before any rank goes on to update the shared buffers again (the barrier below)
            for i, st in sd["state"].items():
                if params[i] in shared:
                    sd["state"][i] = {k: (v.clone() if k in shared[params[i]][0] else v) for k, v in st.items()}
        if shared:
            dist.barrier(group=group)
        if rank != 0:
            sd[SHARD_KEY] = rank
            return sd
        state: dict = {}
        for part in parts:
            for i, st in part.items():
                state.setdefault(i, st)  # the resident parameters' state is on every rank, the same
        sd["state"] = dict(sorted(state.items()))
        return sd

    def refuse_shard(opt: torch.optim.Optimizer, sd: dict) -> None:
        if SHARD_KEY in sd:
            raise ValueError(f"this optimizer state was taken on data-parallel rank {sd[SHARD_KEY]} and holds only the "
                             "layers that rank owns; rank 0's optimizer.state_dict() is the whole state (save from "
                             "rank 0, as the checkpoint methods do)")

    def keep_mine(opt: torch.optim.Optimizer) -> None:
        for p in [p for g in opt.param_groups for p in g["params"] if id(p) in foreign]:
            opt.state.pop(p, None)  # the owner's copy is the one that trains
        for p, (views, pieces) in _SHARED_STATE.get(opt, {}).items():
            st = opt.state[p]
            if "step" not in st:  # loaded from before any step: the state torch's first step would make
                st["step"] = torch.zeros((), dtype=torch.float32)
            for k, view in views.items():
                loaded = st.get(k)
                if loaded is view:
                    continue
                for a, b in pieces:  # this rank's pieces: the other ranks write theirs
                    if loaded is None:
                        view.view(-1)[a:b].zero_()
                    else:
                        view.view(-1)[a:b].copy_(loaded.reshape(-1)[a:b])
                st[k] = view
            held = _HELD.get(opt)
            if held is not None:
                held[p] = opt.state.pop(p)  # kept here, as before the load: rank 0's optimizer has the moments

    optimizer.register_state_dict_post_hook(whole)
    optimizer.register_load_state_dict_pre_hook(refuse_shard)
    optimizer.register_load_state_dict_post_hook(keep_mine)
