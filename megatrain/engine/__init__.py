"""The streaming engine: host store, stateless templates, copy streams and the layer pipeline.

Names load on first use, so `import megatrain.engine` stays cheap for code that needs one name and
not the whole engine, torch and transformers with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import Engine
    from .pinned import PinnedMemoryError
    from .preflight import HostMemoryError
    from .stream import WatchdogError

__all__ = ["Engine", "HostMemoryError", "PinnedMemoryError", "WatchdogError"]
_HOME = {"Engine": ".engine", "HostMemoryError": ".preflight", "PinnedMemoryError": ".pinned",
         "WatchdogError": ".stream"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(_HOME[name], __name__), name)
    globals()[name] = value
    return value
