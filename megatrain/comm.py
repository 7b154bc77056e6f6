"""`deepspeed.comm` for one process: the rank and world-size queries a training script makes, answered for
the single process MegaTrain runs in; the collectives are identities (there is no one to exchange with)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["get_rank", "get_world_size", "get_local_rank", "is_initialized", "is_available", "barrier",
           "all_reduce", "broadcast", "all_gather", "init_distributed", "ReduceOp"]

ReduceOp = torch.distributed.ReduceOp if torch.distributed.is_available() else None


def get_rank(group: Any = None) -> int:
    return 0


def get_world_size(group: Any = None) -> int:
    return 1


def get_local_rank() -> int:
    return 0


def is_initialized() -> bool:
    return True


def is_available() -> bool:
    return True


def barrier(group: Any = None, **kwargs: Any) -> None:
    return None


def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> None:
    return None  # one process: the sum, mean, min and max of one tensor is that tensor


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None, async_op: bool = False) -> None:
    if src != 0:
        raise ValueError(f"broadcast from rank {src}: MegaTrain runs one process (rank 0)")
    return None


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False) -> None:
    if len(tensor_list) != 1:
        raise ValueError(f"all_gather into {len(tensor_list)} tensors: MegaTrain runs one process; pass a list of one")
    tensor_list[0].copy_(tensor)


def init_distributed(*args: Any, **kwargs: Any) -> None:
    from .initialize import init_distributed as init

    init(*args, **kwargs)
