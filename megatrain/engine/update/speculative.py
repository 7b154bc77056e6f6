"""The speculative step: each layer's host update during backward, validated at step() and rolled back if wrong.

A layer's update needs the step's verdict (the global gradient norm: clip or not, finite or not), which is known
only once every gradient has landed. Waiting for it puts every layer update after backward. This path starts
layer i's update as soon as its gradient has landed (the pipeline's `grad_sent(i)`), with the coefficient a step
that does not clip takes (none), after copying what the update writes (`StateCopy`: the master or its halves,
the streamed copy, Adam's m and v and step, the rounding generator). step() then checks the speculation held:

- the gradients were finite (with skip_nonfinite), and no clip scales them (a clip whose coefficient is 1 scales
  nothing: the serial update multiplies by nothing either);
- the optimizer's hyper-parameters (the LR) are those the speculation took at backward;
- the layer's slab is the one the speculation read (its version counter; a hand-written `.grad`);
- the layer was speculated at all: only a layer whose reduction measured a finite norm is (a layer with a
  non-finite gradient waits for the verdict, so no update runs on NaNs).

A layer that held is done; any other is restored from its copy and updated as the serial path updates it (its
job on the optimizer thread, in forward order, restore first), or only restored where the step is skipped. A
speculative job that finds the next speculated layer down landed already (the host is behind backward) puts its
layer off: the last (lowest) layer's job takes the layers put off, lowest first, while the step has not come. So
what the host cannot finish in backward is the higher layers, which the next forward reaches last, not the lowest,
which it reaches first. A speculative job that has not started when step() comes does nothing: its layer is updated by the step's job, in
forward order and without a copy, as Layered updates it (so what backward could not hide costs what overlap costs). The
restored bytes are the copied ones, so every path gives the serial step's bits (tests/unit/test_speculative_step.py).
A read of the weights or state between backward() and step() (Engine.synchronize, a forward, zero_grad, a load)
restores the speculated layers first: what it sees is the serial path's. Each step (or read) that restores any
layer counts one rollback (`rollbacks`, collect_stats()["speculative_rollbacks"]). "auto" pauses speculating where it
keeps losing (BACK_OFF_AFTER: a clip that scales most steps), so such a run costs what speculative_step=False costs
(results/speculative_backoff); True speculates every step.

Partial speculation: only the layers in `layers` speculate (resolve: "auto" takes as many as their rollback copies
fit in the host memory left, the first host-updated layers in forward order; left once the state exists: resolve runs
while the engine is built, before the first backward writes the gradient slabs' pages and before torch creates Adam's
state, so those bytes (state_to_come_bytes) and a headroom are taken off the free memory first); the others are updated at step() as
Layered updates them, in forward order with the speculated ones. Why the first: with overlap the next forward waits
on layer i's update before layer i. The first layers' gradients land last in backward, so their updates are the ones
the step would otherwise queue first and the forward would wait on first; done in backward, the forward runs through
them while the host starts on the rest (each speculated layer removes a whole layer update from that wait). A last
layer's gradient lands first, but the forward reaches it last, when the host is done with the layers before it
anyway: speculating it saves only its update less a layer's forward. Without overlap every layer not speculated
is updated after backward whichever they are. (planner/step_time.py speculative_wait replays this queue; where a
speculation takes no longer than a layer's backward, the first n layers are the best n to speculate there.)

Gradient accumulation: a backward speculates when as many backwards have run since the last step as before it
(the last step's count), and with `sync` (a step may follow); a step taken sooner finds layers not speculated and
updates them serially. The copies are kept from step to step (the rollback memory, rollback_bytes_per_param).

Several ranks (data parallel, docs/DISTRIBUTED.md section 3): each rank speculates the updates it would make at
step(), once their gradients are final on this rank, and the verdict is the same on every rank (the global norm is
one all-reduced value, so the clip and the finite check agree; the LR is every rank's), so every rank keeps or rolls
back the same steps, and "auto"'s back-off, fed only those verdicts and whether the backward speculated (the same
on every rank, not whether this rank had a layer to), pauses alike. Per path:
- per rank, each rank its own store: every layer, queued behind the ranks' average of its slab (the ranks' hook
  runs first and makes `landed[i]` the average's, grad_sent_hook);
- per rank, the node's shared store: the layers this rank owns, behind the reduction of the node's gradients into
  its slab; a restore writes the node's master, which the other ranks load with no wait on this rank's events, so a
  discard of a backward that speculated (a forward, a read or a skipped step before step(); every rank makes the
  same call) waits for its restores and then meets every rank (`agree`) before any goes on. A step's verdict needs
  no more: its restores are queued before the layer's "updated" token (ranks.py release);
- the node path's update by shard: this rank's ranges of every layer, behind the landing of its shard of the
  reduce-scatter; its copy is what by_shard.update writes (by_shard.written), so a restore never writes the other
  ranks' ranges of the shared master and moments.
- nodes sharing one store (parallel/shared_store.py, docs/DISTRIBUTED.md section 5(b)): each layer only on its owner
  rank of its owner node (the others have no optimizer view of it: nothing speculated, copied or restored there),
  behind the reduce into its slab; the norm is one all-reduce over every rank's slabs (ranks.py NodesShare,
  NodesShareByNode), so one verdict and one finite check for the job. One rank per node: the owner's copy into its
  ring slot, which its broadcast sends to the other nodes, waits for its restore as any load waits for the layer's
  update. Several ranks per node: as the node's shared store above (a discard meets every rank of the job).
  "auto" stays off there (resolve says why).
No reduction measures a slab's norm with several ranks (the ranks' sum lands after it): with skip_nonfinite the
speculative job checks the slab (its ranges) is finite first, so no update runs on NaNs here either. The copies a
node holds: one per speculated layer on the shared store (each rank its layers or its ranges), one per rank with
each rank its own store; resolve sizes the count as for one process, and each copy checks the host again when it
is first allocated (_room_for), which is what holds several private stores on one host to its memory.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from ...config.schema import EngineConfig
from ...costs.modes import ADAM_BYTES
from ...costs.rollback import rollback_budget
from ..host import preflight
from ..host.events import LayerEvents
from ..host.store import FlatGroup, HostStore
from ..runtime.stream import DONE, Trace
from ..runtime.threads import update_threads
from . import by_shard, fused
from .clipping import Clipping
from .optim import unsupported_reason
from .update import Layered, update_layer

_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
log = logging.getLogger("megatrain")
# "auto" backs off where speculation keeps losing (a clip that scales most steps: each rolled-back step pays the
# speculative update, the copy, the restore and the serial update): after BACK_OFF_AFTER steps in a row with a
# rollback it does not speculate for QUIET_STEPS steps, then tries again; a retry that loses backs off at once, for
# twice as long (up to MAX_QUIET_STEPS), and a step whose speculation holds resets both.
BACK_OFF_AFTER = 3
QUIET_STEPS = 20
MAX_QUIET_STEPS = 320


class StateCopy:
    """Copies of what one layer's update writes, taken before the update and written back to undo it. The copy's
    buffers are allocated at the first save and reused (the rollback memory). `ranges`: the node path's update by
    shard writes only this rank's ranges of the layer (by_shard.written), with its Adam state made already."""

    def __init__(self, ranges: list[tuple[int, int]] | None = None) -> None:
        self.ranges = ranges
        self._buffers: list[torch.Tensor] = []
        self._empty: list[dict] = []  # Adam state dicts that were empty (a first step): emptied again
        self._ties: torch.Tensor | None = None
        self._rng: torch.Tensor | None = None

    def _live(self, group: FlatGroup, view: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[dict]]:
        """The tensors the update writes in place, and the state dicts it fills from empty."""
        if self.ranges is not None:
            return by_shard.written(view, group, self.ranges), []
        live = [t for t in (group.master, group.shadow, group.lo) if t is not None]
        empty = []
        for g in view.param_groups:
            for p in g["params"]:
                st = view.state[p]
                if not st:
                    empty.append(st)
                live.extend(st[k] for k in _STATE_KEYS if k in st)
        return live, empty

    def save(self, group: FlatGroup, view: torch.optim.Optimizer,
             room: Callable[[int], bool] = lambda nbytes: True) -> bool:
        """Copy what the update writes; where the copy's buffers must be (re)allocated, only if `room(bytes)` says
        they fit (False: nothing copied)."""
        live, empty = self._live(group, view)
        if [(t.shape, t.dtype) for t in live] != [(b.shape, b.dtype) for b in self._buffers]:
            if not room(sum(t.numel() * t.element_size() for t in live)):
                return False
            self._buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in live]
        self._empty = empty
        for b, t in zip(self._buffers, live):
            b.copy_(t)
        self._ties = group.ties  # the update replaces the tensor (a private tie list), never writes into it
        self._rng = group.rounding.get_state() if group.rounding is not None else None
        return True

    def restore(self, group: FlatGroup, view: torch.optim.Optimizer) -> None:
        for st in self._empty:
            st.clear()  # torch's first step made it: the state is absent again, as before that step
        live, _ = self._live(group, view)
        for b, t in zip(self._buffers, live):
            t.copy_(b)
        group.ties = self._ties
        if self._rng is not None:
            group.rounding.set_state(self._rng)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)


class Speculative(Layered):
    """Layered, with each layer's update started in backward and validated in step() (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, store: HostStore, events: LayerEvents,
                 config: EngineConfig, trace: Trace, layers: frozenset[int] | None = None,
                 back_off: bool = False, agree: Callable[[int, str], int] | None = None) -> None:
        super().__init__(optimizer, store, events, config, trace)
        # Data-parallel ranks (`agree`: ranks.py agree_max; the module docstring's "Several ranks"): no reduction
        # measures a slab's norm, and with the node's one store the other ranks read what a rollback restores.
        self.data_parallel = agree is not None
        self._agree = agree
        self._shares = agree is not None and getattr(store, "ranks_sharing", 1) > 1
        self._open = False  # this backward speculates (armed, and a step may follow): the same on every rank
        self.back_off = back_off  # "auto": speculation paused while it keeps losing (BACK_OFF_AFTER); True: never
        self._lost = 0  # steps in a row whose speculation was rolled back
        self._quiet = 0  # steps left before speculation is tried again
        self._window = QUIET_STEPS  # the next pause's length
        self.backoffs = 0  # pauses begun (collect_stats()["speculative_backoffs"])
        self.quiet_steps = 0  # steps taken without speculating while paused (collect_stats())
        n = len(store.layers)
        # The layers that speculate (None: every one); a copy of a layer that does not is never filled: no memory
        self.layers = frozenset(range(n)) if layers is None else frozenset(layers)
        self._shrunk = False  # a layer's copy stopped fitting since the count was measured (_room_for)
        self._below_of: tuple[tuple | None, dict[int, int]] = (None, {})  # _below's table, for the sets it was made of
        self.copies = [StateCopy(self._ranges(i)) for i in range(n)]
        self.submitted = [False] * n  # a speculative job was queued for the layer since the last verdict
        # Per layer, written by its job on the optimizer thread: the slab version the speculation read (None: the
        # layer was not updated), read by the jobs queued after it on the same thread.
        self.speculated: list[int | None] = [None] * n
        self.rollbacks = 0
        self.kept_layers = 0  # layer updates the verdict kept (written on the optimizer thread only)
        self.passed_over = 0  # speculations put off because a lower layer had landed (optimizer thread)
        self._passed: list[tuple[int, int]] = []  # (backward, layer) put off, for the lowest layer's job (same)
        self._round = 0  # backwards begun: a job knows its own
        # Put a layer off where the next one down has landed before its speculation starts (the module docstring
        # says why); False: every speculation in landing order, however far behind backward the host is.
        self.pass_over = True
        self._lock = threading.Lock()
        self._rolled_at = -1  # the verdict that last counted a rollback (each counts once)
        self._verdict = 0
        self._hyper: list[dict[str, Any]] | None = None  # the hyper-parameters the speculation took
        self._state: dict | None = None  # the optimizer's state it updated (a load_state_dict replaces it)
        self._backwards = 0  # backwards since the last step
        self._per_step = 1  # backwards the last step followed
        self._armed = False
        # The verdict is known (step() or a read came): a speculative job not yet started leaves its layer to the
        # step's job, which updates it in forward order without a copy, as Layered does.
        self._decided = True

    # -- backward: each layer's update as its gradient lands ---------------------------------------------
    def begin_backward(self) -> None:
        self.discard()  # gradients are about to be added: any update taken from the old ones is wrong
        self._round += 1
        self._backwards += 1
        self._armed = self._backwards >= self._per_step and not self._quiet
        if self._armed:
            self.layered.sync_all()  # this step's LR and state links, taken before the first layer update
            self._hyper, self._state = _hyper(self.optimizer), self.optimizer.state
            self._decided = False

    def grad_sent_hook(self, ranks_hook: Callable[[int], None] | None,
                       sync: bool) -> Callable[[int], None] | None:
        if not (self._armed and sync):
            return ranks_hook
        self._open = True

        def sent(i: int) -> None:
            if ranks_hook is not None:
                ranks_hook(i)  # first: the ranks' average becomes the layer's `landed`, which the speculation waits for
            self._speculate(i)

        return sent

    def _speculate(self, i: int) -> None:
        """Queue layer i's speculative update behind its gradients' last reduction."""
        if self.layered.view_optimizer(i) is None or i in self.device_layers or i not in self.layers:
            return  # another rank's; updated at step time on the device (resident.py); or no room for its copy
        below = self._below(i)
        landed, backward = self.events.landed, self._round

        def job() -> int:
            self.speculated[i] = None
            if self._decided:
                return 0  # step() came first: its own job updates the layer, with no copy to take
            if self.pass_over and below is not None and self.submitted[below] and landed[below].done():
                # Behind backward: the next layer down has landed too. It goes first; this one waits for the last
                # (lowest) layer's job, which takes the layers passed over lowest first while the step has not come.
                # So what the host cannot finish in backward is the higher layers, which the next forward reaches
                # last, not the lowest, which it reaches first (in landing order the verdict would overtake those).
                self._passed.append((backward, i))
                self.passed_over += 1
                return 0
            if not self._run(i) or below is not None:
                return 0
            for _, j in sorted(p for p in self._passed if p[0] == backward):
                if self._decided:
                    break
                self._run(j)
            self._passed = []
            return 0

        self.submitted[i] = True
        self.layered.submit(i, job, self.events.landed[i])

    def _below(self, i: int) -> int | None:
        """The next speculated layer down from i (None: i is the lowest), from a table rebuilt only when the set of
        speculated layers changes (this runs on the compute thread, once per layer per backward)."""
        key, table = self._below_of
        if key != (self.layers, self.device_layers):
            order = sorted(self.layers - self.device_layers)
            table = dict(zip(order[1:], order))
            self._below_of = ((self.layers, self.device_layers), table)
        return table.get(i)

    def _run(self, i: int) -> bool:
        """Layer i's speculative update, after its copy (on the optimizer thread); whether it ran: not where the
        reduction measured no norm or a non-finite one (that layer waits for the verdict, so no update runs on NaNs)."""
        group = self.store.layers[i]
        norm = self.events.slabs.norm(i, group.grad)
        ranges = self._ranges(i)
        if norm is not None:
            if not math.isfinite(float(norm)):
                return False
        elif not self.data_parallel:
            return False
        elif self.config.skip_nonfinite and not all(fused.all_finite(group.grad[a:b], threads=update_threads(True))
                                                     for a, b in ranges or [(0, group.numel)]):
            # With several ranks no reduction measures the slab (the ranks' sum lands after it): read here, and only
            # where a non-finite step is skipped (else the serial step applies it too, and so does this one).
            return False
        version = group.grad._version
        if not self.copies[i].save(group, self.layered.view_optimizer(i), lambda nbytes: self._room_for(i, nbytes)):
            return False
        update_layer(self.layered, group, i, [], update_threads(True))
        self.speculated[i] = version
        return True

    def _ranges(self, i: int) -> list[tuple[int, int]] | None:
        """This rank's ranges of layer i on the node path's update by shard (None: the whole layer is its update's)."""
        return self.layered.ranges[i] if self.layered.ranges is not None else None

    def _room_for(self, i: int, nbytes: int) -> bool:
        """Whether layer i's first rollback copy still fits the host. The count was measured when the engine was
        built, before any batch; what the first batches allocate since (offloaded activations or graphs, a loader's
        buffers) can take that room. A layer whose copy no longer fits stops speculating for good (the step updates
        it, the same bits), said once on the logger: never an allocation past the host's memory."""
        # the copy's old buffers (a first step's, before Adam's state existed) are freed as the new ones replace them
        left = rollback_budget(preflight.available_host_bytes()) + self.copies[i].nbytes
        if nbytes <= left:
            return True
        self.layers = self.layers - {i}
        self.copies[i] = StateCopy(self._ranges(i))  # its old copy freed too: a layer that no longer speculates holds none
        if not self._shrunk:
            self._shrunk = True
            log.warning("speculative step: layer %d's rollback copy (%.2f GiB) no longer fits the %.2f GiB the host "
                        "has left; it and any other that does not fit are updated at step() instead", i,
                        nbytes / 2**30, max(0, left) / 2**30)
        return False

    @property
    def speculative_layers(self) -> int:
        """How many layers speculate (collect_stats()["speculative_layers"])."""
        return len(self.layers - self.device_layers)

    # -- the verdict --------------------------------------------------------------------------------------
    def _restore(self, i: int, verdict: int) -> bool:
        """Layer i restored from its copy if its speculation ran (on the optimizer thread); whether it was."""
        if self.speculated[i] is None:
            return False
        self.copies[i].restore(self.store.layers[i], self.layered.view_optimizer(i))
        self.speculated[i] = None
        with self._lock:
            if self._rolled_at != verdict:
                self._rolled_at = verdict
                self.rollbacks += 1
        return True

    def discard(self) -> None:
        """Undo every queued speculation (queued behind it: the layers' next loads wait for the restore)."""
        self._decided = True
        opened, self._open = self._open, False
        if any(self.submitted):
            self._verdict += 1
            verdict = self._verdict
            for i, sent in enumerate(self.submitted):
                if sent:
                    def job(i: int = i) -> int:
                        self._restore(i, verdict)
                        return 0

                    self.layered.submit(i, job, DONE)
            self.submitted = [False] * len(self.submitted)
        if opened and self._shares:
            # The node's one store: another rank's next load of a layer waits only for its own events, not for this
            # rank's restore of it. Every rank discards the same round at the same call (the round is opened by
            # every rank's backward alike), so each waits for its restores and then for every other rank's.
            self.layered.synchronize()
            self._agree(0, "waiting for the other ranks' rollbacks of a speculative step")

    def step(self, finite: Callable[[], bool], clip: Clipping) -> bool:
        self._per_step, self._backwards = max(1, self._backwards), 0
        self._decided = True
        if not self._open:  # (not whether this rank queued any: the verdict and its back-off are every rank's)
            if self._quiet:
                self._quiet -= 1
                self.quiet_steps += 1
            return super().step(finite, clip)
        if not finite():  # (if it raises, after too many bad steps, a read or forward restores the layers first)
            self.discard()  # the step is skipped: the speculated layers as they were
            self._judge(lost=True)
            return False
        self._open = False
        for g in self.store.groups():
            g.link_grads()
        self.events.wait_global_grads()
        coefs, pending = clip.layer_coefs(), clip.resident_coefs()
        # What every speculated layer took: no clip scale, the hyper-parameters of its backward. The slab each
        # read, and whether it ran at all, its job knows: the check below runs on the optimizer thread behind it.
        same = _hyper(self.optimizer) == self._hyper and self.optimizer.state is self._state
        held = same and not coefs
        self._judge(lost=not held)
        layered, layers, threads = self.layered, self.store.layers, self.threads
        self._verdict += 1
        verdict, submitted = self._verdict, self.submitted
        self.submitted = [False] * len(layers)

        def update(i: int) -> None:
            group = layers[i]
            version = self.speculated[i]
            if submitted[i] and held and version is not None and version == group.grad._version:
                self.speculated[i] = None
                self.kept_layers += 1
                return  # the speculation was the step's update
            if submitted[i]:
                self._restore(i, verdict)
            update_layer(layered, group, i, coefs, threads)

        # The views hold this step's hyper-parameters and state already, unless they changed since backward: then
        # they are taken again, once the jobs that read them are done (a wait on this thread, for that case only).
        self._queue(update, pending, sync=not same)
        if not self.overlapped:
            layered.synchronize()
        return True

    def _judge(self, lost: bool) -> None:
        """Count a step's speculation lost or held, and pause speculating where it keeps losing ("auto")."""
        if not self.back_off:
            return
        if not lost:
            self._lost, self._window = 0, QUIET_STEPS
            return
        self._lost += 1
        if self._lost >= BACK_OFF_AFTER:
            self._quiet, self._window = self._window, min(2 * self._window, MAX_QUIET_STEPS)
            self._lost = BACK_OFF_AFTER - 1  # the retry that loses too pauses again at once
            self.backoffs += 1

    def zero_grad(self) -> None:
        self.discard()  # a zero_grad() before step(): the update taken from those gradients is undone
        self._backwards = 0
        super().zero_grad()

    def settle(self) -> None:
        if not any(self.submitted):
            super().settle()
        # else only speculative jobs are queued (begin_backward waited for the rest), and they read the slabs only

    def synchronize(self) -> None:
        self.discard()  # a read between backward() and step() sees the weights and state before the step
        super().synchronize()

    def before_forward(self) -> None:
        self.discard()  # a forward before step() (accumulation, evaluation) reads the weights before the step

    def weights_loaded(self) -> None:
        self.speculated = [None] * len(self.speculated)  # the load came after synchronize() restored them


def _hyper(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's hyper-parameters (every group's, but its params), comparable with ==."""
    def plain(v: Any) -> Any:
        if torch.is_tensor(v):
            return v.tolist()
        return tuple(plain(x) for x in v) if isinstance(v, (tuple, list)) else v

    return [{k: plain(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def refusal(config: EngineConfig, optimizer: torch.optim.Optimizer, data_parallel: bool) -> str | None:
    """Why the speculative step cannot run with this configuration and optimizer, or None if it can. Several
    data-parallel ranks can, nodes sharing one store included (the module docstring's "Several ranks")."""
    if config.optimizer_in_backward:
        return "optimizer_in_backward updates the layers in backward already"
    if config.nvme_path is not None:
        return "nvme_path: a spilled layer's state is on disk between updates"
    return unsupported_reason(optimizer)


def resolve(config: EngineConfig, device: torch.device, optimizer: torch.optim.Optimizer, store: HostStore,
            data_parallel: bool, device_layers: frozenset[int] = frozenset()) -> frozenset[int]:
    """The layers the speculative step runs on (empty: off). True: every host-updated layer (not `device_layers`,
    updated on the device), refused (ValueError, HostMemoryError) where it cannot run or their rollback copies do
    not fit; "auto" (settled: a CUDA device): where it can run, the first host-updated layers in forward order, as
    many as their copies fit in the host memory left (the module docstring says why those)."""
    setting = config.speculative_step
    if setting is False:
        return frozenset()
    reason = refusal(config, optimizer, data_parallel)
    if reason is not None:
        if setting is True:
            raise ValueError(f"speculative_step=True: {reason}; set speculative_step='auto' or False")
        return frozenset()
    if setting is not True and (getattr(store, "across_nodes", False) or getattr(store, "spans_nodes", False)):
        # Nodes sharing one store: "auto" stays off. The engine shares the store only because one node's host cannot
        # hold a whole one (host_budget_bytes, or the smallest host measured); the rollback copies (the master's
        # and Adam's bytes again, per speculated layer) are the very host memory the share was cut to save, and
        # the free memory "auto" sizes them by does not know the budget the share was cut to. True speculates.
        return frozenset()
    host = [i for i in range(len(store.layers)) if i not in device_layers]
    left = rollback_budget(preflight.available_host_bytes(), state_to_come_bytes(store, optimizer))
    count = preflight.rollback_layers([store.layers[i].numel for i in host], store.master_mode,
                                      config.compute_dtype == "bfloat16", required=setting is True, available=left)
    if host:
        log.info("speculative step: %d of %d host-updated layers%s", count, len(host),
                 "" if count == len(host) else " (as many rollback copies as the host memory left holds)")
    return frozenset(host[:count])


def state_to_come_bytes(store: HostStore, optimizer: torch.optim.Optimizer) -> int:
    """Host bytes the run takes after the engine is built and before the copies are filled, which free host memory
    does not show yet: the gradient slabs' pages (fresh zero-filled mappings, first written by the first backward;
    a pinned slab is touched already) and the Adam state torch creates at the first step (m and v, and
    max_exp_avg_sq with amsgrad, as costs/modes.py counts them, and the step counter) of every host parameter that
    has none yet. The rollback copies are sized against what is left beside them (resolve)."""
    slabs = sum(g.grad.numel() * g.grad.element_size() for g in store.groups()
                if g.grad is not None and g.grad.device.type == "cpu" and not g.grad.is_pinned())
    adam = 0
    for group in optimizer.param_groups:
        per_param = ADAM_BYTES + (ADAM_BYTES // 2 if group.get("amsgrad") else 0)
        adam += sum(per_param * p.numel() + 4 for p in group["params"]
                    if p.device.type == "cpu" and not optimizer.state.get(p))
    return slabs + adam
