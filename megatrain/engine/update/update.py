"""The engine's update path: when, and on which thread, each layer's update runs.

Every path runs the same per-layer job: wait for the layer's gradients, check them (the global norm and
finiteness before any layer; per layer in backward), AdamW on its FP32 master (`update_layer`: a bf16 slab
widened, pending clipping applied, a hi/lo or bf16 master unpacked first and stored back after), write the
copy that streams to the device, and release the layer to the next load (its `updated` event; a shared
store adds its owner's token or a node barrier after the step, ranks.py). Which path, is chosen once when the
engine is built (`choose`):

- WholeStep: in step(), on the caller's thread, one optimizer.step() over every master (any torch optimizer;
  an FP32 master with a bf16 shadow and torch's fused Adam/AdamW take Layered instead, choose.py `layer_pass_pays`).
- Layered: in step(), each layer queued on the optimizer thread in forward order behind its gradients, then the
  resident parameters updated on the caller's thread beside them (embedding first; on the device, launched there,
  when their optimizer is: resident.py place_globals); with optimizer_overlap
  step() returns once those are done (the next forward's load of a layer waits for its update), otherwise it
  waits for the layers too (the hilo/bf16 masters and bf16 slabs update a layer at a time).
- InBackward (optimizer_in_backward): during backward, on the optimizer thread, each layer as soon as its
  gradients are staged (no gradient slab); step() then updates the resident parameters.
- Speculative (speculative_step, speculative.py): Layered, each layer's update started during backward as its
  gradient lands, before the step's verdict (clip, finite); step() keeps it or restores the layer from a copy
  and updates it as Layered does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...config.schema import EngineConfig
from ..host.events import LayerEvents
from ..host.spill import Spill, SpillFactory
from ..host.store import FlatGroup, HostStore
from ..runtime.stream import Event, Trace
from ..runtime.threads import share, update_threads
from . import by_shard, fused
from .clipping import Clipping
from .optim import LayeredStep


def update_layer(layered: LayeredStep, group: FlatGroup, i: int, coefs: list[float], threads: int | None = None) -> None:
    """Layer i's update on the calling thread: FP32 gradients (times `coefs`) and master, AdamW, master and
    streamed copy written back; in one pass of cache-sized tiles where the optimizer allows (fused.py), on
    `threads` workers (None: every torch thread)."""
    if group.grad is not None:
        layered.events.slabs.zero_if_fresh(i, group.grad)  # a step after zero_grad() with no backward: zeros
    if layered.ranges is not None:  # the node path: this rank's ranges of the layer (by_shard.py)
        layered.updated_elements += by_shard.update(layered.view_optimizer(i), group, coefs, layered.ranges[i])
        return
    layered.updated_elements += group.numel
    update_group(layered.view_optimizer(i), group, coefs, threads)


def update_group(view: torch.optim.Optimizer | None, group: FlatGroup, coefs: list[float],
                 threads: int | None = None) -> None:
    """`group`'s update by `view` (its share of the optimizer; None: another rank's), its gradients times
    `coefs`: the fused pass where it applies (on `threads` workers), else whole-group passes (load and scale,
    unpack, step, pack)."""
    if view is None and group.owned:
        return  # a layer none of whose parameters train (engine/model/trainable.py): nothing to update
    if view is not None and fused.eligible(view, group):
        fused.fused_update(view, group, coefs, threads=threads)
        return
    group.load_grads(coefs)
    group.unpack()
    if view is not None:
        view.step()
    group.pack()


def unlink_fresh(store: HostStore, events: LayerEvents) -> None:
    """After zero_grad(): the layers' Parameters show no gradient (torch's set_to_none), not the bytes of a slab the
    next backward overwrites instead of zeroing now. The engine's backward links them again."""
    if events.slabs.overwrite:
        for g in store.layers:
            if g.grads.linked(g) is not None:  # an FP32 slab of this rank's, which the Parameters' .grad view
                for p in g.params:
                    p.grad = None


def _alone(value: int, what: str) -> int:
    """One rank's verdict is everyone's."""
    return value


class UpdatePath:
    """What the engine asks of an update path. This one is the whole step: in step(), on the caller's thread."""

    layered: LayeredStep | None = None  # the per-layer optimizer views and their thread, if this path has them
    grad_sink: Callable[[int, torch.Tensor, Event], Event] | None = None  # takes a layer's gradients (no slab)
    overlapped = False  # step() returns with layer updates still queued
    folds_clip = False  # FP32 slabs are clip-scaled inside their update (clipping.py: the clip left pending)
    spill: Spill | None = None  # the NVMe tier (spill.py): spilled state read in around each layer update
    rollbacks = 0  # steps whose speculative layer updates were undone (speculative.py)
    # Layers whose master and Adam state live on the device (resident.py): updated on the caller's thread at step()
    device_layers: frozenset[int] = frozenset()

    def reset_stats(self) -> None:
        """Start the path's own counts again (Engine.reset_stats)."""
        self.rollbacks = 0

    def __init__(self, optimizer: torch.optim.Optimizer, store: HostStore, events: LayerEvents,
                 config: EngineConfig) -> None:
        self.optimizer, self.store, self.events, self.config = optimizer, store, events, config
        # Host threads the update runs on (the start line's "host threads"): here the whole step, nothing beside it.
        self.threads = update_threads(False)

    def check_backward(self) -> None:
        """Refuse a backward this path cannot take exactly (before any gradient is added)."""

    def begin_backward(self) -> None:
        """A backward is about to add gradients."""

    def grad_sent_hook(self, ranks_hook: Callable[[int], None] | None,
                       sync: bool) -> Callable[[int], None] | None:
        """What the pipeline calls once layer i's gradients are queued to the host: the ranks' hook (`ranks_hook`),
        and this path's own where it has one; `sync`: the backward's (a step may follow it)."""
        return ranks_hook

    def before_forward(self) -> None:
        """A forward is about to read the weights."""

    def check_norm(self) -> None:
        """Refuse a global gradient norm this path cannot give."""

    def check_zero_grad(self) -> None:
        """Refuse a zero_grad() that cannot undo what it would be expected to."""

    def step(self, finite: Callable[[], bool], clip: Clipping) -> bool:
        """Update every parameter (or queue it); False when the step was skipped. `finite()`: whether the
        gradients may be applied (it counts a skipped step); `clip`: the clipping still pending on the slabs."""
        if not finite():
            return False
        for g in self.store.groups():
            g.link_grads()
        self.events.wait_grads()  # the step reads every slab, whatever the knobs
        for i, g in enumerate(self.store.layers):
            if g.grad is not None:
                self.events.slabs.zero_if_fresh(i, g.grad)  # no backward since zero_grad(): its zeros
        with share(self.threads):  # this process's share of the cores, not the caller's (a launcher's 1)
            self.optimizer.step()
        for g in self.store.layers:
            g.refresh_shadow()
        return True

    def zero_grad(self) -> None:
        self.store.globals.grad.zero_()
        for i, g in enumerate(self.store.layers):
            if g.grad is not None:
                self.events.slabs.zero(i, g.grad)  # a flag where the next reduction overwrites (slab_state.py)
        unlink_fresh(self.store, self.events)

    def weights_loaded(self) -> None:
        """New weights were loaded (a checkpoint): what a failed update left behind no longer holds."""

    def settle(self) -> None:
        """Block until no queued job of this path writes a gradient slab (before the slabs are read)."""
        self.synchronize()

    def synchronize(self) -> None:
        """Block until every queued update is done."""
        if self.layered is not None:
            self.layered.synchronize()
            if self.spill is not None:
                self.spill.flush()  # the writes behind the updates: the spilled state is the files' again


WholeStep = UpdatePath


class Layered(UpdatePath):
    """In step(): each layer queued on the optimizer thread behind its gradients, then the resident parameters
    updated on the caller's thread while the optimizer thread works through the layers. `spill` (spill.py's
    spill_for): the NVMe tier, built here over this path's optimizer thread."""

    def __init__(self, optimizer: torch.optim.Optimizer, store: HostStore, events: LayerEvents,
                 config: EngineConfig, trace: Trace, spill: SpillFactory | None = None) -> None:
        super().__init__(optimizer, store, events, config)
        self.layered = LayeredStep(optimizer, store, events, trace, config.watchdog_s)
        self.spill = spill(optimizer, self.layered.synchronize) if spill is not None else None
        self.overlapped = config.optimizer_overlap
        self.folds_clip = True
        # Overlapped, the layer updates run beside the next forward: they leave the launch and copy threads a core.
        self.threads = update_threads(self.overlapped)
        self.layered.stream.threads = self.threads  # the optimizer thread's own torch ops (an unfused update's passes)

    def step(self, finite: Callable[[], bool], clip: Clipping) -> bool:
        if not finite():
            return False
        for g in self.store.groups():
            g.link_grads()
        self.events.wait_global_grads()  # the globals are updated right away; each layer waits for its own
        layered, layers, coefs = self.layered, self.store.layers, clip.layer_coefs()
        spill = self.spill
        pending = clip.resident_coefs()  # a folded clip; with bf16 layer slabs their FP32 slab was scaled at the clip
        threads = self.threads

        def update(i: int) -> None:
            if spill is None:
                update_layer(layered, layers[i], i, coefs, threads)
            else:  # the same update, with the spilled state read in around it
                spill.around(i, lambda: update_layer(layered, layers[i], i, coefs, threads))

        if spill is not None:
            spill.begin_step()
        self._queue(update, pending)
        if not self.overlapped:
            layered.synchronize()  # a per-layer mode without overlap: step() returns with every layer done
        return True

    def _queue(self, update: Callable[[int], None], pending: list[float], sync: bool = True) -> None:
        """Every layer's update queued on the optimizer thread (in forward order, each behind its gradients' last
        reduction) before the resident parameters' update starts here: the optimizer thread starts on layer 0
        while this thread updates the resident ones, not after (issue 40's serial gap). The same jobs and
        hyper-parameters as LayeredStep.step, which updated the resident parameters first."""
        layered = self.layered
        if sync:  # (else the views hold this step's already, taken before jobs that may still run)
            layered.sync_all()  # the previous step's jobs done; this step's LR and state links taken for every view
        for i in range(len(self.store.layers)):
            if i in self.device_layers:
                continue

            def job(i: int = i) -> int:
                update(i)
                return 0

            layered.submit(i, job, self.events.landed[i])
        view = layered.view_globals()
        with share(self.threads):  # this thread's torch ops on the update's share, not the caller's (a launcher's 1)
            if view is not None:
                # The embedding first (the next forward reads it first), the final norm and the head after it: the
                # order of the resident group's parameters (placement: the model's own order, embedding first).
                update_group(view, self.store.globals, pending, self.threads)
            for i in sorted(self.device_layers):
                # On the device, here: their gradients were added on this thread (no reducer job to wait for), and
                # what they launch is ordered after the backward that wrote them.
                self.events.landed[i].host_wait(self.config.watchdog_s)
                update(i)
        layered.optimizer._opt_called = True  # LR schedulers check that optimizer.step() ran before them

    def zero_grad(self) -> None:
        self.layered.zero_grad()  # each layer's after its queued update, off this thread
        unlink_fresh(self.store, self.events)


class InBackward(UpdatePath):
    """During backward: each layer's update queued on the optimizer thread as soon as its gradients are staged.
    `agree` (ranks.py agree_max): the verdict of every rank, given with data-parallel ranks (None: one rank)."""

    def __init__(self, optimizer: torch.optim.Optimizer, store: HostStore, events: LayerEvents,
                 config: EngineConfig, trace: Trace, agree: Callable[[int, str], int] | None = None) -> None:
        super().__init__(optimizer, store, events, config)
        self.layered = LayeredStep(optimizer, store, events, trace, config.watchdog_s)
        self.grad_sink = self._update
        self._unstepped = False  # layers updated by a backward whose step() is to come
        self._failed_layer: int | None = None  # the layer whose gradient was not finite (-1: the resident ones)
        # The verdict of every rank (ranks.py agree_max): with one host store per node each layer is checked by its
        # owner alone, so the ranks take the largest failed index (-2: none) and fail the step together.
        self.agree: Callable[[int, str], int] = agree or _alone
        self.data_parallel = agree is not None
        self.threads = update_threads(True)  # beside backward: the launch and copy threads keep their cores
        self.layered.stream.threads = self.threads  # the optimizer thread's own torch ops, as update_now's workers

    def check_backward(self) -> None:
        if self._failed_layer is not None:
            raise FloatingPointError("a previous optimizer_in_backward step was cut short by a non-finite gradient; "
                                     "load a checkpoint (load_state_dict / load_checkpoint) before training on")
        if self._unstepped:
            raise RuntimeError("optimizer_in_backward: the last backward() already updated the layers, so its step() "
                               "must come before the next backward (gradient accumulation is not possible in this "
                               "mode); use gradient_accumulation_steps=1, or optimizer_in_backward=false")

    def begin_backward(self) -> None:
        self.layered.sync_all()  # this step's LR and state, taken before the first layer update
        self.layered.create_layer_states()  # at once, not among backward's transients (the first step only)
        self._unstepped = True

    def check_norm(self) -> None:
        raise RuntimeError("optimizer_in_backward: the layers' gradients are consumed during backward, so there "
                           "is no global gradient norm (nor clipping by it); set optimizer_in_backward=false "
                           "to clip")

    def _update(self, i: int, staging: torch.Tensor, staged: Event) -> Event:
        """Queue layer i's update behind the staging of its gradients (the pipeline's grad_sink)."""
        def job() -> int:
            self.update_now(i, staging)
            return 0

        # Behind the staging copy, and behind whatever last landed for this layer.
        return self.layered.submit(i, job, (staged, self.events.landed[i]))

    def update_now(self, i: int, staging: torch.Tensor) -> None:
        """Layer i's update from its staged gradients, on the calling thread (the job queued by _update)."""
        group = self.store.layers[i]
        if self._failed_layer is not None:
            return  # an earlier layer's gradient was not finite: step() reports it
        threads = self.threads
        if self.config.skip_nonfinite and not fused.all_finite(staging[: group.numel], threads=threads):
            self._failed_layer = i
            return
        view = self.layered.view_optimizer(i)
        if view is not None and fused.eligible(view, group):
            fused.fused_update(view, group, [], grad_source=staging, threads=threads)  # one pass: staging to master
            return
        gw = group.grad_work
        gw.zero_()
        gw.add_(staging[: group.numel])  # 0 + g: the value an ordinary zeroed FP32 slab holds after one backward
        update_layer(self.layered, group, i, [], threads)

    def step(self, finite: Callable[[], bool], clip: Clipping) -> bool:
        """The layers are updated (or the step failed; each layer checked its own): the resident parameters now."""
        if not self._unstepped:
            raise RuntimeError("optimizer_in_backward: step() without a backward() since the last step")
        self.events.wait_grads()
        self.synchronize()
        self._unstepped = False
        n = len(self.store.layers)
        bad = self._failed_layer
        if bad is None and self.config.skip_nonfinite and not bool(torch.isfinite(self.store.globals.grad).all()):
            bad = -1
        if self.config.skip_nonfinite:
            # The largest index is the first layer to fail in backward's order (a layer before the resident ones).
            bad = self.agree(-2 if bad is None else bad, "agreeing whether the step's gradients were finite")
            bad = None if bad == -2 else bad
        if bad is not None:
            self._failed_layer = bad  # every rank refuses the next backward until a checkpoint is loaded
            updated = f"layers {bad + 1}..{n - 1}" if bad >= 0 else "every layer"
            if self.data_parallel and bad >= 0:  # each owner went on with its own layers until this verdict
                updated = f"layers other than {bad} (by their owning ranks, before every rank knew)"
            raise FloatingPointError(
                f"non-finite gradient ({'layer ' + str(bad) if bad >= 0 else 'embedding/norm/head'}) with "
                f"optimizer_in_backward: {updated} were already updated during backward, so this step cannot be "
                "skipped as skip_nonfinite asks; load the last checkpoint, then lower the LR or check the data")
        for g in self.store.groups():
            g.link_grads()
        self.layered.step_globals()
        return True

    def check_zero_grad(self) -> None:
        if self._unstepped:
            raise RuntimeError("optimizer_in_backward: the last backward() already updated the layers; zero_grad() "
                               "before step() cannot discard that update. Call step() after each backward()")

    def weights_loaded(self) -> None:
        self._failed_layer = None
        self._unstepped = False
