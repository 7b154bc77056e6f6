"""The engine's mixed-precision casts on a plain model: one reference for the parity probe and the tests.

Plain PyTorch with bf16 parameters computes like the engine only with the engine's two casts besides the parameters'
own: the first decoder layer takes its input in the compute dtype and the head its input in its weight's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from .adapter import find_parts


def cast_points(model: nn.Module, dtype: torch.dtype) -> list:
    """The engine's two casts besides the parameters' own, as hooks on a plain model: the first decoder layer takes
    its input in the compute dtype (adapter.record_layer_inputs) and the head its input in its weight's dtype
    (loss._logits). Without them a model that mixes FP32 buffers or residuals into a bf16 model would fail in the
    reference where the engine does not."""
    parts = find_parts(model)

    def first_layer(mod: nn.Module, args: tuple, kwargs: dict):
        if args and torch.is_tensor(args[0]) and args[0].is_floating_point():
            return (args[0].to(dtype), *args[1:]), kwargs
        if torch.is_tensor(kwargs.get("hidden_states")):
            return args, {**kwargs, "hidden_states": kwargs["hidden_states"].to(dtype)}
        return args, kwargs

    def head(mod: nn.Module, args: tuple):
        return (args[0].to(mod.weight.dtype), *args[1:])

    return [parts.layers[0].register_forward_pre_hook(first_layer, with_kwargs=True),
            parts.lm_head.register_forward_pre_hook(head)]
