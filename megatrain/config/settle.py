"""The engine's "auto" settled once per engine build, when the device and the optimizer are known.

megatrain/config/resolve.py settles what a face's arguments and config say; this is the second and last step
(`settle_engine`, from `EngineFacts`): `pin_memory` None (pin on a CUDA device), `optimizer_overlap` None (on for
a CUDA device with torch's Adam/AdamW), `speculative_step` "auto" (False, or `IF_FITS`: the engine measures the
rollback copy against the host once it holds the store, engine/update/speculative.py). A face's backend settles
before it builds the engine (megatrain/backend); an engine built directly settles itself; the planner settles a
point with the hardware profile's facts (planner/point.py `settled`). What stays "auto" after it is decided per
model or per batch, by one rule each: the host mode (`EngineConfig.host_mode_open`, costs/host_mode.py), and
residency, activation offload, the MLP tile and the loss chunk (costs/memory.py, per batch). Torch-free: the
planner imports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .schema import AUTO, IF_FITS, SETTLED, EngineConfig

__all__ = ["LATER", "LAYERED", "OPTIMIZERS", "WHOLE", "EngineFacts", "settle_engine"]


# What the optimizer the engine steps is, for optimizer_overlap and speculative_step "auto".
LAYERED = "layered"  # torch's Adam/AdamW (the engine's default): steps a layer at a time with the same result
WHOLE = "whole"  # another optimizer (or Adam with step hooks, capturable, differentiable): steps whole
LATER = "later"  # none yet: a later prepare() hands one over, stepped whole (its views would be built too early)
OPTIMIZERS = (LAYERED, WHOLE, LATER)


@dataclass(frozen=True)
class EngineFacts:
    """What the engine's "auto" depends on, known when an engine is built (or, for a plan, from a hardware profile)."""

    device_type: str  # the engine's device type: "cuda", "cpu", ...
    optimizer: str = LAYERED  # LAYERED, WHOLE or LATER
    # A face's config asks for pinned memory by habit (DeepSpeed configs do): turned off without CUDA instead of
    # refused. The engine built directly pins where it is told to (a failed pin raises).
    pin_by_habit: bool = False

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} must be one of {OPTIMIZERS}")


def settle_engine(config: EngineConfig, facts: EngineFacts) -> tuple[EngineConfig, tuple[str, ...]]:
    """`config` with the engine's device- and optimizer-dependent "auto" settled (see the module's docstring), and
    what it turned off that the user asked for (for the run's start line). Run once per engine build: a config
    settled already comes back as it is."""
    if config.stage == SETTLED:
        return config, ()
    cuda = facts.device_type == "cuda"
    changes: dict[str, Any] = {"_stage": SETTLED}
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
    return dataclasses.replace(config, **changes), tuple(off)
