"""Every `deepspeed` import answered by MegaTrain's namespace: what a shim package does for a script whose own
helpers import deepspeed too (`import deepspeed`, `from deepspeed import get_accelerator`,
`from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus`, ...).

The shim is one folder on the script's path, `deepspeed/__init__.py`, holding one line:

    import megatrain.deepspeed.redirect  # noqa: F401

Importing this module makes `sys.modules["deepspeed"]` MegaTrain's namespace (`megatrain.deepspeed`) and puts a
finder first on `sys.meta_path` that answers `deepspeed.X.Y` with the module `megatrain.deepspeed.X.Y` itself (the
same object, so `deepspeed.zero.GatheredParameters is megatrain.deepspeed.zero.GatheredParameters`); a path the
namespace does not have is refused naming it. The start-up hook and `megatrain launch` see that the name is
MegaTrain's and route nothing (`megatrain/integrations/hf_stage.py: deepspeed_is_megatrain`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

import megatrain.deepspeed as _namespace

__all__ = ["install", "target"]

_NAME = "deepspeed"


def target(name: str) -> str:
    """The module of MegaTrain's namespace that answers `name` (`deepspeed` or `deepspeed.X...`)."""
    if name == _NAME:
        return _namespace.__name__
    first, _, rest = name[len(_NAME) + 1:].partition(".")
    base = _namespace._SUBMODULES.get(first, f"{_namespace.__name__}.{first}")
    return f"{base}.{rest}" if rest else base


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `deepspeed.X` with the already-imported module `megatrain.deepspeed.X` (no second copy)."""

    def find_spec(self, name: str, path: Any = None, target_module: Any = None) -> Any:
        if name != _NAME and not name.startswith(_NAME + "."):
            return None
        where = target(name)
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name is not None and not where.startswith(e.name):
                raise  # a dependency of the module is missing, not the module
            raise ModuleNotFoundError(f"{name} is not in MegaTrain's deepspeed namespace (every `deepspeed` import "
                                      f"is redirected to megatrain.deepspeed): docs/INTEGRATIONS.md lists the names "
                                      "it answers", name=name) from None
        spec = importlib.util.spec_from_loader(name, self, is_package=hasattr(module, "__path__"))
        spec.loader_state = (module, module.__spec__)
        return spec

    def create_module(self, spec: Any) -> Any:
        return spec.loader_state[0]

    def exec_module(self, module: Any) -> None:
        # importlib wrote the alias's spec onto the module: its own (under its real name) goes back
        module.__spec__ = module.__spec__.loader_state[1]


def install() -> None:
    """Make the name `deepspeed` MegaTrain's namespace in this process (idempotent)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
    sys.modules[_NAME] = _namespace


install()
