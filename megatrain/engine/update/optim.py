"""The host optimizer step, layer by layer on its own thread, overlapped with the next forward.

`step()` returns once the global parameters (embedding, final norm, head) are updated; each decoder
layer's update (with its bf16 shadow refresh) is a job on an "optimizer" host stream, queued in forward
order, and `zero_grad()` queues each layer's gradient zeroing behind them. The next forward's load of
layer i waits for that layer's update (`events.updated[i]`) and the next reduction into its gradient slab
for its zeroing (`events.zeroed[i]`, events.py): every layer is updated before it is used and zeroed before it is written, the
same math as one `optimizer.step()`, with the CPU's AdamW hidden behind the device's forward. The global
gradient norm (clipping) and the non-finite check read every gradient before the first update, as they
do without overlap. Only torch's Adam and AdamW are split this way (per-parameter state, no step hooks);
any other optimizer steps whole.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..host.events import LayerEvents
from ..host.node_store import state_of
from ..host.store import FlatGroup, HostStore
from ..runtime.stream import CopyStream, Event, Trace
from . import by_shard

OptimizerArg = torch.optim.Optimizer | Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer] | None


# What a face is told when the optimizer it hands over holds a tensor the model does not.
NOT_A_PARAMETER = ("the optimizer holds a tensor that is not a parameter of the model; build it over "
                   "model.parameters()")


def adopt_optimizer(optimizer: OptimizerArg, named: list[tuple[str, nn.Parameter]], name_of: dict[int, str],
                    aliases: dict[str, str]) -> torch.optim.Optimizer:
    """The optimizer over the host masters `named`: a fused AdamW by default, a factory's, or the user's own
    (built over the model's original parameters, named by `name_of`) moved onto the masters."""
    if optimizer is None:
        # The masters are host tensors whatever the compute device: torch's fused CPU kernel is ~10x
        # its per-tensor loop, which it would pick for CPU tensors when left to choose.
        return torch.optim.AdamW([p for _, p in named], fused=True)
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer(named)
    # Take over the user's optimizer: same object, same hyper-parameters, now over the host masters,
    # so LR schedulers built on it keep working.
    by_name = dict(named)
    by_name.update({a: by_name[n] for a, n in aliases.items() if n in by_name})
    move_onto_masters(optimizer, lambda p: name_of.get(id(p)), by_name)
    for group in optimizer.param_groups:
        if (isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and group.get("fused") is None
                and group.get("foreach") is None and not group.get("differentiable")):
            group["fused"] = True  # same math; the user chose no kernel, and the default one is ~10x slower here
    return optimizer


def move_onto_masters(optimizer: torch.optim.Optimizer, name: Callable[[torch.Tensor], str | None],
                      masters: dict[str, nn.Parameter]) -> None:
    """Point every param group of `optimizer` at the host masters, each tensor it holds by its parameter's name
    (`name`: None for a tensor that is no parameter of the model, refused); its state goes with the old tensors.
    The one routine for an optimizer given with the model and one handed over later (Engine.replace_optimizer)."""
    for group in optimizer.param_groups:
        names = [name(p) for p in group["params"]]
        if None in names:
            raise ValueError(NOT_A_PARAMETER)
        group["params"] = [masters[n] for n in names]
    optimizer.state = defaultdict(dict)


def unsupported_reason(opt: torch.optim.Optimizer) -> str | None:
    """Why `opt` cannot be stepped a layer at a time with the same result, or None if it can."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"{type(opt).__name__} is not torch's Adam or AdamW"
    if any(g.get("differentiable") or g.get("capturable") for g in opt.param_groups):
        return "differentiable/capturable Adam"
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return "the optimizer has step hooks, which expect one step() per step"
    return None


@dataclass
class _View:
    optimizer: torch.optim.Optimizer  # over `own` params, groups mirroring the main optimizer's `index`
    index: list[int]
    pairs: list[tuple[nn.Parameter, nn.Parameter]]  # (own param, the main optimizer's param)


class LayeredStep:
    """Per-layer views of one torch optimizer, stepped on a host thread."""

    def __init__(self, optimizer: torch.optim.Optimizer, store: HostStore, events: LayerEvents, trace: Trace,
                 watchdog_s: float) -> None:
        self.optimizer = optimizer
        self.store = store
        self.events = events  # each queued update is the layer's `updated`, each zeroing its `zeroed`
        self.stream = CopyStream("optimizer", torch.device("cpu"), trace, None, watchdog_s)
        # One optimizer per layer over that layer's parameters, in the main optimizer's groups. Its params
        # are private Parameters on the same storage, their .grad the slab views for good (user code that
        # sets the main params' .grad to None cannot make a queued update skip them); their Adam state is
        # the main optimizer's own per-parameter dicts, so each view updates exactly its share of it.
        self._views = [self._view(g) for g in store.layers]
        self._globals = self._view(store.globals)
        # The node path's update by shard (by_shard.py): this rank's ranges of each layer (None: whole layers), its
        # share of the node's one Adam state made now, and the layer elements this rank's updates wrote.
        split = by_shard.split_for(store)
        self.ranges = [split.ranges(g.numel) for g in store.layers] if split is not None else None
        if split is not None:
            by_shard.make_state(optimizer, store, split)
        self.updated_elements = 0

    def _view(self, group: FlatGroup) -> _View | None:
        if group.grad_work is None:
            return None  # a layer another rank owns (shared host store): its update is that rank's
        slot_of = {id(p): s for p, s in zip(group.params, group.slots)}
        groups, index, pairs = [], [], []
        for j, g in enumerate(self.optimizer.param_groups):
            mine = []
            for p in g["params"]:
                if id(p) in slot_of:
                    own = nn.Parameter(p.detach())
                    own.grad = group.view(group.grad_work, slot_of[id(p)])
                    mine.append(own)
                    pairs.append((own, p))
            if mine:
                groups.append({**g, "params": mine})
                index.append(j)
        if not groups:
            return None
        return _View(type(self.optimizer)(groups), index, pairs)

    def _sync(self, view: _View | None) -> None:
        """Hyper-parameters and state links taken now, on the caller's thread: an LR schedule stepped right
        after step() returns is for the next step, as in torch; load_state_dict may have replaced state."""
        if view is None:
            return
        for g, j in zip(view.optimizer.param_groups, view.index):
            src = self.optimizer.param_groups[j]
            g.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in src.items() if k != "params"})
        for own, main in view.pairs:
            view.optimizer.state[own] = state_of(self.optimizer, main)  # the same dict: filled in place

    def step(self, update_layer: Callable[[int], None], landed: list[Event],
             update_globals: Callable[[torch.optim.Optimizer], None] | None = None) -> None:
        """Update the globals now (`update_globals(their optimizer view)`, default its step()) and queue
        `update_layer(i)` for every layer, each after `landed[i]`, its gradients' last reduction into the slab:
        in forward order, the reverse of the order backward lands them."""
        self.synchronize()  # the previous step's jobs (cheap: the forward has waited for them already)
        self._sync(self._globals)
        if self._globals is not None:
            if update_globals is None:
                self._globals.optimizer.step()
            else:
                update_globals(self._globals.optimizer)
        for i, view in enumerate(self._views):
            self._sync(view)

            def job(i=i) -> int:
                update_layer(i)
                return 0

            self.events.updated[i] = self.stream.submit(job, (landed[i],), "adam", i)
        # LR schedulers check that optimizer.step() ran before them; it did, a layer at a time.
        self.optimizer._opt_called = True

    # -- optimizer in backward: each layer's update queued as soon as its gradients are staged -------------
    def sync_all(self) -> None:
        """Take every view's hyper-parameters and state links now (before a backward that updates layers)."""
        self.synchronize()
        for view in (*self._views, self._globals):
            self._sync(view)

    def create_layer_states(self) -> None:
        """Adam's state of every layer this rank updates, made now and at once, as torch's first step makes it
        (zero moments, step 0). Made inside backward instead, a layer at a time, each layer's m and v land among
        backward's freed transients, and the holes they leave stay resident (glibc keeps them): measured ~0.5
        B/param at depth (experiments/studies/bytes_at_depth_phases.py). Call after sync_all()."""
        for view in self._views:
            if view is None:
                continue
            for g in view.optimizer.param_groups:
                for p in g["params"]:
                    st = view.optimizer.state[p]
                    if st:
                        continue
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if g.get("amsgrad"):
                        st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def view_optimizer(self, i: int) -> torch.optim.Optimizer | None:
        """Layer i's view of the optimizer (None: a layer another rank updates)."""
        view = self._views[i]
        return view.optimizer if view is not None else None

    def view_globals(self) -> torch.optim.Optimizer | None:
        """The resident parameters' view of the optimizer (None: none on this rank), synced by sync_all(): for
        a caller that updates them itself (update.py's Layered, embedding first)."""
        return self._globals.optimizer if self._globals is not None else None

    def step_globals(self) -> None:
        if self._globals is not None:
            self._globals.optimizer.step()
        self.optimizer._opt_called = True  # LR schedulers check that optimizer.step() ran before them

    def submit(self, i: int, job: Callable[[], int], after: Event | tuple[Event, ...]) -> Event:
        """Queue a job that updates layer i (after `after`: one event or several); the layer's next load waits for it."""
        self.events.updated[i] = self.stream.submit(job, after if isinstance(after, tuple) else (after,), "adam", i)
        return self.events.updated[i]

    def zero_grad(self) -> None:
        """Zero the global gradients now and each layer's after its queued update."""
        self.store.globals.grad.zero_()
        slabs = self.events.slabs
        for i, group in enumerate(self.store.layers):
            if group.grad is None:
                continue  # optimizer in backward: no slab

            def job(i=i, group=group) -> int:
                if self.ranges is not None:  # updated by shard: only this rank's ranges were written (the rest is 0)
                    for a, b in self.ranges[i]:
                        slabs.zero(i, group.grad[a:b])
                    return 0
                slabs.zero(i, group.grad)  # a flag where the next reduction overwrites (slab_state.py)
                return 0

            self.events.zeroed[i] = self.stream.submit(job, (), "zero", i)

    def synchronize(self) -> None:
        self.stream.synchronize()

    @property
    def busy_s(self) -> float:
        return self.stream.busy_s

    def reset_counters(self) -> None:
        self.stream.reset_counters()
        self.updated_elements = 0
