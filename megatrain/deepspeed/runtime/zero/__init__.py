"""`deepspeed.runtime.zero`: the ZeRO names, MegaTrain's (`megatrain/deepspeed/zero.py`)."""

from ...zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter"]
