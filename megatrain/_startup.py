"""Run at interpreter start-up by the `megatrain-guard.pth` file the package installs: a DeepSpeed config with
a "megatrain" section never trains on real DeepSpeed, whether or not the script imports megatrain.

Why a `.pth` file: it is Python's one convention for code that runs in every process of an environment without
the program asking (`site` executes its `import` lines at start-up; coverage's subprocess measurement and
setuptools' editable installs use it the same way). A Trainer script that names a "megatrain" section but never
imports megatrain would otherwise reach `deepspeed.initialize` and train on real DeepSpeed without a word.

It must cost nothing in processes that never use DeepSpeed, so it imports only the standard library (this file
is loaded by path, without importing the megatrain package) and adds one import hook for two modules:
- when `accelerate.utils.deepspeed` is first imported (transformers imports it with its DeepSpeed glue),
  `megatrain.integrations.hf_stage` is installed right after it: a config with the section is not ZeRO-3 to
  transformers and accelerate. This must precede `import deepspeed`, which transformers does only after it asked
  `is_deepspeed_zero3_enabled()` (`from_pretrained` would enter `zero.Init` and log "Detected DeepSpeed ZeRO-3").
- when `deepspeed` is first imported, `megatrain.integrations.hf` is installed right after it, which routes a
  config with the section to MegaTrain and makes DeepSpeed's own config parser refuse it on any other road.
- where the name `deepspeed` is MegaTrain's own namespace (a shim package redirecting every deepspeed import,
  `megatrain/deepspeed/redirect.py`), the routing finds no real DeepSpeed and installs only its accelerate half.
Set MEGATRAIN_DEEPSPEED_GUARD=0 to leave DeepSpeed untouched in a process (the section is then ignored by DeepSpeed:
your choice); each `deepspeed.initialize` then prints a start line saying DeepSpeed trains and why
(`megatrain.integrations.on_deepspeed`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from typing import Any

# module -> what to import right after it has run (each installs itself on import)
_HOOKS = {
    "accelerate.utils.deepspeed": "megatrain.integrations.hf_stage",
    "deepspeed": "megatrain.integrations.hf",
}


# with MEGATRAIN_DEEPSPEED_GUARD=0: DeepSpeed is left alone, and says so at initialize
_LEFT_ALONE = {"deepspeed": "megatrain.integrations.on_deepspeed"}


class _RouteDeepSpeed(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real spec of a watched module so that MegaTrain's routing installs once it ran."""

    HOOKS = _HOOKS

    def __init__(self) -> None:
        self._looking = False
        self.hooks = dict(self.HOOKS)  # the ones not fired yet

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.hooks or self._looking:
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
            then = self.hooks.pop(name, None)
            if not self.hooks and self in sys.meta_path:
                sys.meta_path.remove(self)
            if then is not None:
                importlib.import_module(then)

        spec.loader.exec_module = exec_module  # this spec's own loader object: nothing shared is changed
        return spec


class _AnnounceDeepSpeed(_RouteDeepSpeed):
    """The opt-out's hook: routes nothing, only makes `deepspeed.initialize` say that DeepSpeed trains."""

    HOOKS = _LEFT_ALONE


def _env() -> Any:
    """megatrain/files/env.py, the one reader of the environment, loaded by path (the package is not imported here)."""
    module = sys.modules.get("megatrain.files.env")
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location("megatrain._startup_env",
                                                  os.path.join(os.path.dirname(__file__), "files", "env.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def install() -> None:
    """Add the hook (idempotent); route at once for a watched module imported before this ran."""
    kind = _AnnounceDeepSpeed if _env().deepspeed_left_alone() else _RouteDeepSpeed
    if any(type(f).__name__ in (_RouteDeepSpeed.__name__, _AnnounceDeepSpeed.__name__) for f in sys.meta_path):
        return
    finder = kind()
    for name in list(finder.hooks):
        if name in sys.modules:
            importlib.import_module(finder.hooks.pop(name))
    if finder.hooks:
        sys.meta_path.insert(0, finder)


install()
