"""`deepspeed.runtime.zero.partition_parameters`: where scripts import `ZeroParamStatus` and `GatheredParameters`
from (the same objects as `deepspeed.zero`'s)."""

from ...zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter"]
