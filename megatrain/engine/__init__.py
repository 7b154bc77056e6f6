"""The streaming engine: host store, stateless templates, copy streams and the layer pipeline.

Names load on first use, so `import megatrain.engine` stays cheap for code that needs one name and
not the whole engine, torch and transformers with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .check import check_config, check_model
    from .engine import Engine, engines_holding, optimizer_fact
    from .host.pinned import PinnedMemoryError
    from .host.preflight import HostMemoryError
    from .layer.batch import max_trainable_positions
    from .model.model_object import serve_forward_keyword
    from .model.probe import ModelMismatchError, Verdict, run_probe, verify_model
    from .parallel.distributed import launch_env
    from .runtime.device_resolution import resolve_device
    from .runtime.host_copy import to_device
    from .runtime.stream import WatchdogError, side_threads
    from .runtime.threads import host_cores, local_ranks, update_threads

# What the faces, the CLI and the harness may use; everything else is the engine's own (tests/unit/test_layering.py).
_HOME = {"check_config": ".check", "check_model": ".check", "Engine": ".engine", "engines_holding": ".engine", "optimizer_fact": ".engine",
         "HostMemoryError": ".host.preflight", "PinnedMemoryError": ".host.pinned",
         "max_trainable_positions": ".layer.batch", "Verdict": ".model.probe", "run_probe": ".model.probe",
         "ModelMismatchError": ".model.probe", "verify_model": ".model.probe",
         "serve_forward_keyword": ".model.model_object",
         "launch_env": ".parallel.distributed", "resolve_device": ".runtime.device_resolution",
         "to_device": ".runtime.host_copy", "WatchdogError": ".runtime.stream",
         "side_threads": ".runtime.stream", "host_cores": ".runtime.threads",
         "local_ranks": ".runtime.threads", "update_threads": ".runtime.threads",
         "parts": ".parts"}  # a module: the parts the studies and the GPU check measure apart from a step
__all__ = ["Engine", "HostMemoryError", "ModelMismatchError", "PinnedMemoryError", "Verdict", "WatchdogError",
           "check_config", "check_model", "engines_holding", "host_cores", "launch_env", "local_ranks", "max_trainable_positions",
           "optimizer_fact", "parts", "resolve_device", "run_probe", "serve_forward_keyword", "side_threads",
           "to_device", "update_threads", "verify_model"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    module = import_module(_HOME[name], __name__)
    value = module if module.__name__ == f"{__name__}.{name}" else getattr(module, name)
    globals()[name] = value
    return value
