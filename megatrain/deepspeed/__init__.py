"""The `deepspeed` namespace on MegaTrain: `import megatrain as deepspeed` and a DeepSpeed script runs unchanged.

    initialize, add_config_arguments    initializer.py   (`deepspeed.initialize`: the same four results)
    DeepSpeedEngine (MegaTrainEngine)   engine.py        (the engine it returns, holding the MegaTrain backend)
    zero, comm, init_distributed        zero.py, comm.py
    utils, checkpointing, ops, accelerator, lr_schedules   (the submodules of the same names)
    config                              the DeepSpeed config parser (JSON/hjson, "auto", batch-size arithmetic)

Names are imported on first use, so `import megatrain` stays cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "initialize": "initializer",
    "add_config_arguments": "initializer",
    "MegaTrainEngine": "engine",
    "DeepSpeedEngine": "engine",
    "init_distributed": "comm",
}
_SUBMODULES = ("zero", "comm", "utils", "checkpointing", "ops", "accelerator", "lr_schedules", "config")

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return import_module(f"{__name__}.{name}")
    if name in _EXPORTS:
        value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
