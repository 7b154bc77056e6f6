"""The host-memory modes, under the name users and EngineConfig import them by (defined in costs/modes.py)."""

from .costs.modes import (
    ADAM_BYTES,
    GRAD_BYTES,
    MASTER_BYTES,
    SHADOW_BYTES,
    GradSlab,
    HostMaster,
    layer_bytes_per_param,
    parse,
)

__all__ = ["ADAM_BYTES", "GRAD_BYTES", "MASTER_BYTES", "SHADOW_BYTES", "GradSlab", "HostMaster",
           "layer_bytes_per_param", "parse"]
