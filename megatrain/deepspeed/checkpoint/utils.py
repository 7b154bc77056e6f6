"""`deepspeed.checkpoint.utils.clone_tensors_for_torch_save`: what accelerate's `get_state_dict` calls on the DeepSpeed
road below stage 3 (found there when every deepspeed import is redirected to MegaTrain)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """`item` with every tensor in it (nested in lists, tuples and dicts) replaced by a copy on `device`: a copy
    that owns its storage, so a save never writes (or drops as shared) the rest of a buffer it was a view of."""
    if torch.is_tensor(item):
        device = torch.device(device)
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
