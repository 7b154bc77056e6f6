"""What the Accelerator's arguments and its DeepSpeed-style config say together, and the backend they name.

The config is read by megatrain/settings.py (`read_config`), as every face reads it; the functions here
settle where it and the Accelerator's arguments disagree. Each takes the config or its ConfigSettings.
"""

from __future__ import annotations

from typing import Any

from ..backend import MegatrainBackend
from ..settings import read_config
from ..validate import is_int

BACKENDS = ("megatrain", "zero3", "zero3-alst", "torch")
_MIXED_PRECISION = ("no", "bf16")


def resolve_mixed_precision(mixed_precision: str, config: Any) -> str:
    if mixed_precision not in _MIXED_PRECISION:
        raise ValueError(f"mixed_precision={mixed_precision!r} is not supported; use one of {_MIXED_PRECISION}")
    from_config = read_config(config).bf16
    if from_config is None:
        return mixed_precision
    if from_config and mixed_precision == "no":
        return "bf16"  # the config asked for it and the argument was left at its default
    if not from_config and mixed_precision == "bf16":
        raise ValueError("mixed_precision='bf16' contradicts the config, which disables bf16")
    return mixed_precision


def resolve_gradient_clipping(config: Any) -> float:
    """The per-step clipping a config asks for, with DeepSpeed's meaning (absent -> 1.0)."""
    return read_config(config).gradient_clipping


def resolve_accumulation(steps: int, config: Any) -> int:
    if not is_int(steps) or steps < 1:
        raise ValueError(f"gradient_accumulation_steps={steps!r} must be an int >= 1")
    from_config = read_config(config).gradient_accumulation_steps
    if from_config is not None:
        if steps == 1:
            return from_config  # the argument was left at its default
        if from_config != steps:
            raise ValueError(f"gradient_accumulation_steps={steps} contradicts the config's {from_config}; set one of them")
    return steps


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

