"""The per-layer pipeline: stream weights in ahead of compute, run layers forward and (recomputing) backward.

With k device buffers, the copies of the next k-1 layers are in flight while a layer computes. At
the forward/backward turn the last k layers are still resident, so backward starts without a copy.
The order of it all is costs/pipeline.py's, which the planner's simulator replays: this module runs each step.
Residency (costs/residency.py, planned per batch by the memory policy): the first layers may keep their weights
in device buffers of their own (copied once per change of the masters) and their forward's autograd graph (no
recompute), some of those graphs with their saved activations in host memory (saved_offload.py); the rest
stream through the ring of k buffers as above. On the node path a kept layer without a kept graph is kept sharded:
this rank's shard on the device, every load the all-gather from the node's shards (kept_shards.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Protocol

import torch
from torch.utils._pytree import tree_flatten

from ...costs import pipeline as order
from ...costs.pinning import STAGING_SLOTS
from ...costs.residency import Residency
from ..host import reduce_kernel
from ..host.events import LayerEvents
from ..host.slab_state import PartsAdd
from ..host.store import FlatGroup, HostStore
from ..layer.handed_state import HandedStates
from ..layer.side_inputs import SideInputs
from ..layer.templates import TemplateBank
from ..layer.tiling import DEFAULT_LOSS_CHUNK, LongContextPolicy, tiled_vjp
from ..runtime.memtrack import untracked
from ..runtime.stream import DONE, Event, Streams, Trace, side_threads
from .activations import ActivationStore, HostPool
from .kept_shards import ShardKeeper, keeps_shards
from .saved_offload import GraphOffload

REDUCE_CHUNK = 1 << 20  # elements: a 4 MiB FP32 scratch, which stays in cache between its write and read


def accumulate(dst: torch.Tensor, src: torch.Tensor, scratch: torch.Tensor | None = None,
               overwrite: bool = False) -> None:
    """dst += src, in place (`overwrite`: dst = 0 + src, the same bits as zeroing dst first, in one pass). A
    mixed-dtype add_ on the CPU first casts the whole source into a fresh FP32 temporary (a layer-sized
    allocation, page-faulted in, per layer per micro-batch); here each chunk is cast into `scratch` (reused,
    cache-resident) and added from there: the same values, no temporary, and 2-4x faster on the machine this
    was measured on. Same-dtype adds have no temporary and run whole."""
    if src.dtype == dst.dtype:
        if overwrite:
            torch.add(src, 0.0, out=dst)  # 0 + g: a -0 gradient lands as +0, as added into a zeroed slab
        else:
            dst.add_(src)
        return
    if scratch is None:
        scratch = torch.empty(min(REDUCE_CHUNK, dst.numel()), dtype=dst.dtype)
    dst, src = dst.view(-1), src.reshape(-1)  # a slab view is contiguous: chunks are flat ranges
    chunk = scratch.numel()
    for s in range(0, dst.numel(), chunk):
        d = dst[s: s + chunk]
        k = d.numel()
        scratch[:k].copy_(src[s: s + k])
        if overwrite:
            torch.add(scratch[:k], 0.0, out=d)
        else:
            d.add_(scratch[:k])


class ShardedWeights(Protocol):
    """How a streamed layer reaches a ring slot on the node path (docs/DISTRIBUTED.md section 1): this rank copies
    its shard host-to-device, then the node's ranks all-gather the rest. engine/parallel/node_path.py's NodeWeights
    is one; the pipeline knows no process group, only these three calls."""

    def padded(self, numel: int) -> int:
        """Elements a ring slot needs for a layer of `numel` (the shard map pads it to equal pieces)."""

    def copy_shard(self, buffer: torch.Tensor, src: torch.Tensor, numel: int) -> int:
        """Copy this rank's ranges of `src` (a layer's host stream source) into `buffer`; the bytes copied."""

    def gather(self, buffer: torch.Tensor, numel: int) -> int:
        """Every rank's shard of the layer into `buffer` (its own already there); the bytes received."""


class ShardedGrads(Protocol):
    """How a layer's gradients leave backward on the node path (docs/DISTRIBUTED.md section 2): reduce-scattered in
    FP32 across the node's ranks, this rank's shard copied to the host into the node's one copy of the layer's
    gradient. engine/parallel/node_path.py's NodeGrads is one."""

    def send(self, layer: int, group: FlatGroup, grads: list[torch.Tensor | None], after: Event,
             slab_after: tuple[Event, ...]) -> Event:
        """Queue layer `layer`'s gradients (computed once `after` is done) to its slab, whose writes wait for
        `slab_after` too; the event after which the slab holds them."""


class WhatTrains(Protocol):
    """The user's flags by layer (engine/model/trainable.py Trainable)."""

    def layer_trains(self, i: int) -> bool: ...

    def layer_weights(self, i: int) -> dict[str, bool]: ...


class LayerPipeline:
    def __init__(self, store: HostStore, templates: TemplateBank, streams: Streams, trace: Trace,
                 num_buffers: int, dtype: torch.dtype, device: torch.device, preserve_rng: bool,
                 events: LayerEvents, policy: LongContextPolicy | None = None,
                 grad_sink: Callable[[int, torch.Tensor, Event], Event] | None = None,
                 optimizer_layers: frozenset[int] = frozenset(), trainable: WhatTrains | None = None) -> None:
        self.store = store
        self.templates = templates
        self.streams = streams
        self.trace = trace
        self.device = device
        self.preserve_rng = preserve_rng
        self.max_numel = max(g.numel for g in store.layers)
        self.ring_numel = self.max_numel  # a ring slot's elements (use_weights pads it for the node path's shards)
        # The node path's shard copy and gather (use_weights); None: every streamed layer is copied whole.
        self.weights: ShardedWeights | None = None
        # The node path's gradients (reduce-scatter, shard to the host); None: each rank sends its whole gradient.
        self.grad_shards: ShardedGrads | None = None
        self.kept_shards = ShardKeeper(store, streams, dtype, device)  # the node path's layers kept sharded
        k = self.ring_size = num_buffers
        self.dtype = dtype
        # Slots 0..k-1: the ring the streamed layers share; k..: one per kept layer (set_residency).
        self.buffers = [torch.empty(self.max_numel, dtype=dtype, device=device) for _ in range(k)]
        self.slots = order.DeviceBuffers(k)  # which layer each buffer holds
        self.loaded: list[Event] = [DONE] * k
        self.freed: list[Event] = [DONE] * k
        self.residency = Residency()
        self.weight_peak_bytes = self.device_weight_bytes  # the most the layers' buffers held at once (set_residency)
        self.graphs: frozenset[int] = frozenset()  # this batch's layers whose forward keeps its graph
        self.offloaded: frozenset[int] = frozenset()  # those of them whose saved activations go to the host
        self.graph_bytes_out = 0  # offloaded graphs' bytes sent to the host since the counters were reset
        self.recomputed = 0  # layers recomputed in backward since the counters were reset
        # Where a backward cut short would go on from: (the highest layer whose gradients it has not sent, the gradient
        # of that layer's output); None outside a backward (oom.py)
        self.resume: tuple[int, torch.Tensor] | None = None
        # A CPU device computing in the stream source's dtype, emulating no link and no device budget: a kept
        # layer's "device copy" is the host's own stream source (no copy, no second model in memory), as the
        # resident parameters' are (placement.py alias_globals). With an emulation the copies stay, as a GPU's.
        self.alias_kept = (device.type == "cpu" and streams.h2d.gbps is None
                           and (policy is None or policy.budget is None))
        # The per-layer events it waits for and records (events.py). Its own names for the engine's lists:
        # a layer's load waits for `updated`, a reduction into its slab for `zeroed` and the slab's last writer
        # (`landed`, which it replaces); rebinding one of these names here unhooks only the pipeline's waits.
        self.events = events
        self.updated, self.zeroed, self.landed = events.updated, events.zeroed, events.landed
        # A shared host store or the optimizer in backward: called as grad_sink(layer, staged gradients, event of
        # their staging) instead of adding into a slab; returns the event after which the staging may be reused.
        self.grad_sink = grad_sink
        # Without a sink the pipeline's own reductions write every layer's slab: zero_grad() can leave zeroing to them.
        events.slabs.overwrite = grad_sink is None
        # Layers whose master, slab and Adam state live on the device (update/resident.py): their gradients are
        # added into the device slab here, their kept weights are the device shadow itself.
        self.optimizer_layers = optimizer_layers
        # What trains (engine/model/trainable.py; None: everything): a frozen weight's leaf requires no gradient,
        # and a layer none of whose weights train sends none.
        self.trainable = trainable
        self._rng: dict[int, tuple] = {}
        self.policy = policy
        self.tile: int | None = None  # MLP sequence tile of the current batch (None: untiled)
        self.last_plan = None
        # Offloaded boundary activations: host buffers kept from step to step (pinned like the store), so the
        # layer loop never allocates or registers host memory after the first batch of a given size.
        self.act_pool = HostPool(store.buffer, streams.watchdog_s)
        self.graph_pool = HostPool(store.buffer, streams.watchdog_s)  # the offloaded graphs' saved tensors
        if device.type == "cuda":
            # Gradients land in pinned staging, then a host thread adds them into the FP32 slabs. With several
            # slots the device's copies run ahead of the host's adds (costs/pinning.py, STAGING_SLOTS).
            self._reducer = type(streams.d2h)("host-reduce", torch.device("cpu"), trace, None, streams.watchdog_s)
            self._reducer.threads = side_threads()  # beside the optimizer's workers and the launch thread
            self._staging = [store.buffer(self.max_numel, dtype, "gradient staging") for _ in range(STAGING_SLOTS)]
            self._staging_free: list[Event] = [DONE] * STAGING_SLOTS
            self.reduce_scratch = torch.empty(REDUCE_CHUNK, dtype=torch.float32)  # the reducer thread's own
            self._next_staging = 0
        reducer_threads = self._reducer.threads if device.type == "cuda" else streams.d2h.threads
        if grad_sink is None and reduce_kernel.pays(reducer_threads):
            reduce_kernel.kernel()  # built and self-checked now, not in the first backward's reduction

    @property
    def device_weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers) + self.kept_shards.nbytes

    def use_weights(self, weights: ShardedWeights) -> None:
        """Load the streamed layers by shard and gather (the node path) from now on: the ring's slots grow to the
        padded length (drained first: no copy in flight writes a slot given up). Called before any batch plans its
        residency: kept layers are then kept sharded where `weights` can (kept_shards.py), else copied whole."""
        self.streams.add_gather()
        self.weights = weights
        self.kept_shards.weights = weights if keeps_shards(weights) else None
        if self.policy is not None and self.kept_shards.weights is not None:
            self.policy.kept_share = weights.world  # "auto" plans a kept layer at 1/G of its bytes (residency.plan)
        self.ring_numel = weights.padded(self.max_numel)  # padding only grows with numel: every layer fits
        k = self.ring_size
        if self.buffers[0].numel() and self.buffers[0].numel() < self.ring_numel:
            self.streams.synchronize()
            with untracked():
                self.buffers[:k] = [torch.empty(self.ring_numel, dtype=self.dtype, device=self.device)
                                    for _ in range(k)]
            self.slots.invalidate()
            self.loaded[:k] = [DONE] * k
            self.weight_peak_bytes = max(self.weight_peak_bytes, self.device_weight_bytes)

    def invalidate(self) -> None:
        """Masters changed (optimizer step, load): resident copies are stale."""
        self.slots.invalidate()
        self.kept_shards.invalidate()

    def plan_batch(self, tokens: int, offload_setting: bool | str, train: bool = True, logits_tokens: int = 0) -> bool:
        """Choose this batch's MLP tile and residency; return whether its boundary activations go to host memory.
        A non-training forward (`train` False) runs on the placement training planned (memory.py): it changes
        no buffer, so it may come between a training forward and its backward. `logits_tokens`: tokens whose
        full logits go back to the caller (their workspace joins the plan)."""
        if self.policy is None:
            self.tile = None
            self.graphs = self.offloaded = frozenset()
            return bool(offload_setting) if isinstance(offload_setting, bool) else False
        self.last_plan = plan = self.policy.plan(tokens, train, logits_tokens)
        self.tile = plan.tile
        self.set_residency(plan.residency)
        self.graphs = plan.residency.graphs if train and plan.tile is None and not plan.offload else frozenset()
        self.offloaded = plan.residency.offloaded & self.graphs
        return plan.offload

    def set_residency(self, r: Residency) -> None:
        """Give each kept layer a device buffer of its own (their copies then serve until the masters change);
        the ring is released while every layer is kept. Rare (training's placement only shrinks after its first
        batch). The device is drained first, so no queued copy or kernel still uses a buffer given up; the layers
        that stay kept keep their buffers (and their copies, still current); the dropped ones are freed before
        any new buffer is allocated, so the device never holds the old placement and the new one at once."""
        r = r.capped(len(self.store.layers))
        whole, sharded = self.kept_shards.split(r, self.slots.kept)  # layers kept sharded take ring slots: not kept in the schedule
        if whole == self.slots.kept and sharded == self.kept_shards.shards.keys():
            self.residency = r
            return
        self.streams.synchronize()
        k, n = self.ring_size, len(self.store.layers)
        # (buffer, copy current, its load event) of each layer that stays kept
        stay = {i: (self.buffers[s], self.slots.resident[s] == i, self.loaded[s])
                for i, s in self.slots.kept_slot.items() if i in whole}
        ring = self.buffers[:k] if len(whole) < n and self.buffers[0].numel() >= self.ring_numel else None
        self.buffers = []  # the dropped layers' buffers (and a ring not reused) are freed here, before any allocation
        shards = self.kept_shards.drop(sharded)
        with untracked():  # weight buffers: device_weight_bytes counts them, not the working set's tracker
            if ring is None:
                size = 0 if len(whole) == n else self.ring_numel
                ring = [torch.empty(size, dtype=self.dtype, device=self.device) for _ in range(k)]
            kept = [stay[i][0] if i in stay else self._kept_buffer(i) for i in sorted(whole)]
            self.kept_shards.allocate(sharded, shards)
        self.buffers = ring + kept
        self.slots = order.DeviceBuffers(k, whole)
        self.loaded = [DONE] * len(self.buffers)
        self.freed = [DONE] * len(self.buffers)
        for i, (_, current, loaded) in stay.items():  # a copy that still matches its masters is not made again
            if current:
                s = self.slots.kept_slot[i]
                self.slots.resident[s], self.loaded[s] = i, loaded
        self.residency = r
        self.weight_peak_bytes = max(self.weight_peak_bytes, self.device_weight_bytes)
        logging.getLogger("megatrain").info("%s", r.describe(n))

    def _kept_buffer(self, layer: int) -> torch.Tensor:
        src = self.store.layers[layer].stream_source
        if (self.alias_kept or layer in self.optimizer_layers) and src.dtype == self.dtype:
            return src
        return torch.empty(src.numel(), dtype=self.dtype, device=self.device)

    def residency_stats(self) -> dict[str, float]:
        return {"resident_weight_layers": self.residency.weights, "sharded_weight_layers": len(self.kept_shards.shards),
                "kept_shard_bytes": self.kept_shards.nbytes, "kept_graph_layers": len(self.graphs),
                "offloaded_graph_layers": len(self.offloaded), "offloaded_graph_bytes": self.graph_bytes_out,
                "recomputed_layers": self.recomputed, "optimizer_resident_layers": len(self.optimizer_layers)}

    def loss_chunk(self, setting: int | None) -> int:
        """This batch's head/loss chunk: the plan's, else the configured one (None, "auto": the default chunk)."""
        if self.last_plan is not None:
            return self.last_plan.loss_chunk
        return DEFAULT_LOSS_CHUNK if setting is None else int(setting)

    def plan_stats(self) -> dict[str, float]:
        p = self.last_plan
        return {"mlp_tile_tokens": (p.tile or 0) if p else 0, "activations_offloaded": float(p.offload) if p else 0.0,
                "predicted_peak_device_bytes": p.predicted_peak_bytes if p else 0,
                "loss_chunk_tokens": p.loss_chunk if p else 0}

    # -- weights in -------------------------------------------------------------------------------
    def _load(self, layer: int, slot: int) -> None:
        group = self.store.layers[layer]
        src = group.stream_source
        if layer in self.kept_shards.shards:
            self.loaded[slot] = self.kept_shards.load(layer, lambda: self.buffers[slot], self.freed[slot],
                                                      self.updated[layer])
            return
        if self.weights is not None and slot < self.ring_size:
            self._load_sharded(layer, slot)
            return

        def load() -> int:
            # The buffer is looked up when the copy runs, not held by the job: a copy thread keeps its last job
            # until its next, and a kept buffer a change of placement drops must be freed then (set_residency
            # drains the streams first, so the slot still holds this buffer here).
            buffer = self.buffers[slot]
            if buffer is src:  # an aliased kept layer: ordered after its update, nothing to copy
                return 0
            buffer[: group.numel].copy_(src, non_blocking=True)
            return src.numel() * src.element_size()

        self.loaded[slot] = self.streams.h2d.submit(load, (self.freed[slot], self.updated[layer]), "load", layer)

    def _load_sharded(self, layer: int, slot: int) -> None:
        """The node path's load: this rank's shard on the h2d stream, then the gather of the rest on the gather
        stream behind it, whose event is the slot's `loaded` (the compute stream waits for it as for a copy).
        Every rank issues its gathers in the same layer order (the schedule is the same on every rank)."""
        group, weights = self.store.layers[layer], self.weights
        src = group.stream_source

        def copy() -> int:
            return weights.copy_shard(self.buffers[slot], src, group.numel)

        def gather() -> int:
            return weights.gather(self.buffers[slot], group.numel)

        copied = self.streams.h2d.submit(copy, (self.freed[slot], self.updated[layer]), "load", layer)
        self.loaded[slot] = self.streams.gather.submit(gather, copied, "gather", layer)

    def _weights_step(self, step: order.Step, phase: str) -> None:
        """Run a LOAD or WAIT step."""
        if step.op == order.LOAD:
            self._load(step.layer, step.slot)
        else:
            self.streams.wait(self.loaded[step.slot], f"{phase} of layer {step.layer}")

    def acquire(self, layers: list[int], n: int, phase: str) -> int:
        """The device buffer slot holding layer layers[n], loaded (prefetching the next ones) and waited for."""
        for step in self.slots.acquire(layers, n):
            self._weights_step(step, phase)
        return step.slot

    # -- gradients out ----------------------------------------------------------------------------
    def _send_grad(self, layer: int, grads: list[torch.Tensor], after: Event) -> None:
        """Add one layer's per-parameter gradients into its host slab, off the compute stream."""
        group = self.store.layers[layer]
        if self.grad_shards is not None:
            self.landed[layer] = self.grad_shards.send(layer, group, grads, after,
                                                       (self.landed[layer], self.zeroed[layer]))
            return
        nbytes = sum(g.numel() * g.element_size() for g in grads if g is not None)
        if self.grad_sink is not None:
            self._send_grad_to_sink(layer, grads, after, nbytes)
            return
        slabs, measure = self.events.slabs, self.events.slabs.measure  # measure: as this backward asked
        fused_pays = reduce_kernel.pays(self.streams.d2h.threads)
        on_device = layer in self.optimizer_layers
        if self.device.type != "cuda" or on_device:
            def add(overwrite: bool) -> None:
                for slot, g in zip(group.slots, grads):
                    view = group.view(group.grad, slot)
                    if g is None:  # no gradient reached it (an expert no token was routed to): adds nothing
                        if overwrite:
                            view.zero_()  # what 0 + zeros writes
                    elif overwrite:
                        torch.add(g, 0.0, out=view)  # 0 + g: what zeroing then adding gives, in one pass
                    else:
                        view.add_(g)

            # One pass (add + norm, reduce_kernel.py), skipping what got no gradient.
            adds = PartsAdd(add, [(s.offset, None if g is None else g.reshape(-1))
                                  for s, g in zip(group.slots, grads)]) if fused_pays else add

            def reduce() -> int:
                slabs.reduce(layer, group.grad, adds, measure)
                return nbytes

            if on_device:
                # The slab is the device's: the same adds and norm on this thread, after the queued zeroing (a
                # flag) and the slab's last writer; nothing crosses the link, no reducer job.
                self.zeroed[layer].host_wait(self.streams.watchdog_s)
                self.landed[layer].host_wait(self.streams.watchdog_s)
                slabs.reduce(layer, group.grad, adds if group.grad.device.type == "cpu" else add, measure)
                return
            # After the slab's last writer too: data parallel averages it on another thread (engine/parallel/distributed.py).
            # (Today the engine's wait for the resident parameters' average at the start of each backward also
            # orders this, the averages being one FIFO; this keeps each slab's own order explicit.)
            self.landed[layer] = self.streams.d2h.submit(reduce, (after, self.zeroed[layer], self.landed[layer]),
                                                         "grad", layer)
            return
        i, staging, copied = self._stage(layer, grads, after, nbytes)

        def add(first: bool) -> None:
            accumulate(group.grad, staging, self.reduce_scratch, first)

        adds = PartsAdd(add, [(0, staging)]) if reduce_kernel.pays(self._reducer.threads) else add

        def reduce() -> int:
            slabs.reduce(layer, group.grad, adds, measure)
            return 0

        self._staging_free[i] = self._reducer.submit(reduce, (copied, self.zeroed[layer], self.landed[layer]),
                                                     "reduce", layer)
        self.landed[layer] = self._staging_free[i]

    def _stage(self, layer: int, grads: list[torch.Tensor], after: Event,
               nbytes: int) -> tuple[int, torch.Tensor, Event]:
        """Copy one layer's gradients into the next free host staging buffer on the d2h stream:
        (slot, staging view, event of the copy)."""
        group = self.store.layers[layer]
        i = self._next_staging
        self._next_staging = (i + 1) % len(self._staging)
        self._staging_free[i].host_wait(self.streams.watchdog_s)
        staging = self._staging[i][: group.numel]
        if self.device.type == "cuda":
            for g in grads:
                if g is not None:
                    g.record_stream(self.streams.d2h._stream)  # the allocator must not reuse it mid-copy

        def to_host() -> int:
            for slot, g in zip(group.slots, grads):
                if g is None:  # a frozen weight of a layer that trains (trainable.py): nothing crosses the link
                    group.view(staging, slot).zero_()
                else:
                    group.view(staging, slot).copy_(g, non_blocking=True)
            return nbytes

        return i, staging, self.streams.d2h.submit(to_host, after, "grad", layer)

    def _send_grad_to_sink(self, layer: int, grads: list[torch.Tensor], after: Event, nbytes: int) -> None:
        """Stage one layer's gradients and hand them to the sink (no slab)."""
        if not hasattr(self, "_staging"):  # CPU device: staging exists only for the optimizer in backward
            dtype = next(g.dtype for g in grads if g is not None)
            self._staging = [self.store.buffer(self.max_numel, dtype, "gradient staging") for _ in range(2)]
            self._staging_free, self._next_staging = [DONE, DONE], 0
        i, staging, copied = self._stage(layer, grads, after, nbytes)
        self._staging_free[i] = self.landed[layer] = self.grad_sink(layer, staging, copied)

    def synchronize_grads(self) -> None:
        """Block until every layer's (and the resident parameters') gradients have landed in their host slabs."""
        self.events.wait_grads()

    # -- compute ----------------------------------------------------------------------------------
    def forward(self, h: torch.Tensor, layer_inputs: list[tuple[tuple, dict]], acts: ActivationStore | None,
                phase: str = "fwd", side: SideInputs | None = None) -> torch.Tensor:
        """Run the layers forward from `h`; `side`: the inputs besides the hidden state that carry a gradient
        (side_inputs.py), whose leaves a kept layer's graph records."""
        graphs = self.graphs if acts is not None else frozenset()
        # State a layer hands a later one: its value put in place of the recorded stand-in as the layers run, in
        # layer_inputs itself, so the recompute replays the forward's value (handed_state.py).
        handed = HandedStates(layer_inputs)
        if acts is not None:
            acts.handed = handed  # what this forward's carried states were, for its backward
        offloaded = self.offloaded & graphs
        if offloaded:
            acts.saved = GraphOffload(self.streams, self.graph_pool, acts._account)
        for step in order.forward_steps(self.slots, len(self.store.layers), graphs, offloaded):
            i, slot = step.layer, step.slot
            if handed and step.op in (order.FORWARD_KEEP, order.FORWARD):
                layer_inputs[i] = handed.resolve(i, layer_inputs[i])
            if step.op in (order.LOAD, order.WAIT):
                self._weights_step(step, "forward")
            elif step.op == order.FORWARD_KEEP:
                t0 = self.trace.mark()
                h = self._forward_keep(i, slot, h, layer_inputs[i], acts, side, handed)
                self.freed[slot] = self.streams.record_compute()
                self.trace.add_since("compute", phase, i, t0)
            elif step.op == order.SEND_GRAPH:
                before = acts.saved.bytes_out
                acts.saved.send(i)
                self.graph_bytes_out += acts.saved.bytes_out - before
            elif step.op == order.SAVE_INPUT:
                if acts is not None:
                    acts.put(i, h)
                    if self.preserve_rng:
                        self._rng[i] = self._rng_state()
            elif step.op == order.FORWARD:
                group = self.store.layers[i]
                t0 = self.trace.mark()
                h = self._call(i, group.views(self.buffers[slot][: group.numel]), h, layer_inputs[i], handed,
                               self.tile)
                self.freed[slot] = self.streams.record_compute()
                self.trace.add_since("compute", phase, i, t0)
        return h

    def backward(self, g: torch.Tensor, layer_inputs: list[tuple[tuple, dict]], acts: ActivationStore,
                 grad_sent: Callable[[int], None] | None = None, side: SideInputs | None = None,
                 floor: int = 0, ceiling: int | None = None) -> torch.Tensor | None:
        """Backpropagate `g` through the layers; `grad_sent(i)` runs once layer i's gradients are queued to the host
        (data parallel: the layer's average across ranks is queued behind them, overlapping the next layer's).
        `side`: the layers' side inputs, whose gradients each layer's backward adds into it. `floor`: the lowest
        layer whose backward runs (nothing below it trains, engine/model/trainable.py); from 0 the first layer's
        input gradient is returned, else None. `ceiling`: the highest layer whose backward runs, `g` the gradient
        of its output (a backward an out-of-memory error cut short, going on below the layers it sent: oom.py);
        `resume` says where this one would go on from."""
        handed = getattr(acts, "handed", None) or HandedStates([])
        saved = getattr(acts, "saved", None)
        offloaded = saved.layers if saved is not None else frozenset()
        top = len(self.store.layers) - 1 if ceiling is None else ceiling
        self.resume = (top, g)
        for step in order.backward_steps(self.slots, len(self.store.layers), frozenset(acts.graphs), offloaded):
            i = step.layer
            if i > top and step.op not in (order.LOAD, order.WAIT):
                continue  # sent by the backward that was cut short (its weight copies issued: the buffers' model)
            if step.op in (order.BACKWARD, order.BACKWARD_KEPT):
                self.resume = (i, g)  # until its gradients are sent: redone from its output's gradient
            if i < floor:
                if step.op in (order.PREFETCH_INPUT, order.PREFETCH_GRAPH):
                    continue  # for a backward that will not run
                if step.op != order.LOAD:
                    break  # the first layer below the floor: backward ends
                # a weight copy the buffers' model has already recorded (costs/pipeline.py): issued, to keep it true
            if step.op in (order.LOAD, order.WAIT):
                self._weights_step(step, "backward")
            elif step.op == order.PREFETCH_GRAPH:
                saved.prefetch(i)
            elif step.op == order.FETCH_GRAPH:
                saved.fetch(i)
            elif step.op == order.BACKWARD_KEPT:
                g, gw, done = self._kept_backward(i, g, acts, side)
                self.resume = None  # its graph spent: a send that fails cannot be gone on from (oom.py raises it)
            elif step.op == order.PREFETCH_INPUT:
                acts.prefetch(i)
            elif step.op == order.FETCH_INPUT:
                x = acts.get(i).detach().requires_grad_(i > floor or floor == 0)  # the floor's input: no gradient
            elif step.op == order.BACKWARD:
                g, gw, done = self._layer_backward(i, step.slot, x, g, layer_inputs[i], side, handed)
                self.recomputed += 1
            elif step.op == order.SEND_GRAD:
                if self._trains(i):
                    self._send_grad(i, gw, done)
                    if grad_sent is not None:
                        grad_sent(i)
                self.resume = (i - 1, g)
            elif step.op == order.DROP_INPUT:
                acts.drop(i)
        self.resume = None
        if floor > 0:
            self._drop_below(floor, acts)
            return None
        return g

    def resumable(self, acts: ActivationStore) -> bool:
        """Whether a backward cut short at `resume` can go on: its layer's input (or kept graph) and dropout state
        are still there (an offloaded input already fetched, or a graph whose backward began, are not)."""
        if self.resume is None:
            return False
        top = self.resume[0]
        if top < 0:
            return True
        if top in acts.graphs:
            return True
        return not acts.offload and (not self.preserve_rng or top in self._rng)

    def recompute_kept(self, acts: ActivationStore, top: int) -> int:
        """The graphs this forward kept for layers up to `top` given up (their device memory freed), their inputs
        kept instead for a recompute in backward, the same bits (costs/residency.py); how many. One whose
        dropout state was not saved, or whose activations went to the host, stays."""
        saved = getattr(acts, "saved", None)
        gone = 0
        for i in sorted(acts.graphs):
            if i > top or (self.preserve_rng and i not in self._rng) or (saved is not None and i in saved.layers):
                continue
            x = acts.take_graph(i)[0]
            acts.put(i, x.detach())
            gone += 1
        return gone

    def _trains(self, i: int) -> bool:
        return self.trainable is None or self.trainable.layer_trains(i)

    def _drop_below(self, floor: int, acts: ActivationStore) -> None:
        """What the forward kept for the layers below `floor` (their inputs, graphs, dropout RNG), which no backward
        reads: freed."""
        saved = getattr(acts, "saved", None)
        for i in range(floor):
            self._rng.pop(i, None)
            if i in acts.graphs:
                acts.take_graph(i)
                if saved is not None and i in saved.layers:
                    saved.drop(i)
            else:
                acts.drop(i)

    def _leaves(self, i: int, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Layer i's weights as autograd leaves, one per parameter (not one flat leaf: autograd then returns each
        weight's gradient as is, instead of scattering every one into a zero-filled layer-sized tensor); a frozen
        weight's leaf requires no gradient, so none is computed for it."""
        trains = self.trainable.layer_weights(i) if self.trainable is not None else {}
        return {n: w.detach().requires_grad_(trains.get(n, True)) for n, w in views.items()}

    def _call(self, i: int, weights: dict[str, torch.Tensor], x: torch.Tensor, inputs: tuple[tuple, dict],
              handed: HandedStates, tile: int | None = None) -> torch.Tensor:
        """Layer i on what the loop carries into it: a hidden state, or one packed with a state handed on from the
        layer before (handed_state.py); returns what the loop carries out of it."""
        if not handed:
            return self.templates.call(i, weights, x, *inputs, tile)
        h, (args, kwargs) = handed.unpack(i, x, inputs)
        y = self.templates.call(i, weights, h, args, kwargs, None if handed.touches(i) else tile)
        return handed.pack(i, y, self.templates.handed)

    def _forward_keep(self, i: int, slot: int, h: torch.Tensor, inputs: tuple[tuple, dict],
                      acts: ActivationStore, side: SideInputs | None = None,
                      handed: HandedStates | None = None) -> torch.Tensor:
        """Layer i's forward recording its graph, kept in `acts` for its backward: the same call the recompute
        makes, so the same values (and, for a mixture of experts, the router logits it records, with their graph)."""
        group = self.store.layers[i]
        weights = self._leaves(i, group.views(self.buffers[slot][: group.numel]))
        x = h.detach().requires_grad_(True)
        inputs, leaves = side.leaves(i, inputs) if side else (inputs, [])
        saved = getattr(acts, "saved", None)
        # Only the activations this forward makes move: what the device holds anyway stays in the graph.
        keep = [x, self.buffers[slot], *leaves, *tree_flatten(inputs)[0]]
        recording = saved.recording(i, keep) if saved is not None and i in self.offloaded else nullcontext()
        with torch.enable_grad(), recording:
            y = self._call(i, weights, x, inputs, handed or HandedStates([]))
        logits = list((self.templates.recorded or {}).get(i, ()))
        acts.keep_graph(i, (x, weights, y, logits, leaves))
        return y.detach()

    def _kept_backward(self, i: int, g: torch.Tensor, acts: ActivationStore,
                       side: SideInputs | None = None) -> tuple[torch.Tensor, list[torch.Tensor], Event]:
        """Backpropagate g through layer i's kept graph (no recompute): (input gradient, weight gradients, the
        event after which they are computed)."""
        x, weights, y, logits, leaves = acts.take_graph(i)
        outs, gouts = self.templates.with_router_grads(i, y, g, logits)
        t0 = self.trace.mark()
        try:
            with torch.enable_grad():
                gx, gw = self._grads(outs, x, weights, gouts, *((leaves, side, i) if leaves else ()))
        except torch.OutOfMemoryError:
            acts.put(i, x.detach())  # its graph may be half freed: recomputed from its input where it goes on
            raise
        del outs, y
        saved = getattr(acts, "saved", None)
        if saved is not None:
            saved.drop(i)  # its device copies, freed once the backward that read them is queued
        done = self.streams.record_compute()
        self.trace.add_since("compute", "bwd", i, t0)
        return gx, gw, done

    def _grads(self, outs: tuple, x: torch.Tensor, weights: dict[str, torch.Tensor], gouts: tuple,
               leaves: list[torch.Tensor] = (), side: SideInputs | None = None,
               i: int = -1) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """(input gradient, weight gradients) of one layer's outputs. A weight no gradient reaches (an expert no
        token was routed to) gets None where the host's add skips it (slab_state.PartsAdd); the staged paths
        copy every gradient: zeros, as in PyTorch. The gradients of layer i's side-input `leaves` go into `side`."""
        wanted = [t for t in (x, *weights.values(), *leaves) if t.requires_grad]  # a frozen weight: none
        got = iter(torch.autograd.grad(outs, wanted, gouts, allow_unused=True,
                                       materialize_grads=self.device.type == "cuda" or self.grad_sink is not None))
        gx, *gw = [next(got) if t.requires_grad else None for t in (x, *weights.values(), *leaves)]
        if leaves:
            side.add_grads(i, gw[len(gw) - len(leaves):])
            gw = gw[: len(gw) - len(leaves)]
        return gx, gw

    def _layer_backward(self, i: int, slot: int, x: torch.Tensor, g: torch.Tensor, inputs: tuple[tuple, dict],
                        side: SideInputs | None = None,
                        handed: HandedStates | None = None) -> tuple[torch.Tensor, list[torch.Tensor], Event]:
        """Recompute layer i from buffer `slot` and backpropagate g: (input gradient, weight gradients, the
        event after which the buffer is free)."""
        group = self.store.layers[i]
        weights = self._leaves(i, group.views(self.buffers[slot][: group.numel]))
        inputs, leaves = side.leaves(i, inputs) if side else (inputs, [])
        args, kwargs = inputs
        handed = handed or HandedStates([])
        t0 = self.trace.mark()
        with torch.enable_grad(), torch.random.fork_rng(self._rng_devices(), enabled=self.preserve_rng):
            if self.preserve_rng:
                self._set_rng_state(self._rng[i])
            if (self.tile is not None and not args and not leaves and not handed.touches(i)
                    and self.templates.tileable(i)):
                with self.templates.kernels():
                    gx, gw = tiled_vjp(self.templates.of_layer[i], weights, x.detach().requires_grad_(True), kwargs,
                                       g, self.tile)
            else:
                y = self._call(i, weights, x, inputs, handed)
                # A mixture-of-experts layer also backpropagates its router logits' gradients from the router loss.
                outs, gouts = self.templates.with_router_grads(i, y, g)
                gx, gw = self._grads(outs, x, weights, gouts, *((leaves, side, i) if leaves else ()))
                del y, outs
        self._rng.pop(i, None)  # drawn again only by a backward that failed before here (oom.py goes on from it)
        done = self.streams.record_compute()
        self.freed[slot] = done
        self.trace.add_since("compute", "bwd", i, t0)
        return gx, gw, done

    # -- dropout: recompute must draw the same random numbers as the forward ----------------------
    def _rng_devices(self) -> list:
        return [self.device] if self.device.type == "cuda" else []

    def _rng_state(self) -> tuple:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def _set_rng_state(self, state: tuple) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)
