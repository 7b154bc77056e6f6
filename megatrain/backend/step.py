"""The optimizer step at the end of an accumulation window: one routine for both faces.

The DeepSpeed face calls it from `engine.step()` at a boundary, the Accelerate face from the prepared
optimizer's `step()` at a sync step; either way the backend clips (the config's clipping, unless the script
clipped this window itself), steps (skipping a step whose gradients are not finite) and zeroes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from . import Backend


def is_boundary(micro_step: int, num_steps: int) -> bool:
    """Whether the `micro_step`-th micro-batch (counted from 1) ends an accumulation window of `num_steps`."""
    return micro_step % num_steps == 0


def boundary_step(backend: Backend, *, zero_grad: bool = False) -> bool:
    """Clip -> optimizer step -> (with `zero_grad`) zero the gradients; returns whether the step was applied
    (False: skipped, its gradients were not finite). The Accelerate face leaves zeroing to the script's
    `optimizer.zero_grad()`, as accelerate does; the DeepSpeed face zeroes here, as DeepSpeed does."""
    backend.optimizer_step()
    applied = not backend.step_was_skipped()
    if zero_grad:
        backend.zero_grad()
    return applied
