"""Host store: every layer's FP32 master weights and gradients in one contiguous host buffer each.

The optimizer sees ordinary `nn.Parameter`s that are views into these buffers (their `.grad` views
into the gradient slab), so any torch optimizer runs over the host store unchanged and its state
(Adam m, v) lives in host memory too. A bf16 shadow of each layer is kept only when the device
computes in bf16, so what crosses the link is 2 bytes per parameter, not 4.

The decoder layers' masters can also be kept as an exact hi/lo split or as bf16 only, and their gradient
slabs as bf16 or not at all (optimizer in backward): see megatrain/costs/modes.py. Then the layer Parameters
are views of one shared FP32 scratch that holds a layer's values only while the optimizer updates it
(`unpack()` ... `pack()`); read and write values through `read_slot` / `write_slot`. What each mode does is
its codec's (codec.py), chosen once per group: no method here tests a mode.

A layer none of whose parameters trains, loaded in bf16, is held as loaded (codec.LoadedBf16): its bf16 weights
alone, 2 bytes a parameter, streamed as they are; the master mode applies to what trains. So are the resident
parameters that never train, loaded in bf16 (codec.FrozenTail): they end the resident group, outside its FP32 master.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from ...costs.modes import GradSlab, HostMaster
from .codec import FROZEN_TAIL, LOADED_BF16, GradCodec, MasterCodec, grad_codec, master_codec
from .node_store import NodeStore
from .pinned import Pinner, host_buffer


def host_empty(numel: int, dtype: torch.dtype, pin: bool | Pinner | None, what: str = "host buffers") -> torch.Tensor:
    """A zero-filled, page-aligned host buffer on its own mapping; pinned when `pin` is a Pinner (or True: one
    registering with CUDA). Pinning either succeeds or raises PinnedMemoryError: never a silent fallback."""
    pinner = Pinner() if pin is True else (pin or None)
    return pinner.buffer(numel, dtype, what) if pinner is not None else host_buffer(numel, dtype)


@dataclass
class Slot:
    name: str
    shape: torch.Size
    offset: int
    numel: int


class SharedLayer(NamedTuple):
    """One layer's persistent host buffers in the node's shared memory (engine/host/node_store.py); None where the
    mode has no such buffer."""

    master: torch.Tensor | None  # FP32 master
    shadow: torch.Tensor | None  # bf16: the FP32 master's streamed copy, or the hilo/bf16 master itself
    lo: torch.Tensor | None  # hilo: the int16 low halves
    ties: torch.Tensor | None  # hilo: [count, positions...] (tie_capacity + 1 int64)


def tie_capacity(numel: int) -> int:
    """Tie positions a shared hilo layer has room for: 1 in 1024 elements (at least 1024), 128x the rate of
    random low bits (1 in 131072; see hilo.py), 0.008 B/param. A layer past it raises (TieOverflow)."""
    return max(1024, numel // 1024)


class TieOverflow(RuntimeError):
    """A hilo layer of a shared store has more tie positions than its shared table holds."""


@dataclass
class GroupRange:
    """A range of one FlatGroup's gradient buffers (what FlatGroup.load_grads reads and writes)."""

    grads: GradCodec
    grad: torch.Tensor | None
    grad_work: torch.Tensor | None
    numel: int


class Scratch:
    """FP32 working space of one layer (master values and gradients) for the non-FP32 modes."""

    def __init__(self, numel: int, master: bool, grad: bool) -> None:
        # Only host threads touch it (the optimizer): pageable, never pinned.
        self.master = host_buffer(numel, torch.float32) if master else None
        self.grad = host_buffer(numel, torch.float32) if grad else None


class FlatGroup:
    """One contiguous FP32 master buffer + gradient slab for a set of named tensors (a layer, or the globals)."""

    def __init__(self, named_shapes: Iterable[tuple[str, torch.Size]], shadow_dtype: torch.dtype | None,
                 master: HostMaster = HostMaster.FP32, grad: GradSlab | None = GradSlab.FLOAT32,
                 scratch: Scratch | None = None, shared: SharedLayer | None = None, owned: bool = True,
                 frozen_bf16: bool = False, bf16_tail: int = 0):
        """`frozen_bf16`: a layer none of whose parameters trains, loaded in bf16: held as loaded (codec.LoadedBf16),
        no gradient slab. `bf16_tail`: the resident group's last elements, frozen parameters loaded in bf16, held as
        loaded (codec.FrozenTail): its FP32 master and gradient slab end before them."""
        self.slots: list[Slot] = []
        offset = 0
        for name, shape in named_shapes:
            n = int(torch.Size(shape).numel())
            self.slots.append(Slot(name, torch.Size(shape), offset, n))
            offset += n
        self.numel = offset
        # What each mode does, chosen once.
        self.masters: MasterCodec = (LOADED_BF16 if frozen_bf16 else FROZEN_TAIL if bf16_tail
                                     else master_codec(master))
        self.grads: GradCodec = grad_codec(grad)
        self.rounding: torch.Generator | None = None  # bf16 master: stochastic rounding's random bits
        # hilo: positions whose hi rounded up at a tie (the `ties` property); in a shared store a table in the
        # node's memory, [count, positions...], so every rank reads the FP32 values the owner wrote.
        self._ties = torch.empty(0, dtype=torch.int64)
        # `shared`: the node's buffers, mapped by every rank of the node (engine/host/node_store.py); a group this
        # rank does not own has no gradient slab, and its master (its halves) and shadow are written by the
        # owner only. The FP32 scratch of the per-layer update stays each rank's own.
        self.owned = owned
        # Fresh mappings are zero-filled: the gradient slab needs no zeroing pass (and pages it never touches
        # cost nothing). Which of these are pinned is the store's choice (HostStore).
        kept = offset - bf16_tail  # the elements with an FP32 master (all but a frozen bf16 tail)
        self.master, self.shadow, self.lo, self.tie_table, self.work = self.masters.buffers(
            kept, shadow_dtype, shared, scratch.master if scratch is not None else None)
        self.held_tail = host_buffer(bf16_tail, torch.bfloat16) if bf16_tail else None
        self.grad, self.grad_work = (self.grads.buffers(kept, scratch.grad if scratch is not None else None)
                                     if owned and not frozen_bf16 else (None, None))
        self.params: list[nn.Parameter] = []
        # per slot, whether it trains (engine/model/trainable.py; None: all); a bf16 tail never does
        self.trains: list[bool] | None = [s.offset < kept for s in self.slots] if bf16_tail else None
        for s in self.slots:
            held = (self.view(self.work, s) if s.offset < kept
                    else self.held_tail[s.offset - kept: s.offset - kept + s.numel].view(s.shape))
            self.params.append(nn.Parameter(held, requires_grad=True))
        self.link_grads()

    @property
    def ties(self) -> torch.Tensor:
        """hilo: the positions (int64, ascending) whose hi rounded up at an exact tie."""
        if self.tie_table is None:
            return self._ties
        n = int(self.tie_table[0])
        return self.tie_table[1: 1 + n].clone()

    @ties.setter
    def ties(self, value: torch.Tensor) -> None:
        if self.tie_table is None:
            self._ties = value
            return
        n, cap = value.numel(), self.tie_table.numel() - 1
        if n > cap:
            raise TieOverflow(f"a hilo layer of {self.numel} elements has {n} exact-tie positions, more than the "
                              f"node's shared table holds ({cap}; random low bits give ~{self.numel // 131072}). "
                              "Its values are not random bits: use data_parallel_host='replicated' for this model")
        self.tie_table[1: 1 + n].copy_(value)  # positions before the count: a reader never sees stale ones
        self.tie_table[0] = n

    def host_tensors(self) -> list[torch.Tensor]:
        """The group's persistent host buffers (what it holds between steps)."""
        ties = self.tie_table if self.tie_table is not None else self._ties
        return [t for t in (self.master, self.grad, self.shadow, self.lo, ties, self.held_tail) if t is not None]

    def master_tensors(self) -> list[torch.Tensor]:
        """The buffers that hold the master values (what a copy of the weights between ranks moves): the FP32
        master; or the bf16 half, the lo half and a shared tie table (a private tie list is not a fixed size)."""
        return self.masters.master_tensors(self)

    @property
    def master_mode(self) -> HostMaster:
        return self.masters.mode

    @property
    def grad_mode(self) -> GradSlab | None:
        return self.grads.mode

    @property
    def per_layer_update(self) -> bool:
        """Whether the optimizer must update this group on its own, between unpack() and pack()."""
        return self.masters.per_layer or self.grads.per_layer

    @staticmethod
    def view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
        return flat[slot.offset: slot.offset + slot.numel].view(slot.shape)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {s.name: self.view(flat, s) for s in self.slots}

    def link_grads(self) -> None:
        # An optimizer's zero_grad(set_to_none=True) drops these links; restore them before each step.
        linked = self.grads.linked(self)
        if linked is None:
            return  # only the per-layer update reads gradients, from grad_work (load_grads); or not this rank's
        for k, (p, s) in enumerate(zip(self.params, self.slots)):
            trains = self.trains is None or self.trains[k]
            p.grad = self.view(linked, s) if trains else None  # a frozen parameter has none (trainable.py)

    def drop_grads(self) -> None:
        """No gradient slab: every parameter of the group is frozen (engine/model/trainable.py)."""
        self.grad = self.grad_work = None
        for p in self.params:
            p.grad = None

    def refresh_shadow(self) -> None:
        """An FP32 master written in place: its streamed bf16 copy refreshed (nothing to do in the other modes)."""
        self.masters.refresh(self)

    # -- the per-layer update of the non-FP32 modes -----------------------------------------------------
    def unpack(self) -> None:
        """Make `work` (what the Parameters view) hold this group's FP32 master values."""
        if self.owned:  # else a layer of the node's shared store that another rank updates
            self.masters.unpack(self)

    def pack(self) -> None:
        """Store `work` back as the master (the exact split, or bf16 RNE); FP32: refresh the shadow."""
        if self.owned:  # else its owner writes it: a write from here would race with (and undo) the owner's update
            self.masters.pack(self)

    def load_grads(self, coefs: list[float]) -> None:
        """Make `grad_work` hold the FP32 gradients, times the clipping coefficients still pending on them (a
        bf16 slab is widened first: the same products as scaling an FP32 slab holding the same values; an FP32
        slab is scaled in place, as a clip_grad_norm_ that left the scaling to the update would have). Also
        called on a GroupRange (the fused pass's tile)."""
        self.grads.load(self, coefs)

    def range(self, a: int, b: int) -> GroupRange:
        """Elements [a, b) of this group's gradients, as load_grads reads and writes them (the fused pass)."""
        return GroupRange(self.grads, self.grad[a:b] if self.grad is not None else None,
                          self.grad_work[a:b] if self.grad_work is not None else None, b - a)

    def read_slot(self, slot: Slot) -> torch.Tensor:
        """A new FP32 tensor with one parameter's master values."""
        return self.masters.read(self, slot)

    def write_slot(self, slot: Slot, value: torch.Tensor) -> None:
        """Set one parameter's master values (an FP32 master's shadow: refresh_shadow() after)."""
        self.masters.write(self, slot, value)

    @property
    def stream_source(self) -> torch.Tensor:
        """What is copied to the device: the bf16 shadow in bf16 mode, else the FP32 master."""
        return self.masters.stream_source(self)


class HostStore:
    """All master weights: one FlatGroup per decoder layer, one for the resident (global) parameters.

    With `pin` (True: register with CUDA; or a Pinner) exactly the buffers a DMA copy reads are pinned
    (costs/pinning.py): each layer's stream source and, when the device computes in FP32 (no `shadow_dtype`),
    the resident parameters' masters, which are uploaded after every step. In bf16 the resident upload reads
    a bf16 staging of its own (resident_upload.py), so those FP32 masters never leave the host either.
    Gradient slabs are written by host threads only (on CUDA gradients land in pinned staging first), and an
    FP32 master behind a bf16 shadow never leaves the host.
    """

    def __init__(self, layer_shapes: list[list[tuple[str, torch.Size]]], global_shapes: list[tuple[str, torch.Size]],
                 pin: bool | Pinner | None, shadow_dtype: torch.dtype | None, master: HostMaster = HostMaster.FP32,
                 grad: GradSlab | None = GradSlab.FLOAT32, node: NodeStore | None = None,
                 frozen_bf16: Iterable[int] = (), globals_bf16_tail: int = 0) -> None:
        """`frozen_bf16`: the layers held as loaded in bf16 (FlatGroup), outside the store's master mode; not with a
        node's shared store (its layers' buffers are the mode's). `globals_bf16_tail`: the resident parameters'
        last elements, frozen and loaded in bf16, held so (FlatGroup `bf16_tail`)."""
        self.master_mode, self.grad_mode = master, grad
        frozen_bf16 = set(frozen_bf16)
        if (frozen_bf16 or globals_bf16_tail) and node is not None:
            raise ValueError("layers held as loaded in bf16 are a private store's only")
        masters, grads = master_codec(master), grad_codec(grad)
        self.scratch = None
        if masters.per_layer or grads.per_layer:
            # One layer's FP32 values at a time: the updates run one after another on one thread.
            biggest = max((sum(int(torch.Size(s).numel()) for _, s in shapes) for shapes in layer_shapes), default=0)
            self.scratch = Scratch(biggest, masters.per_layer, grads.per_layer)
        self.ranks_sharing = node.topo.local_world if node is not None else 1
        shared: list[SharedLayer | None] = [None] * len(layer_shapes)
        # Nodes sharing one store (engine/parallel/shared_store.py): this rank's layers private and whole, the
        # others' parameters views of one scratch layer (no slab, no state; a distinct view each, which the loads
        # tell apart), written by nothing that is read.
        self.across_nodes = bool(getattr(node, "shares_across_nodes", False))
        # Nodes sharing one store with several ranks per node (host/node_store.py SpanningNodeStore): a node's
        # store whose other nodes' layers view one node-shared scratch per buffer kind, which counts once in
        # host_bytes and is pinned once (speculative.py turns "auto" off for it, as for `across_nodes`)
        self.spans_nodes = bool(getattr(node, "spans_nodes", False))
        self._scratch_views = {i for i in range(len(layer_shapes))
                               if self.spans_nodes and not node.node_owns(i)}
        if self.across_nodes:
            numels = [sum(int(torch.Size(s).numel()) for _, s in shapes) for shapes in layer_shapes]
            kinds = master_codec(master).shared_kinds(shadow_dtype)
            scratch = {kind: host_buffer(max(numels), dtype) for kind, dtype in kinds}
            shared = [None if node.owns(i) else
                      SharedLayer(*(scratch[f][:n] if f in scratch else None for f in SharedLayer._fields))
                      for i, n in enumerate(numels)]
        elif node is not None:
            # One host store per node: the layers' masters (their halves, shadows and tie tables) are the node's,
            # each layer's slab its owner's, the one-layer FP32 scratch each rank's own.
            numels = [sum(int(torch.Size(s).numel()) for _, s in shapes) for shapes in layer_shapes]
            shared = shared_layers(node, numels, master, shadow_dtype)
        self.layers = [FlatGroup(shapes, shadow_dtype, master, grad, self.scratch, shared[i],
                                 node is None or node.owns(i), i in frozen_bf16) for i, shapes in enumerate(layer_shapes)]
        # The globals (embedding, final norm, head) stay FP32: they are resident on the device, and their
        # gradients arrive at both ends of backward; those of them frozen and loaded in bf16 are held as loaded.
        self.globals = FlatGroup(global_shapes, None, bf16_tail=globals_bf16_tail)
        self.pinner = Pinner() if pin is True else (pin or None)
        # The resident masters are a DMA source only where no staging in another dtype stands between.
        self.resident_masters_copied = shadow_dtype is None
        if self.pinner is not None:
            # (a frozen bf16 tail is copied to its FP32 device copies the same way: host/codec.py FrozenTail)
            copied = ([t for t in (self.globals.master, self.globals.held_tail) if t is not None]
                      if self.resident_masters_copied else [])
            streamed = [g.stream_source for i, g in enumerate(self.layers)
                        if (g.owned or not self.across_nodes) and i not in self._scratch_views]
            if self.across_nodes:  # the scratch the others' loads view, once
                streamed.append(scratch["shadow"] if "shadow" in scratch else scratch["master"])
            if self._scratch_views:  # the node's scratch, once (the pinner registers a view's whole mapping)
                streamed.append(self.layers[min(self._scratch_views)].stream_source)
            self.pinner.pin(streamed + copied,
                            "streamed layer weights and resident masters" if copied else "streamed layer weights")

    @property
    def pinned_bytes(self) -> int:
        """Bytes this store (and the buffers made through `buffer`) locked, page-exact."""
        return self.pinner.pinned_bytes if self.pinner is not None else 0

    def buffer(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A host buffer that a DMA copy will use: pinned exactly when the store is."""
        return host_empty(numel, dtype, self.pinner, what)

    @property
    def per_layer_update(self) -> bool:
        return self.scratch is not None

    def groups(self) -> list[FlatGroup]:
        return [*self.layers, self.globals]

    def named_parameters(self, layers_prefix: str) -> list[tuple[str, nn.Parameter]]:
        out = []
        for i, g in enumerate(self.layers):
            out += [(f"{layers_prefix}.{i}.{s.name}", p) for s, p in zip(g.slots, g.params)]
        out += [(s.name, p) for s, p in zip(self.globals.slots, self.globals.params)]
        return out

    def host_bytes(self) -> int:
        """This rank's host bytes: the node's shared layer weights count as this rank's share of them, so the
        sum over a node's ranks is what the node holds."""
        total = 0.0
        seen: set[int] = set()  # nodes sharing one store: the other layers' views of one scratch count once
        for i, g in enumerate(self.groups()):
            for t in g.host_tensors():
                if t.device.type != "cpu":
                    continue  # an optimizer-resident layer's buffers on a device (engine/update/resident.py)
                if (self.across_nodes and not g.owned and g is not self.globals) or i in self._scratch_views:
                    if t.untyped_storage().data_ptr() not in seen:
                        seen.add(t.untyped_storage().data_ptr())
                        views = self.ranks_sharing if i in self._scratch_views else 1  # a node's: its share
                        total += t.untyped_storage().nbytes() / views
                    continue
                share = self.ranks_sharing if g is not self.globals and t is not g.grad else 1
                total += t.numel() * t.element_size() / share
        if self.scratch is not None:
            total += sum(t.numel() * t.element_size() for t in (self.scratch.master, self.scratch.grad)
                         if t is not None)
        return int(total)

    def zero_grad(self) -> None:
        for g in self.groups():
            if g.grad is not None:
                g.grad.zero_()


def shared_layers(node: NodeStore, numels: list[int], master: HostMaster,
                  shadow_dtype: torch.dtype | None) -> list[SharedLayer]:
    """Every layer's persistent buffers for `master`, in the node's shared memory (a collective of the node)."""
    kinds = master_codec(master).shared_kinds(shadow_dtype)
    specs = [(tie_capacity(n) + 1 if kind == "ties" else n, dtype) for kind, dtype in kinds for n in numels]
    bufs = node.buffers(specs, "layer weights")
    per_kind = {kind: bufs[k * len(numels): (k + 1) * len(numels)] for k, (kind, _) in enumerate(kinds)}
    return [SharedLayer(*(per_kind[f][i] if f in per_kind else None for f in SharedLayer._fields))
            for i in range(len(numels))]
