"""Host mode "auto" in a plan: the engine's own settle function (config/settle.py settle_host_mode, over
costs/host_mode.py's order) with the planner's whole host plan as its `fits`, so a plan and a run cannot choose apart.

A host-only mode fits when the plan fits (memory and the engine); an NVMe-tier mode, tried when the profile has
a disk (nvme_gbs), when the tier's spill plan fits the host, the disk and the device (nvme_plan.py's nvme_fit).
The chosen mode's plan is returned with the choice: its verdict is the plan's first line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatrain.costs.host_mode import HostMode
from megatrain.costs.modes import GradSlab

from ..config.settle import HostFacts, settle_host_mode
from .hardware import Hardware
from .memory import fmt_bytes
from .nvme_plan import nvme_fit
from .point import Point, with_point
from .point_plan import mode_point, plan_mode
from .prediction import Plan


@dataclass
class AutoChoice:
    """What "auto" chose at a point: the mode, whether it fits, and the NVMe tier's figures when it spills."""

    mode: HostMode
    fits: bool
    nvme: dict[str, Any] = field(default_factory=dict)  # nvme_fit's figures (host, disk, spilled, budget, ...)

    @property
    def verdict(self) -> str:
        """`fits: ...`'s words: "yes, exact, hilo + bf16 slabs + NVMe 130 GiB" or "NO, exact, ..."."""
        disk = f" {fmt_bytes(self.nvme['disk'])}" if self.mode.nvme and self.nvme.get("disk") else ""
        return f"{'yes' if self.fits else 'NO'}, exact, {self.mode.label}{disk}"

    @property
    def settings(self) -> dict[str, Any]:
        """The "megatrain" keys that run this mode (the NVMe tier's path is the user's to fill in)."""
        out: dict[str, Any] = dict(self.mode.settings)
        if self.mode.nvme:
            out.update(nvme_path="/path/on/nvme", host_budget_bytes=int(self.nvme["budget"]))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode.label, "exact": True, "fits": self.fits, "settings": self.settings,
                **({"nvme": {k: self.nvme[k] for k in ("host", "disk", "spilled")}} if self.mode.nvme else {})}


def _knobs(mode: HostMode, p: Point) -> dict[str, Any]:
    return dict(host_master=mode.master.value, host_grad_dtype=mode.grad.value, optimizer_in_backward=p.optimizer_in_backward)


# The NVMe tier the plan offers where the profile has a disk (nvme_gbs): the engine tries it where nvme_path is set,
# so the point's settings are settled as if the user had set one (the path is the user's to fill in).
NVME_OFFERED = "/path/on/nvme"


def settle_mode(p: Point, fits: Callable[[HostMode], bool], nvme: bool) -> tuple[HostMode, bool]:
    """Host mode "auto" at point `p` settled by the library's one rule, the engine's (config/settle.py
    settle_host_mode, HostFacts): the point's engine settings as written (the NVMe tier offered with `nvme`, as a
    set nvme_path), the planner's byte model as `fits`. Returns the mode and whether it fits. Where the settings
    leave no host mode to choose (FP32 compute: the FP32 master at once), the NVMe tier is the store's spill (the
    engine spills what its budget cannot hold wherever nvme_path is set): taken where the host-only store does not
    fit."""
    tried: list[tuple[HostMode, bool]] = []

    def recorded(mode: HostMode) -> bool:
        ok = fits(mode)
        tried.append((mode, ok))
        return ok

    try:
        written = p.engine.rewrite(nvme_path=NVME_OFFERED) if nvme else p.engine
    except ValueError:  # a setting the tier refuses (speculative_step=True, ...): host-only modes
        written = p.engine
    settled = settle_host_mode(written, HostFacts(recorded, accumulation_one=p.grad_accum == 1))
    chosen = HostMode(settled.master_mode, GradSlab(settled.host_grad_dtype))
    if not tried:  # nothing was left to choose
        if recorded(chosen) or written.nvme_path is None or p.optimizer_in_backward:
            return chosen, tried[-1][1]
        spill = HostMode(chosen.master, chosen.grad, True)
        return spill, recorded(spill)
    first = next((m for m, ok in tried if ok), None)
    if first is not None:
        return first, True
    # none fits: the rule's fallback (the least host memory: the first spilling mode tried, else the last)
    same = [m for m, _ in tried if m.settings == chosen.settings]
    return next((m for m in same if m.nvme), same[-1]), False


def plan_auto(p: Point, hw: Hardware, host_avail: int | None = None, device_avail: int | None = None) -> Plan:
    """The plan of point `p` (host mode "auto") in the mode "auto" chooses on `hw` (settle_mode); the choice rides on
    the plan as `auto`. host_avail / device_avail: as plan_mode's."""
    seen: dict[HostMode, tuple[Plan, bool, dict[str, Any]]] = {}

    def fits(mode: HostMode) -> bool:
        q = mode_point(p, _knobs(mode, p)) if not p.optimizer_in_backward else with_point(p, **_knobs(mode, p))
        pl = plan_mode(q, hw, host_avail, device_avail)
        ok, figures = nvme_fit(pl, hw) if mode.nvme else (pl.feasible, {})
        seen[mode] = (pl, ok, figures)
        return ok

    mode, ok = settle_mode(p, fits, hw.nvme_gbs is not None)
    if mode not in seen:
        fits(mode)
    pl, _, figures = seen[mode]
    pl.auto = AutoChoice(mode, ok, figures)
    return pl


def plan_point(p: Point, hw: Hardware, host_avail: int | None = None, device_avail: int | None = None) -> Plan:
    """The point's plan on `hw`. A megatrain point whose host mode is "auto" (as written: the engine's default) plans
    the mode "auto" chooses, the choice on the plan (`plan_auto`); any other point is planned in the mode it names.
    host_avail / device_avail: what this machine has, where the plan should judge against it."""
    if p.backend == "megatrain" and p.engine.chooses_host_mode:
        return plan_auto(p, hw, host_avail, device_avail)
    return plan_mode(p, hw, host_avail, device_avail)
