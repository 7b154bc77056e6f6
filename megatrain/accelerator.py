"""`megatrain.accelerator`: the Accelerate face's old home (`from megatrain.accelerator import Accelerator`), and
`deepspeed.accelerator.get_accelerator()` under `import megatrain as deepspeed`. Both live in their packages now:
`megatrain/accelerate/` and `megatrain/deepspeed/accelerator.py`."""

from __future__ import annotations

from .accelerate import (
    BACKENDS,
    AcceleratedOptimizer,
    AcceleratedScheduler,
    Accelerator,
    GradientState,
    PreparedDataLoader,
)
from .deepspeed.accelerator import get_accelerator

__all__ = ["Accelerator", "AcceleratedOptimizer", "AcceleratedScheduler", "BACKENDS", "GradientState",
           "PreparedDataLoader", "get_accelerator"]
