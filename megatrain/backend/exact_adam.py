"""DeepSpeed's CPU Adam, handed to MegaTrain, becomes torch's Adam/AdamW over the same param groups.

With `offload_optimizer` in a DeepSpeed config, accelerate (and so HF Trainer, TRL, LlamaFactory) swaps the
script's torch AdamW for `deepspeed.ops.adam.DeepSpeedCPUAdam` before `deepspeed.initialize`. Its C++ op keeps the
bias-correction powers beta^t as a running float product, one object per optimizer, and after a resume (a new
object, first step t > 1) recomputes them with pow(): the first resumed step already uses different bits than the
uninterrupted run, so a resumed run drifts (measured: 4.8e-7 in loss, run_clm.py resumed at step 40 of 120).
MegaTrain's masters and Adam state are in host memory whatever the config says, so the offload sections change
nothing here; the update that is bit-identical across save/resume is torch's, which the engine runs a layer at a
time (engine/update/optim.py, engine/update/fused.py). So the engine takes torch's Adam(W) in its place: same hyper-parameters,
the same param-group dicts (a schedule built on either object moves the same `lr`), FP32 state.
"""

from __future__ import annotations

import torch

__all__ = ["is_deepspeed_cpu_adam", "exact_optimizer"]


def is_deepspeed_cpu_adam(optimizer: object) -> bool:
    """Whether `optimizer` is real DeepSpeed's `DeepSpeedCPUAdam` (checked without importing deepspeed)."""
    return any(c.__name__ == "DeepSpeedCPUAdam" and c.__module__.startswith("deepspeed.ops.adam")
               for c in type(optimizer).__mro__)


def exact_optimizer(optimizer: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, str | None]:
    """(the optimizer the engine should step, what was replaced or None): a `DeepSpeedCPUAdam` becomes torch's
    AdamW (its `adamw_mode`, the default) or Adam (`adamw_mode=False`: L2 weight decay, as DeepSpeed's Adam mode)
    over the same param-group dicts; anything else comes back as is."""
    if not is_deepspeed_cpu_adam(optimizer):
        return optimizer, None
    if any(not g.get("bias_correction", True) for g in optimizer.param_groups):
        raise ValueError("DeepSpeedCPUAdam(bias_correction=False) has no exact equivalent in torch's Adam, which "
                         "MegaTrain steps; build the optimizer with bias_correction=True (DeepSpeed's default)")
    if any(g.get("amsgrad") for g in optimizer.param_groups):
        raise ValueError("DeepSpeedCPUAdam(amsgrad=True) is refused by DeepSpeed itself; build it with amsgrad=False")
    decoupled = bool(getattr(optimizer, "adam_w_mode", True))
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    groups = optimizer.param_groups
    for g in groups:
        # The group dicts may carry the keys of the torch optimizer accelerate built DeepSpeedCPUAdam from; its
        # weight-decay mode is the one DeepSpeed was told (adamw_mode), so that one is written down.
        g["decoupled_weight_decay"] = decoupled
    exact = cls(groups)  # the same dict objects: torch's Optimizer adds missing defaults to them in place
    what = f"DeepSpeedCPUAdam(adamw_mode={decoupled}) -> torch.optim.{cls.__name__}"
    if getattr(optimizer, "fp32_optimizer_states", True) is False:
        what += " (FP32 state: fp32_optimizer_states=False is not kept)"
    return exact, what
