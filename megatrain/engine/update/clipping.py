"""Gradient clipping by the global L2 norm: the clip a step takes, and where its scaling is applied.

One object per engine (`Engine.clipping`) holds it all:

- the clip each step takes (`every_step`, DeepSpeed's `gradient_clipping`: 0 off): by that norm at every step
  the caller did not clip itself since the last one (`Engine.step` asks `at_step`), and the norm before the
  last clip (`last_norm`, what the faces report);
- where a clip's scaling lands. FP32 slabs on a path that updates whole are scaled at once, in place, as torch's
  clip_grad_norm_ does. A per-layer update path with FP32 slabs (`folds`) leaves the coefficients pending and
  scales every slab (the resident parameters' too) inside its update's pass (fused.py), saving a pass over the
  gradients; a backward before that step applies them first (a clip scales only what came before it). A bf16
  slab is never scaled in bf16 (that rounds): its clip stays pending until the update widens the slab into FP32
  and scales it there (the store's load_grads), while the resident parameters' FP32 slab is scaled at once;
- what a norm read with a clip pending sees: each slab as the update will read it (widened, pending applied).

The norm itself is the engine's (Engine.grad_norm); the coefficient is torch's: min(max_norm / (norm + 1e-6), 1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...costs.modes import GradSlab


def checked_max_norm(max_norm: float) -> float:
    """`max_norm` as a float, refused unless a number >= 0."""
    try:
        value = float(max_norm)
    except (TypeError, ValueError):
        raise ValueError(f"gradient clipping max_norm={max_norm!r} must be a number >= 0 (0 turns clipping off)") \
            from None
    if not value >= 0:
        raise ValueError(f"gradient clipping max_norm={value!r} must be a number >= 0 (0 turns clipping off)")
    return value


class Clipping:
    """An engine's gradient clipping. `grad_mode`: its layers' slabs (store.grad_mode); `folds`: whether its
    update path scales FP32 slabs inside the update (UpdatePath.folds_clip); `slabs()`: this rank's gradient slabs,
    landed; `every_step`: the norm to clip by at a step the caller did not clip (0: none)."""

    def __init__(self, grad_mode: GradSlab | None, folds: bool, slabs: Callable[[], list[torch.Tensor]],
                 every_step: float = 0.0) -> None:
        self.folded = folds and grad_mode is GradSlab.FLOAT32  # FP32 slabs scaled in the update's pass
        self.widened = grad_mode is GradSlab.BFLOAT16  # bf16 slabs scaled in FP32 as the update widens them
        self.slabs = slabs
        self.pending: list[float] = []  # coefficients taken but not yet applied to the slabs they are pending on
        self.every_step = checked_max_norm(every_step)
        self.clipped = False  # clipped since the last step (by the caller): the step takes no clip of its own
        self.last_norm: float | None = None  # the norm before the last clip (None: the last step took none)

    def set_every_step(self, max_norm: float) -> None:
        """Clip by `max_norm` at every step the caller does not clip itself (0: off)."""
        self.every_step = checked_max_norm(max_norm)

    def clip(self, total: float, max_norm: float) -> float:
        """Clip gradients whose global norm is `total` to `max_norm`: the coefficient (1.0: nothing to scale),
        applied now or left pending by the rules above."""
        self.clipped, self.last_norm = True, total
        coef = min(max_norm / (total + 1e-6), 1.0)
        if coef < 1.0:  # multiplying by exactly 1.0 is what torch does otherwise: a no-op
            if not self.folded:
                self._scale_now([coef])  # the FP32 slabs (with bf16 layer slabs: the resident parameters')
            if self.widened or self.folded:
                self.pending.append(coef)
        return coef

    def clipped_by_caller(self, total: float) -> None:
        """The caller clipped a part of the gradients itself (torch's clip_grad_norm_ over them, Engine.
        clip_grad_norm_of): the step takes no clip of its own; `total` the norm before."""
        self.clipped, self.last_norm = True, total

    def at_step(self, clip: Callable[[float], float]) -> float | None:
        """The step's own clip, by `every_step` through `clip` (Engine.clip_grad_norm_) unless the caller clipped
        since the last step; the norm before the step's clip (None: no clip)."""
        if self.every_step > 0 and not self.clipped:
            clip(self.every_step)
        elif not self.clipped:
            self.last_norm = None
        self.clipped = False
        return self.last_norm

    def before_backward(self) -> None:
        """More gradients are about to be added: a clip folded into the update scales only what came before it."""
        if self.folded and self.pending:
            self._scale_now(self.pending)
            self.pending = []

    def layer_coefs(self) -> list[float]:
        """What the layers' update still multiplies their gradients by (a bf16 slab's widening, a folded clip)."""
        return list(self.pending)

    def resident_coefs(self) -> list[float]:
        """What the resident parameters' update multiplies their FP32 slab by (only a folded clip: with bf16 layer
        slabs it was scaled at the clip)."""
        return list(self.pending) if self.folded else []

    def stepped(self) -> None:
        """The update applied a folded clip in place on the FP32 slabs: not again by a second step(). (A bf16 slab
        is left as it was: a second step widens and scales it again.)"""
        if self.folded:
            self.pending = []

    def zero_grad(self) -> None:
        self.pending = []

    def as_read(self, slab: torch.Tensor) -> torch.Tensor:
        """`slab` as the update will read it, for its norm: a bf16 slab widened, a clip still pending on it applied
        to a copy (the same products the update's scaling gives); else the slab itself."""
        if slab.dtype != torch.float32 or (self.pending and self.folded):
            slab = slab.to(torch.float32, copy=True)
            for c in self.pending:
                slab.mul_(c)
        return slab

    def _scale_now(self, coefs: list[float]) -> None:
        """Scale the FP32 slabs by `coefs` now."""
        for g in self.slabs():
            if g.dtype == torch.float32:
                for c in coefs:
                    g.mul_(c)
