"""The user's views of the optimizer and LR scheduler, and the accumulation state both obey (Accelerate's rules)."""

from __future__ import annotations

from typing import Any

import torch

from ..backend import Backend
from ..backend.step import boundary_step, is_boundary


def forward_attr(wrapper: Any, inner: str, name: str) -> Any:
    # Only reached for names the wrapper lacks; the guard keeps copy/pickle (no __dict__ yet) from recursing.
    target = wrapper.__dict__.get(inner)
    if target is None:
        raise AttributeError(name)
    return getattr(target, name)


class GradientState:
    """When gradients are synchronised, i.e. when the optimizer really steps (Accelerate's rule)."""

    def __init__(self, num_steps: int, adjust_scheduler: bool = True, sync_with_dataloader: bool = True) -> None:
        self.num_steps = num_steps
        self.adjust_scheduler = adjust_scheduler
        self.sync_with_dataloader = sync_with_dataloader
        self.step = 0
        self.sync_gradients = True
        self.end_of_dataloader = False
        self.optimizer_stepped = False

    def advance(self) -> None:
        # The last batch of an epoch syncs (unless the plugin says otherwise), so a short epoch loses no gradients.
        if self.end_of_dataloader and self.sync_with_dataloader:
            self.step = 0
            self.sync_gradients = True
        else:
            self.step += 1
            self.sync_gradients = is_boundary(self.step, self.num_steps)


class AcceleratedOptimizer:
    """The user's view of the optimizer: `step()` and `zero_grad()` act only at sync steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, backend: Backend, state: GradientState) -> None:
        self.optimizer = optimizer
        self._backend = backend
        self._state = state
        self._skipped = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("optimizer.step(closure) is not supported through the Accelerator")
        self._state.optimizer_stepped = False
        if not self._state.sync_gradients:
            return
        applied = boundary_step(self._backend)  # zeroing is the script's optimizer.zero_grad(), as in accelerate
        self._skipped = not applied
        self._state.optimizer_stepped = applied

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if self._state.sync_gradients:
            self._backend.zero_grad(set_to_none=True if set_to_none is None else set_to_none)

    @property
    def step_was_skipped(self) -> bool:
        return self._skipped

    def state_dict(self) -> dict[str, Any]:
        self._synchronize()
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._synchronize()
        self.optimizer.load_state_dict(state)

    def _synchronize(self) -> None:
        # megatrain with optimizer_overlap may still be updating layers on a host thread
        sync = getattr(self._backend, "synchronize", None)
        if sync is not None:
            sync()

    def __getattr__(self, name: str) -> Any:
        return forward_attr(self, "optimizer", name)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


class AcceleratedScheduler:
    """The user's LR scheduler, stepped only when the optimizer really stepped (Accelerate's rule)."""

    def __init__(self, scheduler: Any, optimizers: list[AcceleratedOptimizer], state: GradientState) -> None:
        self.scheduler = scheduler
        self._optimizers = optimizers
        self._state = state

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.sync_gradients:
            # Accelerate keeps torch's "scheduler stepped before optimizer" bookkeeping consistent.
            if self._state.adjust_scheduler and hasattr(self.scheduler, "_step_count"):
                self.scheduler._step_count += 1
            return
        if any(o.step_was_skipped for o in self._optimizers):
            return
        opt = getattr(self.scheduler, "optimizer", None)
        if opt is not None:
            # The backend stepped on the optimizer's behalf, so torch's check that the optimizer was
            # stepped first would warn spuriously.
            opt._opt_called = True
        self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return forward_attr(self, "scheduler", name)
