"""The host optimizer step, layer by layer on its own thread, overlapped with the next forward.

`step()` returns once the global parameters (embedding, final norm, head) are updated; each decoder
layer's update (with its bf16 shadow refresh) is a job on an "optimizer" host stream, queued in forward
order, and `zero_grad()` queues each layer's gradient zeroing behind them. The next forward's load of
layer i waits for that layer's update (`updated[i]`) and the next reduction into its gradient slab for
its zeroing (`zeroed[i]`): every layer is updated before it is used and zeroed before it is written, the
same math as one `optimizer.step()`, with the CPU's AdamW hidden behind the device's forward. The global
gradient norm (clipping) and the non-finite check read every gradient before the first update, as they
do without overlap. Only torch's Adam and AdamW are split this way (per-parameter state, no step hooks);
any other optimizer steps whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .store import FlatGroup, HostStore
from .stream import DONE, CopyStream, Event, Trace


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

    def __init__(self, optimizer: torch.optim.Optimizer, store: HostStore, trace: Trace, watchdog_s: float) -> None:
        self.optimizer = optimizer
        self.store = store
        self.stream = CopyStream("optimizer", torch.device("cpu"), trace, None, watchdog_s)
        self.updated: list[Event] = [DONE] * len(store.layers)  # the layer's weights may be loaded
        self.zeroed: list[Event] = [DONE] * len(store.layers)  # the layer's gradient slab may be written
        # One optimizer per layer over that layer's parameters, in the main optimizer's groups. Its params
        # are private Parameters on the same storage, their .grad the slab views for good (user code that
        # sets the main params' .grad to None cannot make a queued update skip them); their Adam state is
        # the main optimizer's own per-parameter dicts, so each view updates exactly its share of it.
        self._views = [self._view(g) for g in store.layers]
        self._globals = self._view(store.globals)

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
            view.optimizer.state[own] = self.optimizer.state[main]  # the same dict: filled in place

    def step(self, after_layer: Callable[[int], None], landed: list[Event],
             before_layer: Callable[[int], None] | None = None) -> None:
        """Update the globals now and queue every layer's update; `before_layer(i)` / `after_layer(i)` run
        before / after layer i's (the non-FP32 modes unpack and pack the layer's master there).

        Layer i's update starts only after `landed[i]`, its gradients' last reduction into the slab: the
        updates run in forward order, the reverse of the order backward lands gradients in.
        """
        self.synchronize()  # the previous step's jobs (cheap: the forward has waited for them already)
        self._sync(self._globals)
        if self._globals is not None:
            self._globals.optimizer.step()
        for i, view in enumerate(self._views):
            self._sync(view)

            def job(view=view, i=i) -> int:
                if before_layer is not None:
                    before_layer(i)
                if view is not None:
                    view.optimizer.step()
                after_layer(i)
                return 0

            self.updated[i] = self.stream.submit(job, (landed[i],), "adam", i)
        # LR schedulers check that optimizer.step() ran before them; it did, a layer at a time.
        self.optimizer._opt_called = True

    # -- optimizer in backward: one layer's update as soon as its gradients are staged -------------------
    def sync_all(self) -> None:
        """Take every view's hyper-parameters and state links now (before a backward that updates layers)."""
        self.synchronize()
        for view in (*self._views, self._globals):
            self._sync(view)

    def step_layer(self, i: int) -> None:
        """Layer i's update, on the caller's thread (an optimizer-stream job)."""
        view = self._views[i]
        if view is not None:
            view.optimizer.step()

    def step_globals(self) -> None:
        if self._globals is not None:
            self._globals.optimizer.step()
        self.optimizer._opt_called = True  # LR schedulers check that optimizer.step() ran before them

    def submit(self, i: int, job: Callable[[], int], after: Event | tuple[Event, ...]) -> Event:
        """Queue a job that updates layer i (after `after`: one event or several); the layer's next load waits for it."""
        self.updated[i] = self.stream.submit(job, after if isinstance(after, tuple) else (after,), "adam", i)
        return self.updated[i]

    def zero_grad(self) -> None:
        """Zero the global gradients now and each layer's after its queued update."""
        self.store.globals.grad.zero_()
        for i, group in enumerate(self.store.layers):
            if group.grad is None:
                continue  # optimizer in backward: no slab

            def job(group=group) -> int:
                group.grad.zero_()
                return 0

            self.zeroed[i] = self.stream.submit(job, (), "zero", i)

    def synchronize(self) -> None:
        self.stream.synchronize()

    @property
    def busy_s(self) -> float:
        return self.stream.busy_s

    def reset_counters(self) -> None:
        self.stream.reset_counters()
