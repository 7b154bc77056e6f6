"""`megatrain.initialize`: the DeepSpeed face's old home, kept for `from megatrain.initialize import ...`.

The face lives in `megatrain/deepspeed/`. This module stays callable, because importing it binds the
package attribute `megatrain.initialize` to the module, shadowing the function of the same name.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from .deepspeed import comm, zero
from .deepspeed.comm import init_distributed
from .deepspeed.engine import DeepSpeedEngine, MegaTrainEngine
from .deepspeed.initializer import add_config_arguments, initialize

__all__ = ["initialize", "MegaTrainEngine", "DeepSpeedEngine", "init_distributed", "add_config_arguments", "zero",
           "comm"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return initialize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
