"""The Accelerate face: `megatrain.Accelerator(backend="megatrain" | "zero3" | "zero3-alst" | "torch")`, a subclass of
`accelerate.Accelerator` with the backend as its model and optimizer engine.

    accelerator.py   the Accelerator: prepare hands models and optimizers to the backend, the rest is accelerate's
    wrappers.py      the prepared optimizer (accelerate's, its step the backend's)
    refusals.py      what of accelerate cannot apply, refused by name
    backends.py      the class behind each backend name (arguments and config: megatrain/config/resolve.py)
"""

from __future__ import annotations

from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import GradientState

from .accelerator import Accelerator
from .backends import BACKENDS
from .refusals import REFUSED_ARGUMENTS, REFUSED_ENVIRONMENT, REFUSED_METHODS
from .wrappers import AcceleratedOptimizer

__all__ = ["Accelerator", "AcceleratedOptimizer", "AcceleratedScheduler", "BACKENDS", "GradientState",
           "REFUSED_ARGUMENTS", "REFUSED_ENVIRONMENT", "REFUSED_METHODS"]
