"""What each backend actually ran: the optimizer kernel and the settings that decide its speed.

A comparison is only fair when every backend runs its best documented configuration, and a reader
can only check that when each result row says what ran. These read the live objects after
`prepare`, not the settings asked for, so a swapped optimizer (Accelerate replaces a torch AdamW
with DeepSpeedCPUAdam under ZeRO offload) is recorded as what it is.
"""

from __future__ import annotations

from typing import Any

import torch


def innermost_optimizer(opt: Any) -> Any:
    """Follow `.optimizer` wrappers (AcceleratedOptimizer, DeepSpeed's ZeRO optimizer) to the one
    whose kernel updates the parameters."""
    seen: set[int] = set()
    while id(opt) not in seen:
        seen.add(id(opt))
        inner = getattr(opt, "optimizer", None)
        if inner is None or inner is opt:
            break
        opt = inner
    return opt


def describe_optimizer(opt: Any) -> str:
    """e.g. `torch.optim.AdamW(fused)`, `deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode)`."""
    inner = innermost_optimizer(opt)
    cls = type(inner)
    module = cls.__module__
    if module.startswith("torch.optim."):
        module = "torch.optim"  # torch.optim.adamw.AdamW is exported as torch.optim.AdamW
    elif module.startswith("deepspeed.ops.adam."):
        module = "deepspeed.ops.adam"
    name = f"{module}.{cls.__name__}"
    flags: list[str] = []
    if isinstance(inner, torch.optim.Optimizer) and inner.param_groups and module == "torch.optim":
        group = inner.param_groups[0]
        if group.get("fused"):
            flags.append("fused")
        elif group.get("foreach"):
            flags.append("foreach")
        else:
            # torch picks foreach only when every tensor is on CUDA; on the CPU its default is the
            # per-tensor loop, the slowest kernel
            flags.append("default kernel")
    if getattr(inner, "adam_w_mode", None) is True:
        flags.append("adamw_mode")
    return f"{name}({', '.join(flags)})"


def backend_settings(acc: Any) -> dict[str, Any]:
    """The speed-relevant settings of the backend behind a megatrain Accelerator: for zero3 the
    `zero_optimization` section DeepSpeed was built with, after Accelerate resolved any "auto"."""
    backend = getattr(acc, "backend", None)
    if not str(getattr(backend, "name", None)).startswith("zero3"):
        return {}
    config = None
    hf = getattr(backend, "accelerate", None)
    plugin = getattr(getattr(hf, "state", None), "deepspeed_plugin", None)
    if plugin is not None:
        config = getattr(plugin, "deepspeed_config", None)
    if config is None:
        config = backend.ds_config or {}
    zero = dict(config.get("zero_optimization", {}))
    return {"zero_optimization": zero}
