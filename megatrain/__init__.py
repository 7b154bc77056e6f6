"""MegaTrain: train LLMs larger than the GPU — weights and optimizer state in host memory, layers streamed.

Two faces over one engine and one backend:
    engine, optimizer, _, scheduler = megatrain.initialize(model=model, config=ds_config)   # DeepSpeed-style
    accelerator = megatrain.Accelerator(backend="megatrain" | "zero3" | "torch")              # Accelerate-style
`import megatrain as deepspeed` also answers `deepspeed.comm`, `.zero`, `.utils`, `.checkpointing`, `.ops`,
`.accelerator` (megatrain/deepspeed/); the Accelerate face lives in megatrain/accelerate/.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# Public names -> the module that defines them, imported on first use so `import megatrain` stays cheap.
_EXPORTS = {
    "initialize": "megatrain.deepspeed",
    "init_distributed": "megatrain.deepspeed",
    "add_config_arguments": "megatrain.deepspeed",
    "DeepSpeedEngine": "megatrain.deepspeed",
    "Accelerator": "megatrain.accelerate",
    "Engine": "megatrain.engine",
    "EngineConfig": "megatrain.config",
    "HostMemoryError": "megatrain.engine",
    "GracefulStop": "megatrain.run.graceful",
    "WatchdogError": "megatrain.engine",
    "get_preset": "megatrain.models.presets",
    "PRESETS": "megatrain.models.presets",
}

# The `deepspeed` namespace's submodules, for `import megatrain as deepspeed; deepspeed.comm.get_rank()`.
_DEEPSPEED_SUBMODULES = ("zero", "comm", "utils", "checkpointing", "ops", "accelerator", "lr_schedules", "runtime",
                         "compression", "get_accelerator")

__all__ = sorted([*_EXPORTS, "zero"])


def __getattr__(name: str) -> Any:
    if name in _DEEPSPEED_SUBMODULES:
        return getattr(import_module("megatrain.deepspeed"), name)
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        # Cache it: importing the submodule `megatrain.initialize` would otherwise shadow the function.
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megatrain' has no attribute {name!r}")
