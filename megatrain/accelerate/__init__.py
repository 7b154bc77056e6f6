"""The Accelerate face: `megatrain.Accelerator(backend="megatrain" | "zero3" | "zero3-alst" | "torch")`.

    accelerator.py   the Accelerator (prepare, backward, clipping, accumulation, saving, collectives)
    wrappers.py      the prepared optimizer and scheduler, and the accumulation state they obey
    data.py          the prepared dataloader (device placement, end of epoch, sharding over ranks)
    settings.py      the backend a name stands for (arguments and config: megatrain/config/resolve.py)
    tracking.py      the trackers `log_with` names
"""

from __future__ import annotations

from .accelerator import Accelerator
from .backends import BACKENDS
from .data import PreparedDataLoader
from .wrappers import AcceleratedOptimizer, AcceleratedScheduler, GradientState

__all__ = ["Accelerator", "AcceleratedOptimizer", "AcceleratedScheduler", "BACKENDS", "GradientState",
           "PreparedDataLoader"]
