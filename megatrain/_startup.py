"""Run at interpreter start-up by the `megatrain-guard.pth` file the package installs: a DeepSpeed config with
a "megatrain" section never trains on real DeepSpeed, whether or not the script imports megatrain.

Why a `.pth` file: it is Python's one convention for code that runs in every process of an environment without
the program asking (`site` executes its `import` lines at start-up; coverage's subprocess measurement and
setuptools' editable installs use it the same way). A Trainer script that names a "megatrain" section but never
imports megatrain would otherwise reach `deepspeed.initialize` and train on real DeepSpeed without a word.

It must cost nothing in processes that never use DeepSpeed, so it imports only the standard library (this file
is loaded by path, without importing the megatrain package) and adds one import hook: when `deepspeed` is first
imported, `megatrain.integrations.hf` is installed right after it, which routes a config with the section to
MegaTrain and makes DeepSpeed's own config parser refuse it on any other road. Set MEGATRAIN_DEEPSPEED_GUARD=0 to
leave DeepSpeed untouched in a process (then the section is ignored by DeepSpeed: your choice, said by you).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

_WATCHED = "deepspeed"


class _RouteDeepSpeed(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real `deepspeed` spec so that MegaTrain's routing installs once it ran."""

    def __init__(self) -> None:
        self._looking = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _WATCHED or self._looking:
            return None
        self._looking = True  # find_spec below walks sys.meta_path again, through this finder
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._looking = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            real_exec(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            import megatrain.integrations.hf  # noqa: F401  installs the routing on import

        spec.loader.exec_module = exec_module  # this spec's own loader object: nothing shared is changed
        return spec


def install() -> None:
    """Add the hook (idempotent); route at once if DeepSpeed was imported before this ran."""
    if os.environ.get("MEGATRAIN_DEEPSPEED_GUARD", "1") == "0":
        return
    if _WATCHED in sys.modules:
        import megatrain.integrations.hf  # noqa: F401
        return
    if not any(type(f).__name__ == _RouteDeepSpeed.__name__ for f in sys.meta_path):
        sys.meta_path.insert(0, _RouteDeepSpeed())


install()
