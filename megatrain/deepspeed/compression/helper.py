"""`deepspeed.compression.helper`: the module-path helpers fine-tuning scripts use to reach and replace submodules
(DeepSpeed-Chat's LoRA conversion: `recursive_getattr(model, "model.layers.0.mlp")`, `recursive_setattr(...)`)."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: nn.Module, module_name: str) -> Any:
    """The object at dotted path `module_name` below `model`."""
    obj: Any = model
    for part in module_name.split("."):
        obj = getattr(obj, part)
    return obj


def recursive_setattr(model: nn.Module, module_name: str, module: Any) -> None:
    """Put `module` at dotted path `module_name` below `model`. Replace modules before `initialize()`: the engine
    takes the model's structure when it is built and refuses one changed after."""
    parent, _, leaf = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, leaf, module)
