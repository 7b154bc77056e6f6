"""The engine's settled plan: every "auto" of one engine build decided once, from the facts known before it builds.

megatrain/config/resolve.py folds what a face's arguments say into the settings as written (a `ResolvedConfig`);
this is the one step after it (`settle_engine`, from `EngineFacts`), which returns the plan (an `EnginePlan`) the
engine is built from: `pin_memory` None (pin on a CUDA device), `optimizer_overlap` None (on for a CUDA device with
torch's Adam/AdamW), `speculative_step` "auto" (False, or `IF_FITS`: the engine measures the rollback copy against
the host once it holds the store, engine/update/speculative.py), and, where the facts carry the model's host
bytes (`HostFacts`), host mode "auto": the fastest exact mode whose store fits (costs/host_mode.py's order).
The engine settles once, with its device, its optimizer, the model's sizes and the host's free memory
(engine/host/preflight.py host_facts); the planner settles a point with the hardware profile's facts
(planner/point.py `settled`) and chooses the host mode by the same order with its own byte model
(planner/auto_mode.py). What a plan still decides per batch, by one rule each (residency, activation offload, the
MLP tile and the loss chunk: costs/memory.py), it carries as those rules' settings. Torch-free: the planner
imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..costs.host_mode import HostMode, candidates, choose_host_mode
from .schema import AUTO, IF_FITS, EngineConfig, EnginePlan

__all__ = ["LATER", "LAYERED", "OPTIMIZERS", "WHOLE", "EngineFacts", "HostFacts", "settle_engine", "settle_host_mode"]


# What the optimizer the engine steps is, for optimizer_overlap and speculative_step "auto".
LAYERED = "layered"  # torch's Adam/AdamW (the engine's default): steps a layer at a time with the same result
WHOLE = "whole"  # another optimizer (or Adam with step hooks, capturable, differentiable): steps whole
LATER = "later"  # none yet: a later prepare() hands one over, stepped whole (its views would be built too early)
OPTIMIZERS = (LAYERED, WHOLE, LATER)


@dataclass(frozen=True)
class HostFacts:
    """What host mode "auto" depends on: whether a mode's store `fits` this host (the engine's preflight byte model,
    engine/host/preflight.py host_facts), whether one micro-batch makes a step (bf16 slabs add no sums then), and
    how data-parallel ranks `agree` (the largest of their candidate indices: each reads its own free memory)."""

    fits: Callable[[HostMode], bool]
    accumulation_one: bool = True
    agree: Callable[[int], int] | None = None


@dataclass(frozen=True)
class EngineFacts:
    """What the engine's "auto" depends on, known when an engine is built (or, for a plan, from a hardware profile)."""

    device_type: str  # the engine's device type: "cuda", "cpu", ...
    optimizer: str = LAYERED  # LAYERED, WHOLE or LATER
    # A face's config asks for pinned memory by habit (DeepSpeed configs do): turned off without CUDA instead of
    # refused. The engine built directly pins where it is told to (a failed pin raises).
    pin_by_habit: bool = False
    host: HostFacts | None = None  # None: host mode "auto" left to the caller's own rule (the planner's)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} must be one of {OPTIMIZERS}")


def settle_engine(config: EngineConfig, facts: EngineFacts) -> tuple[EnginePlan, tuple[str, ...]]:
    """The plan `config` settles to with `facts` (see the module's docstring), and what it turned off that the user
    asked for (for the run's start line; also the plan's `turned_off`). Run once per engine build: a plan comes back
    as it is, but for a host mode it left open, which `facts.host` settles."""
    if isinstance(config, EnginePlan):
        if facts.host is None or config.host_master != AUTO:
            return config, ()
        return settle_host_mode(config, facts.host), ()
    cuda = facts.device_type == "cuda"
    changes: dict[str, Any] = {}
    off: list[str] = []
    if config.pin_memory is None:
        changes["pin_memory"] = cuda
    elif config.pin_memory and facts.pin_by_habit and not cuda:
        changes["pin_memory"] = False  # pinning only speeds up host->CUDA copies
        off.append("pin_memory (no CUDA device)")
    layered = facts.optimizer == LAYERED
    if config.optimizer_overlap is None:
        # Where the host update can hide behind the device's forward: on a CPU device the layers' compute and the
        # host update share the cores. An optimizer handed over later steps whole (overlap splits the one it is
        # built with into per-layer views).
        changes["optimizer_overlap"] = cuda and layered and not config.optimizer_in_backward
    if config.speculative_step == AUTO:
        # The same, and only where it can run: no optimizer in backward, no NVMe tier (a spilled layer's state is on
        # disk between updates); whether its rollback copy fits is the engine's to measure (IF_FITS).
        can = cuda and layered and not config.optimizer_in_backward and config.nvme_path is None
        changes["speculative_step"] = IF_FITS if can else False
    plan = config.as_type(EnginePlan, turned_off=tuple(off), **changes)
    if facts.host is not None:
        plan = settle_host_mode(plan, facts.host)
    return plan, tuple(off)


def settle_host_mode(config: EngineConfig, host: HostFacts) -> Any:
    """`config` with host_master "auto" (and host_grad_dtype "auto") settled: the first mode of costs/host_mode.py's
    order that `host.fits`, the NVMe tier's modes after the host-only ones where nvme_path is set (the smallest when
    none fits: the engine's preflight then refuses with its bytes); with `host.agree`, the latest candidate any rank
    chose. `config` unchanged when its host mode is set."""
    if config.host_master != AUTO:
        return config
    args = (config.compute_dtype == "bfloat16", host.accumulation_one, config.nvme_path is not None,
            config.optimizer_in_backward, config.grad_slab_set)
    mode, _ = choose_host_mode(host.fits, *args)
    if host.agree is not None:
        tried = candidates(*args)
        mode = tried[host.agree(tried.index(mode))]
    return dataclasses.replace(config, **mode.settings)
