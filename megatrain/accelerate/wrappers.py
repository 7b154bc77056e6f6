"""The prepared optimizer: accelerate's `AcceleratedOptimizer`, its step done by the backend (clip, step, skip)."""

from __future__ import annotations

from typing import Any

import accelerate.optimizer

from ..backend import Backend
from ..backend.step import boundary_step


class AcceleratedOptimizer(accelerate.optimizer.AcceleratedOptimizer):
    """accelerate's prepared optimizer (`step()` and `zero_grad()` act only when gradients sync, shared
    GradientState) whose step is the backend's: the clip the config asks for, the step, a skip when the gradients
    are not finite (`step_was_skipped`, which accelerate's scheduler reads)."""

    def __init__(self, optimizer: Any, backend: Backend) -> None:
        # No device placement: the backend holds the optimizer state where it steps it (host memory for megatrain).
        super().__init__(optimizer, device_placement=False, scaler=None)
        self._backend = backend

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("optimizer.step(closure) is not supported through megatrain.Accelerator")
        if not self.gradient_state.sync_gradients:
            return
        applied = boundary_step(self._backend)  # zeroing is the script's optimizer.zero_grad(), as in accelerate
        self._is_overflow = not applied

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if self.gradient_state.sync_gradients:
            self._backend.zero_grad(set_to_none=True if set_to_none is None else set_to_none)

    def state_dict(self) -> dict[str, Any]:
        self._synchronize()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._synchronize()
        self.optimizer.load_state_dict(state_dict)

    def _synchronize(self) -> None:
        # megatrain with optimizer_overlap may still be updating layers on a host thread
        sync = getattr(self._backend, "synchronize", None)
        if sync is not None:
            sync()
