"""`deepspeed.ops.adam`: DeepSpeedCPUAdam and FusedAdam with DeepSpeed's arguments, as torch's AdamW.

MegaTrain's masters live in host memory as FP32, where torch's fused CPU AdamW kernel runs; these classes
take DeepSpeed's constructor arguments and give the same update. What torch cannot do is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _check(name: str, bias_correction: bool, w_mode: bool, w_mode_name: str) -> None:
    if not bias_correction:
        raise ValueError(f"{name}(bias_correction=False) is not supported: torch's Adam always corrects the bias")
    if not w_mode:
        raise ValueError(f"{name}({w_mode_name}=False) (L2-style weight decay) is not supported by this class; use "
                         "torch.optim.Adam(params, weight_decay=...), which is that update")


class DeepSpeedCPUAdam(torch.optim.AdamW):
    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        _check("DeepSpeedCPUAdam", bias_correction, adamw_mode, "adamw_mode")
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False) is not supported: MegaTrain keeps Adam's "
                             "state in FP32")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


class FusedAdam(torch.optim.AdamW):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        _check("FusedAdam", bias_correction, adam_w_mode, "adam_w_mode")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
