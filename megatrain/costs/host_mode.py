"""Host mode "auto": the fastest exact host-memory mode that fits, one rule for the engine and the planner.

The candidates, fastest first: an FP32 master (its bf16 shadow streams as is, no split to undo), the exact hi/lo
split (hilo: 2 B/param less), hilo with bf16 gradient slabs (2 B/param less again; exact only with one micro-batch
per step), then, when an NVMe path is given, the NVMe tier in the mode that spills the fewest bytes (hilo with bf16
slabs first: the least per layer on disk, so the least I/O per step). The paper's bf16 master is never chosen: it
is not exact. In FP32 compute only the FP32 master exists (hilo keeps a bf16 half that streams).

What "fits" means is each side's byte model, passed in as `fits`: the engine's preflight of the store it is about
to allocate (engine/host/preflight.py), the planner's whole host plan (planner/auto_mode.py). The order and
the eligibility are this module's, so a plan and a run choose alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .modes import GradSlab, HostMaster


@dataclass(frozen=True)
class HostMode:
    """One host-memory mode: the layers' master, their gradient slab, and whether the NVMe tier spills."""

    master: HostMaster
    grad: GradSlab
    nvme: bool = False

    @property
    def label(self) -> str:
        base = {HostMaster.FP32: "fp32 master", HostMaster.HILO: "hilo", HostMaster.BF16: "bf16 master"}[self.master]
        if self.grad is GradSlab.BFLOAT16:
            base += " + bf16 slabs"
        return base + (" + NVMe" if self.nvme else "")

    @property
    def settings(self) -> dict[str, str]:
        """The mode as keys of the "megatrain" config section."""
        return {"host_master": self.master.value, "host_grad_dtype": self.grad.value}


def candidates(bf16_compute: bool, accumulation_one: bool, nvme: bool, optimizer_in_backward: bool = False,
               grad: GradSlab | None = None) -> list[HostMode]:
    """The exact modes "auto" tries, fastest first. `grad`: a slab dtype the user set (None: "auto" too)."""
    if not bf16_compute:
        masters = [HostMaster.FP32]  # hilo's hi half is the bf16 weight that streams: bf16 compute only
    else:
        masters = [HostMaster.FP32, HostMaster.HILO]
    slabs = [GradSlab.FLOAT32]
    if bf16_compute and accumulation_one and not optimizer_in_backward:
        slabs.append(GradSlab.BFLOAT16)
    if grad is not None:
        slabs = [grad]
    host = [HostMode(m, g) for m in masters for g in slabs
            if grad is not None or not (m is HostMaster.FP32 and g is GradSlab.BFLOAT16)]  # bf16 slabs go with hilo
    if not nvme or optimizer_in_backward:  # the optimizer in backward keeps no state to spill
        return host
    return host + [HostMode(h.master, h.grad, True) for h in reversed(host)]  # least on disk first


def choose_host_mode(fits: Callable[[HostMode], bool], bf16_compute: bool, accumulation_one: bool, nvme: bool,
                     optimizer_in_backward: bool = False, grad: GradSlab | None = None) -> tuple[HostMode, bool]:
    """(the first candidate that `fits`, True), or (the one that needs the least host memory, False) when none
    does: the run then refuses with the store's bytes, the plan says it does not fit."""
    tried = candidates(bf16_compute, accumulation_one, nvme, optimizer_in_backward, grad)
    for mode in tried:
        if fits(mode):
            return mode, True
    spilling = [m for m in tried if m.nvme]
    return (spilling[0] if spilling else tried[-1]), False
