"""A model built by real DeepSpeed's ZeRO-3 partitioner, made whole once for MegaTrain.

`HfDeepSpeedConfig(ds_config)` with stage 3, active at `from_pretrained`, makes transformers build the model under
`deepspeed.zero.Init` (each parameter an empty placeholder, its data in DeepSpeed's partitions) when the config's
`initialize` is MegaTrain's but the name `deepspeed` is real DeepSpeed (`import megatrain as deepspeed`): nothing
told transformers that MegaTrain trains. (Under `megatrain launch`, with a "megatrain" section or with every deepspeed
import redirected, transformers is told and builds the model whole: integrations/hf_stage.py.) `initialize` then
gathers each partitioned parameter once, with DeepSpeed's own `GatheredParameters`, into a new whole parameter in the
model's place (the optimizer and the parameter list the script passed follow), so the engine takes an ordinary model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["is_partitioned", "gather_partitioned"]


def is_partitioned(p: torch.Tensor) -> bool:
    """A parameter DeepSpeed's zero.Init partitioned (it carries DeepSpeed's parameter id)."""
    return hasattr(p, "ds_id") and hasattr(p, "ds_tensor")


def gather_partitioned(model: nn.Module, optimizer: Any = None,
                       model_parameters: Any = None) -> tuple[int, Any]:
    """Replace every partitioned parameter of `model` by a whole one holding its gathered data (tied ones stay tied);
    swap them in `optimizer`'s groups too. Returns (how many were gathered, `model_parameters` with them swapped)."""
    slots = [(mod, name, p) for mod in model.modules() for name, p in mod._parameters.items()
             if p is not None and is_partitioned(p)]
    if not slots:
        return 0, model_parameters
    unique = {id(p): p for _, _, p in slots}
    # only a model DeepSpeed partitioned gets here: real DeepSpeed is installed
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    whole: dict[int, nn.Parameter] = {}
    with GatheredParameters(list(unique.values()), modifier_rank=None):
        for key, p in unique.items():
            whole[key] = nn.Parameter(p.data.detach().clone(), requires_grad=p.requires_grad)
    for mod, name, p in slots:
        mod._parameters[name] = whole[id(p)]

    def swap(params: Any) -> Any:
        return [whole.get(id(q), q) for q in ([params] if torch.is_tensor(params) else params)]

    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            group["params"] = swap(group["params"])
    if model_parameters is not None:
        items = list(model_parameters)
        if items and all(isinstance(g, dict) for g in items):
            model_parameters = [{**g, "params": swap(g["params"])} for g in items]
        else:
            model_parameters = swap(items)
    return len(unique), model_parameters
