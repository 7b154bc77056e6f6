"""The streaming engine: host store, stateless templates, copy streams and the layer pipeline."""

from .engine import Engine
from .preflight import HostMemoryError
from .stream import WatchdogError

__all__ = ["Engine", "HostMemoryError", "WatchdogError"]
