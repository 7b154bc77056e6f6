"""`deepspeed.comm`: the process group a script sets up (`init_distributed`), and the rank and world-size
queries and collectives a training script makes. Under a multi-process launch (data parallel, once the process group exists) they are torch.distributed's; in one
process they are answered for rank 0 and the collectives are identities (there is no one to exchange with)."""

from __future__ import annotations

import os
import socket
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
    from ..engine import launch_env

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


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: Any = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """The process group DeepSpeed would set up: the launch's ranks from its environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), else a one-process group, so `torch.distributed.get_rank()` in a script works.
    The backend is `dist_backend`, else NCCL on CUDA and gloo otherwise (the engine averages its host
    gradients on a gloo group of its own either way)."""
    import torch.distributed as dist

    if dist_init_required is False or not dist.is_available() or dist.is_initialized():
        return
    env_world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    world = world_size if world_size > 0 else env_world
    if world > 1:
        from ..engine import launch_env

        if world != env_world:
            raise ValueError(f"world_size={world} but WORLD_SIZE={env_world}: launch every rank with torchrun, "
                             "accelerate launch or the deepspeed launcher")
        env = launch_env()
        backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        kwargs = {"timeout": timeout} if timeout is not None else {}
        dist.init_process_group(backend=backend, init_method=init_method or "env://", rank=env.rank,
                                world_size=world, **kwargs)
        return
    if init_method is None:
        if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            init_method = "env://"
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    kwargs = {"timeout": timeout} if timeout is not None else {}
    # The group only answers rank/world-size queries: gloo needs no accelerator whatever the device.
    dist.init_process_group(backend="gloo", init_method=init_method, rank=0, world_size=1, **kwargs)
