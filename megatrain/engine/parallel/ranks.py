"""What the data-parallel ranks add to a step, chosen once per engine: nothing (one process), averaged
gradient slabs (each rank its own host store), or each layer's gradients summed into its owner's slab and
its update released to the node's other ranks (one host store per node, node_store.py).

The collectives themselves are distributed.py's; this is when the engine queues them, and which per-layer
events (events.py) they extend.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..host.events import LayerEvents
from ..host.pinned import host_buffer
from ..host.store import HostStore
from ..runtime.stream import DONE, Event
from .distributed import DataParallel

Sink = Callable[[int, torch.Tensor, Event], Event]  # (layer, its staged gradients, their event) -> when done


class OneRank:
    """A lone process: its slabs are the gradients, its store is its own."""

    # Shared store: called by the pipeline instead of adding into a slab (schedule.py's grad_sink).
    grad_sink: Sink | None = None

    def grad_sent(self, sync: bool) -> Callable[[int], None] | None:
        """What the pipeline calls once a layer's gradients are queued to the host (None: nothing)."""
        return None

    def sink(self, update_sink: Sink | None) -> Sink | None:
        """What the pipeline hands each layer's staged gradients to (None: it adds them into the slabs), given
        the update path's own sink (the optimizer in backward's, or None)."""
        return self.grad_sink or update_sink

    def before_backward(self) -> None:
        pass

    def after_backward(self, sync: bool) -> None:
        pass

    def average_pending(self) -> None:
        """Average what local backwards (sync=False) left, before anything reads the slabs (a step, a norm)."""

    def zero_grad(self) -> None:
        pass

    def total_norm(self, norms: list[torch.Tensor]) -> float:
        """The global L2 norm from this rank's per-slab norms (the resident parameters' last)."""
        return float(torch.linalg.vector_norm(torch.stack(norms)))

    def release(self, events: LayerEvents, overlapped: bool) -> None:
        """After a step's updates are written or queued: let the other ranks load the layers."""

    def wait(self) -> None:
        """Block until the other ranks' updates of the layers this rank loads are released."""

    def barrier(self, what: str) -> None:
        """Every rank of the node at this point (a shared store: the layers' masters were written)."""

    def take_weights(self, src: int | None) -> None:
        """Weights were written by hand on rank `src`: every rank takes them."""

    def agree_max(self, value: int, what: str) -> int:
        """The largest of every rank's `value`: a verdict only some ranks could reach, made every rank's."""
        return value

    def whole(self, named: dict[str, torch.Tensor], layers_prefix: str) -> dict[str, torch.Tensor]:
        """Every parameter's master by name (a state_dict's values): this rank's `named`, unless it holds some
        layers' masters only as another node's (NodesShare)."""
        return named


class Replicated(OneRank):
    """Each rank its own store: every slab is averaged across ranks at a synchronising backward, each
    layer's as soon as it lands (its `landed` becomes the average's), the resident parameters' last."""

    def __init__(self, dp: DataParallel, store: HostStore, events: LayerEvents) -> None:
        self.dp, self.store, self.events = dp, store, events
        self.unaveraged = False  # a backward(sync=False) added gradients not yet averaged

    def grad_sent(self, sync: bool) -> Callable[[int], None] | None:
        return self._average_layer if sync else None

    def sink(self, update_sink: Sink | None) -> Sink | None:
        if update_sink is not None:
            raise ValueError("optimizer_in_backward with data_parallel_host='replicated': a private store per rank "
                             "has no gradient slab to average before each layer's update; use "
                             "data_parallel_host='shared' (or 'auto'), where each layer's owner updates it")
        return None

    def before_backward(self) -> None:
        # The resident parameters' slab may still be being averaged (last backward): the adds wait for it.
        self.events.wait_global_grads()

    def after_backward(self, sync: bool) -> None:
        if sync:
            self._average_globals()
        self.unaveraged = not sync

    def average_pending(self) -> None:
        # Averaging a slab that holds an already-averaged part plus local parts is still exact, so this is
        # right whatever mix of synchronising and local backwards came before.
        if not self.unaveraged:
            return
        self._average_layers()
        self._average_globals()
        self.unaveraged = False

    def _average_layers(self) -> None:
        for i in reversed(range(len(self.store.layers))):
            self._average_layer(i)

    def zero_grad(self) -> None:
        self.unaveraged = False

    def agree_max(self, value: int, what: str) -> int:
        return self.dp.max_across(value, what)

    def take_weights(self, src: int | None) -> None:
        if src is not None:
            self.dp.broadcast_from(self.store, src)  # only `src` wrote: the other ranks take its weights

    def _average_layer(self, i: int) -> None:
        if self.store.layers[i].grad is None:
            return  # a frozen layer: no slab (engine/model/trainable.py)
        landed = self.events.landed
        landed[i] = self.dp.submit_average(self.store.layers[i], landed[i], f"layer {i}", i)

    def _average_globals(self) -> None:
        pending = self.events.globals_landed
        pending.append(self.dp.submit_average(self.store.globals, list(pending),
                                              "the resident parameters (embedding, norm, head)", -1))


class SharedStore(Replicated):
    """One host store per node: every backward's layer gradients go to the layer's owner's slab (no per-layer
    average), the owner updates the shared master, and the other ranks load it only once that is done."""

    def __init__(self, dp: DataParallel, store: HostStore, events: LayerEvents) -> None:
        super().__init__(dp, store, events)
        self.grad_sink = self._reduce_to_owner

    def grad_sent(self, sync: bool) -> Callable[[int], None] | None:
        return None  # reduced to the owners as they land, every backward

    def sink(self, update_sink: Sink | None) -> Sink | None:
        if update_sink is None:
            return self.grad_sink
        # The optimizer in backward (no slab): each layer's average lands in one of two FP32 buffers of the
        # owner's, which its update reads; a buffer is reused (two owned layers on) only after that update.
        self._update_sink = update_sink
        owned = [g.numel for i, g in enumerate(self.store.layers) if self.dp.node.owns(i)]
        self._averaged = [host_buffer(max(owned), torch.float32) for _ in range(2)] if owned else []
        self._averaged_free: list[Event] = [DONE, DONE]
        self._next = 0
        return self._reduce_then_update

    def _average_layers(self) -> None:
        pass  # the owners' slabs hold the node's sum already

    def _reduce_to_owner(self, i: int, staging: torch.Tensor, staged: Event) -> Event:
        """Queue layer i's gradients' reduction into its owner's slab (every backward)."""
        e = self.events
        return self.dp.submit_reduce_to_owner(i, staging, self.store.layers[i].grad, (staged, e.landed[i], e.zeroed[i]))

    def _reduce_then_update(self, i: int, staging: torch.Tensor, staged: Event) -> Event:
        """Queue layer i's gradients' average to its owner and, on the owner, the layer's update behind it."""
        e = self.events
        after = (staged, e.landed[i], e.zeroed[i])
        if not self.dp.node.owns(i):
            return self.dp.submit_reduce_to_owner(i, staging, None, after)
        k = self._next
        self._next ^= 1
        averaged = self._averaged[k][: staging.numel()]
        reduced = self.dp.submit_reduce_to_owner(i, staging, averaged, (*after, self._averaged_free[k]), fresh=True)
        self._averaged_free[k] = self._update_sink(i, averaged, reduced)
        return self._averaged_free[k]

    def total_norm(self, norms: list[torch.Tensor]) -> float:
        # Each rank holds its own layers' slabs: their squares summed over the node (every node holds the
        # same sums), plus the resident parameters', which every rank holds whole.
        layers = self.dp.sum_across_node(float(torch.stack(norms[:-1]).double().square().sum())
                                         if len(norms) > 1 else 0.0)
        return math.sqrt(layers + float(norms[-1].double()) ** 2)

    def release(self, events: LayerEvents, overlapped: bool) -> None:
        if overlapped:
            # Each layer's next load waits for its owner's update, whichever rank that is: the node's ranks
            # pass a token per layer, in forward order, once the owner's update is done (node_store.py).
            updated = events.updated
            for i in range(len(updated)):
                updated[i] = self.dp.submit_publish(i, updated[i])
        else:
            # The owners wrote their layers in the node's shared store: nobody loads one before all are written.
            self.dp.node_barrier("waiting for the other ranks' layer updates")

    def wait(self) -> None:
        self.dp.synchronize_updates()  # the other ranks' layer updates (shared store, optimizer_overlap)

    def barrier(self, what: str) -> None:
        self.dp.node_barrier(what)


class NodesShare(Replicated):
    """Nodes sharing one store (shared_store.py): each backward's gradients of a layer are reduced to the layer's
    owner (a reduce over the job's group, on the data-parallel thread, in backward's layer order on every rank),
    whose slab adds the sum / world; no other rank has a slab for it. The resident parameters are averaged as in
    the per-rank path. A layer's next load is a broadcast from its owner, issued after the owner's update: the
    collective itself orders it, so the step ends with no barrier."""

    def __init__(self, dp: DataParallel, store: HostStore, events: LayerEvents) -> None:
        super().__init__(dp, store, events)
        self.grad_sink = self._reduce_to_owner
        self._wide: list[torch.Tensor] = []  # bf16 staging widened to FP32 before the sum (gloo sums bf16 in bf16)

    def grad_sent(self, sync: bool) -> Callable[[int], None] | None:
        return None

    def sink(self, update_sink: Sink | None) -> Sink | None:
        if update_sink is not None:
            raise ValueError("optimizer_in_backward with nodes sharing one store: not supported; set "
                             "optimizer_in_backward=false")
        return self.grad_sink

    def _average_layers(self) -> None:
        pass  # the owners' slabs hold the job's mean already

    def _reduce_to_owner(self, i: int, staging: torch.Tensor, staged: Event) -> Event:
        dp, e = self.dp, self.events
        owner = dp.node.owner_rank(i)
        slab = self.store.layers[i].grad

        def reduce() -> int:
            flat = staging.reshape(-1)
            if flat.dtype != torch.float32:
                if not self._wide or self._wide[0].numel() < flat.numel():
                    self._wide = [torch.empty(flat.numel(), dtype=torch.float32)]
                flat = self._wide[0][: flat.numel()].copy_(flat)
            dist.reduce(flat, dst=owner, group=dp.group)
            if slab is not None:
                slab.add_(flat, alpha=1.0 / dp.world_size)
            return flat.numel() * flat.element_size()

        return dp._submit(reduce, (staged, e.landed[i], e.zeroed[i]), f"reducing layer {i}'s gradients to its "
                          f"owner rank {owner}", "gradient reduce to the owner node", i)

    def total_norm(self, norms: list[torch.Tensor]) -> float:
        return owners_norm(self.dp, norms)

    def whole(self, named: dict[str, torch.Tensor], layers_prefix: str) -> dict[str, torch.Tensor]:
        """The other nodes' layers' master values broadcast from their owners, one layer at a time, into fresh
        tensors, in any master mode (collective and joined: every rank calls state_dict; shared_store.py
        other_nodes_layers). Each rank ends with the whole model's weights, as a one-store state_dict."""
        return {**named, **self.dp.node.other_layers(self.store, layers_prefix, self.dp)}

    def take_weights(self, src: int | None) -> None:
        if src is not None:
            raise ValueError("weights written by hand on one rank, with nodes sharing one store (each layer held by "
                             "its owner only): write them with engine.load_state_dict on every rank")

    def barrier(self, what: str) -> None:
        self.dp.node_barrier(what)


class NodesShareByNode(SharedStore):
    """Nodes sharing one store with several ranks per node (host/node_store.py SpanningNodeStore): each node's ranks
    are a node's ranks over the node's block of layers (one of them owns each: its slab, its update; the node path
    lands the gradients there, node_path.NodeGrads, after the node's shard reached the owner node's peer), and every
    rank averages the resident parameters with every other. The norm sums the owners' slabs over the job; the other
    nodes' layers are gathered from their owners for a state_dict."""

    def sink(self, update_sink: Sink | None) -> Sink | None:
        if update_sink is not None:
            raise ValueError("optimizer_in_backward with nodes sharing one store: not supported; set "
                             "optimizer_in_backward=false")
        return self.grad_sink

    def total_norm(self, norms: list[torch.Tensor]) -> float:
        return owners_norm(self.dp, norms)

    def release(self, events: LayerEvents, overlapped: bool) -> None:
        if not overlapped:
            super().release(events, overlapped)
            return
        node = self.dp.node
        for i in range(len(events.updated)):
            if node.node_owns(i):  # another node's layer is loaded from its owner node's shards: no token here
                events.updated[i] = self.dp.submit_publish(i, events.updated[i])

    def whole(self, named: dict[str, torch.Tensor], layers_prefix: str) -> dict[str, torch.Tensor]:
        """The other nodes' layers' master values, each broadcast from its owner rank (collective and joined: every
        rank calls state_dict; shared_store.py other_nodes_layers), as a one-store state_dict has them."""
        return {**named, **self.dp.node.other_layers(self.store, layers_prefix, self.dp)}

    def take_weights(self, src: int | None) -> None:
        if src is not None:
            raise ValueError("weights written by hand on one rank, with nodes sharing one store (each layer held by "
                             "its owner node only): write them with engine.load_state_dict on every rank")


def owners_norm(dp: DataParallel, norms: list[torch.Tensor]) -> float:
    """The clip norm where each layer's slab is on one rank of the job (nodes sharing one store): every rank's layers'
    squares summed over the job's group (`world_group`: the nodes' group with one rank per node), plus the resident
    parameters' (`norms[-1]`, the same everywhere)."""
    mine = float(torch.stack(norms[:-1]).double().square().sum()) if len(norms) > 1 else 0.0
    t = torch.tensor([mine], dtype=torch.float64)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=dp.node.world_group)
    except Exception as exc:
        raise dp.fail("summing the gradient norm across the nodes", exc) from exc
    return math.sqrt(float(t.item()) + float(norms[-1].double()) ** 2)


def ranks_for(dp: DataParallel | None, store: HostStore, events: LayerEvents) -> OneRank:
    if dp is None:
        return OneRank()
    if getattr(dp.node, "spans_nodes", False):
        return NodesShareByNode(dp, store, events)
    if getattr(dp.node, "shares_across_nodes", False):
        return NodesShare(dp, store, events)
    return SharedStore(dp, store, events) if dp.node is not None else Replicated(dp, store, events)
