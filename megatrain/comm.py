"""`deepspeed.comm`: the rank and world-size queries and collectives a training script makes. Under a
multi-process launch (data parallel, once the process group exists) they are torch.distributed's; in one
process they are answered for rank 0 and the collectives are identities (there is no one to exchange with)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["get_rank", "get_world_size", "get_local_rank", "is_initialized", "is_available", "barrier",
           "all_reduce", "broadcast", "all_gather", "init_distributed", "ReduceOp"]

ReduceOp = torch.distributed.ReduceOp if torch.distributed.is_available() else None


def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def get_rank(group: Any = None) -> int:
    return torch.distributed.get_rank(group) if _dist() else 0


def get_world_size(group: Any = None) -> int:
    return torch.distributed.get_world_size(group) if _dist() else 1


def get_local_rank() -> int:
    from .engine.distributed import launch_env

    return launch_env().local_rank if _dist() else 0


def is_initialized() -> bool:
    return True


def is_available() -> bool:
    return True


def barrier(group: Any = None, **kwargs: Any) -> None:
    if _dist():
        torch.distributed.barrier(group)


def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
    if _dist():
        return torch.distributed.all_reduce(tensor, op if op is not None else ReduceOp.SUM, group, async_op)
    return None  # one process: the sum, mean, min and max of one tensor is that tensor


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None, async_op: bool = False) -> Any:
    if _dist():
        return torch.distributed.broadcast(tensor, src, group, async_op)
    if src != 0:
        raise ValueError(f"broadcast from rank {src}: MegaTrain runs one process (rank 0)")
    return None


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Any:
    if _dist():
        return torch.distributed.all_gather(tensor_list, tensor, group, async_op)
    if len(tensor_list) != 1:
        raise ValueError(f"all_gather into {len(tensor_list)} tensors: MegaTrain runs one process; pass a list of one")
    tensor_list[0].copy_(tensor)


def init_distributed(*args: Any, **kwargs: Any) -> None:
    from .initialize import init_distributed as init

    init(*args, **kwargs)
