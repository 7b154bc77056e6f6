"""Which update path a run takes (WholeStep | Layered | Speculative | InBackward), decided once from the configuration
and the optimizer; beside update.py and speculative.py, which it chooses between, so neither imports the other."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from ...config.schema import EngineConfig
from ...costs.modes import HostMaster
from ..host import hilo
from ..host.events import LayerEvents
from ..host.store import HostStore
from ..runtime.stream import Trace
from . import adam_kernel, by_shard
from .optim import unsupported_reason
from .speculative import Speculative
from .update import InBackward, Layered, SpillFactory, UpdatePath, WholeStep


def choose(optimizer: torch.optim.Optimizer, store: HostStore, events: LayerEvents, config: EngineConfig,
           trace: Trace, *, agree: Callable[[int, str], int] | None = None,
           spill: SpillFactory | None = None, device_layers: frozenset[int] = frozenset(),
           speculate: frozenset[int] | None = None, back_off: bool = False) -> UpdatePath:
    """The update path the configuration and the optimizer allow. `agree`: how data-parallel ranks reach one
    verdict (ranks.py agree_max; None: one rank), used where layers update in backward or speculate; `spill`: the NVMe tier
    (spill.py spill_for), built by the per-layer path that runs through it; `device_layers`: the layers whose
    optimizer state lives on the device (resident.py), updated at step() on the caller's thread; `speculate`: with
    speculative_step on, the layers that speculate (speculative.py resolve; None: every layer); `back_off`: the
    speculation pauses while it keeps being rolled back (speculative_step "auto")."""
    # The node path's update by shard (by_shard.py): a layer at a time, each rank its ranges, never one whole step.
    split = by_shard.split_for(store) is not None
    layer_wise = (store.per_layer_update or config.optimizer_in_backward or config.nvme_path is not None
                  or split)
    reason = (unsupported_reason(optimizer) if config.optimizer_overlap or layer_wise or config.speculative_step is True
              else None)
    if reason is not None and layer_wise:
        # No whole-model FP32 master or gradient to step at once: a layer at a time or not at all.
        raise ValueError(f"host_master={config.host_master!r}, host_grad_dtype={config.host_grad_dtype!r}, "
                         f"optimizer_in_backward={config.optimizer_in_backward}, nvme_path={config.nvme_path!r} "
                         f"{'and the node path (each rank its ranges of every layer) ' if split else ''}"
                         "update one layer at a time, "
                         f"which needs torch's Adam or AdamW: {reason}; use the default modes for it")
    if reason is not None:
        warnings.warn(f"optimizer_overlap: {reason}, so it steps whole after backward", stacklevel=3)
    if config.optimizer_in_backward:
        path: UpdatePath = InBackward(optimizer, store, events, config, trace, agree)
    elif config.speculative_step is True and reason is None:
        path = Speculative(optimizer, store, events, config, trace, speculate, back_off, agree)
    elif reason is None and (config.optimizer_overlap or layer_wise or layer_pass_pays(optimizer, store)):
        path = Layered(optimizer, store, events, config, trace, spill)
    else:
        path = WholeStep(optimizer, store, events, config)
        path.device_layers = device_layers
        return path
    path.device_layers = device_layers
    if all(g.get("fused") is True for g in optimizer.param_groups):
        # The fused pass's kernels built and self-checked now, with a warning where they cannot be: not inside the
        # first step, on the optimizer thread, while the next forward waits for it.
        adam_kernel.prepare()
        if store.master_mode is not HostMaster.FP32:
            hilo.kernel()
    return path


def layer_pass_pays(optimizer: torch.optim.Optimizer, store: HostStore) -> bool:
    """Whether a step without overlap is better taken a layer at a time (Layered, waited for in step()): an FP32
    master with a bf16 shadow and torch's fused Adam/AdamW. The whole step reads and writes every master two
    more times than the fused pass (the clip's scaling pass and the shadow refresh after optimizer.step()); the
    fused pass gives the same bits (tests/unit/test_fused_pass.py). An FP32 master without a shadow (FP32 compute)
    keeps the whole step: there it moves the same bytes but for the clip pass, and takes any optimizer."""
    return (store.master_mode is HostMaster.FP32 and any(g.shadow is not None for g in store.layers)
            and unsupported_reason(optimizer) is None
            and all(g.get("fused") is True for g in optimizer.param_groups))
