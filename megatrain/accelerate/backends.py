"""The backends an Accelerator can name, and the class behind each name.

What the Accelerator's arguments and its config say together is settled by megatrain/config/resolve.py, as for
every face.
"""

from __future__ import annotations

from ..backend import MegatrainBackend

BACKENDS = ("megatrain", "zero3", "zero3-alst", "torch")


def backend_class(name: str) -> type:
    """The class behind `Accelerator(backend=name)` (the comparison stacks are imported only when named)."""
    if name == "megatrain":
        return MegatrainBackend
    if name == "torch":
        from baselines.torch_backend import TorchBackend

        return TorchBackend
    if name == "zero3":
        from baselines.zero3 import Zero3Backend

        return Zero3Backend
    if name == "zero3-alst":
        from baselines.alst import Zero3AlstBackend

        return Zero3AlstBackend
    raise ValueError(f"backend={name!r} is not one of {BACKENDS}")

