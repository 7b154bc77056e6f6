"""The `deepspeed` namespace on MegaTrain: `import megatrain as deepspeed` and a DeepSpeed script runs unchanged.

    initialize, add_config_arguments    initializer.py   (`deepspeed.initialize`: the same four results)
    DeepSpeedEngine (MegaTrainEngine)   deepspeed_engine.py        (the engine it returns, holding the MegaTrain backend)
    zero, comm, init_distributed        zero.py, comm.py
    get_accelerator                     accelerator.py (`from deepspeed import get_accelerator`)
    utils, checkpointing, ops, accelerator, runtime, compression, checkpoint   (the submodules of the same names)
    lr_schedules                        DeepSpeed's LR schedules (megatrain/lr_schedules.py, torch-only)
    config                              the DeepSpeed config parser (megatrain/config/deepspeed.py)

Names are imported on first use, so `import megatrain` stays cheap. `import megatrain.deepspeed.redirect` (a shim
package's one line) makes every `deepspeed` import answer from here.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "initialize": "initializer",
    "add_config_arguments": "initializer",
    "MegaTrainEngine": "deepspeed_engine",
    "DeepSpeedEngine": "deepspeed_engine",
    "init_distributed": "comm",
    "get_accelerator": "accelerator",
}
# The namespace's submodules; two live below the face (the parser with the configuration, the schedules beside it).
_SUBMODULES = {**{m: f"{__name__}.{m}" for m in ("zero", "comm", "utils", "checkpointing", "ops", "accelerator",
                                                 "runtime", "compression", "checkpoint")},
               "lr_schedules": "megatrain.lr_schedules", "config": "megatrain.config.deepspeed"}

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return import_module(_SUBMODULES[name])
    if name in _EXPORTS:
        value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
