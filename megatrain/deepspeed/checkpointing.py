"""`deepspeed.checkpointing` (activation checkpointing) backed by torch.utils.checkpoint.

MegaTrain recomputes every decoder layer in backward already; these calls serve code of the user's own
that checkpoints a function by hand. Partitioning and CPU placement of checkpoints are DeepSpeed
model-parallel features with no meaning in one process: asked for, they are refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["configure", "is_configured", "checkpoint", "model_parallel_cuda_manual_seed", "reset"]

_configured = False


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    global _configured
    for name, value in (("partition_activations", partition_activations),
                        ("contiguous_checkpointing", contiguous_checkpointing),
                        ("checkpoint_in_cpu", checkpoint_in_cpu)):
        if value:
            raise ValueError(f"checkpointing.configure({name}=True) is a DeepSpeed model-parallel feature MegaTrain "
                             "does not have; leave it off (MegaTrain keeps only layer-boundary activations anyway)")
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    return None  # no checkpoint buffers are kept between steps


def checkpoint(function: Any, *args: Any) -> Any:
    """Run `function(*args)` keeping no intermediate activations; recompute them in backward."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def model_parallel_cuda_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)
