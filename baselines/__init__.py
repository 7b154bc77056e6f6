"""Comparison backends for `megatrain.Accelerator`: plain PyTorch and DeepSpeed ZeRO-3 CPU offload.

They share nothing with the MegaTrain engine: each drives its own stack the way a user of that
stack would, so a comparison measures the stacks and not a common helper.
"""

from baselines.torch_backend import TorchBackend

__all__ = ["TorchBackend", "Zero3Backend"]


def __getattr__(name: str):  # deepspeed is optional: import its backend only when asked for
    if name == "Zero3Backend":
        from baselines.zero3 import Zero3Backend

        return Zero3Backend
    raise AttributeError(f"module 'baselines' has no attribute {name!r}")
