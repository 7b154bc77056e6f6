"""The NVMe tier in a plan: for each host-memory mode that clips, the host and disk bytes with the layers the
engine would spill (costs/nvme.py's rule, the engine's), the disk I/O per step, whether it hides behind the
optimizer's own work, the predicted step time, and the largest preset that fits with and without the tier.

Per step every spilled byte is read once and written once. The engine spills as few layers as fit, spread
evenly through the model, and reads the next spilled layer's state while the updates before it run (writing
each behind its update), so the disk's n * r (r: one layer's read + write at the disk's rate) overlaps the
optimizer's L * u (u: one layer's AdamW) and only the excess and the first read show: the optimizer phase grows
by max(0, n * r - L * u) + r / 2. With optimizer_overlap that phase also overlaps the next forward, so the
figure is an upper bound there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from megatrain.costs.modes import HostMaster
from megatrain.costs.nvme import BudgetTooSmall, plan_spill, spill_bytes_per_param
from megatrain.models.presets import PRESETS

from .hardware import GB, GIB, Hardware
from .memory import fmt_bytes
from .point import Point, engine_refusal, with_point
from .point_plan import (
    MODES,
    SCALE_PRESETS,
    mode_point,
    mode_settings,
    plan_mode,  # its points name their mode
)
from .prediction import Plan

STORE_PARTS = ("master weights", "gradients", "adam m", "adam v", "bf16 shadow (streams)", "fp32 scratch (one layer)")
# the store's parts that stay in host memory whatever spills (costs/nvme.py: touched several times a step)
UNSPILLED_PARTS = ("master weights", "gradients", "bf16 shadow (streams)", "fp32 scratch (one layer)")


@dataclass
class NvmeRow:
    label: str
    knobs: dict[str, Any]
    exact: bool
    fits_without: bool
    fits: bool  # with the NVMe tier (host, disk and device; the engine runs the mode)
    host_bytes: int  # host total with the layers spilled
    disk_bytes: int
    spilled: int  # layers
    layers: int
    io_s: float  # disk busy per step
    added_s: float  # what the I/O adds to the step
    step_s: float
    host_budget_bytes: int  # the engine's host_budget_bytes for this plan (the store's share of the host)
    largest_without: str | None
    largest_with: str | None
    why: str | None = None
    min_host_bytes: int = 0  # the least host memory that trains this mode with the tier (every layer spilled)

    @property
    def hidden(self) -> bool:
        return self.added_s <= 0.01 * self.step_s


def with_nvme(hw: Hardware, nvme_gbs: float | None, nvme_gib: float | None) -> Hardware:
    """The profile with the user's disk rate and size (None: the profile's)."""
    changes = {k: float(v) for k, v in (("nvme_gbs", nvme_gbs), ("nvme_gib", nvme_gib)) if v is not None}
    return hw.with_(**changes) if changes else hw


def nvme_fit(pl: Plan, hw: Hardware) -> tuple[bool, dict[str, Any]]:
    """Whether point `pl` fits with the NVMe tier on `hw`, and its figures."""
    p, mem = pl.point, pl.memory
    m = p.model
    L, PL = m.num_layers, m.layer_params()
    store = sum(mem.host.get(k, 0) for k in STORE_PARTS)
    other = mem.host_total - store
    rec = int(PL * spill_bytes_per_param(p.master == HostMaster.HILO.value))
    budget = hw.host_bytes - other
    fixed = store - L * rec
    least = other + fixed + rec  # plan_spill's minimum (every layer spilled, one ring buffer) plus the rest
    out: dict[str, Any] = {"budget": budget, "host": mem.host_total, "disk": 0, "spilled": 0, "io_s": 0.0,
                           "added_s": 0.0, "why": None, "min_host": least}
    if p.optimizer_in_backward:
        out["why"] = "optimizer_in_backward does not spill"
        return False, out
    if hw.nvme_gbs is None:
        out["why"] = f"profile {hw.name} has no nvme_gbs: pass --nvme-gbs"
        return False, out
    try:
        sp = plan_spill(store - L * rec, [rec] * L, budget)
    except BudgetTooSmall:
        out["why"] = _too_small(mem.host, fixed, other, rec, least, hw.host_bytes, p.master == HostMaster.HILO.value)
        return False, out
    n = len(sp.spilled)
    u = pl.time.optimizer_busy_s * PL / m.param_count()
    r = 2 * rec / (hw.nvme_gbs * GB)
    added = max(0.0, n * r - L * u) + (r / 2 if n else 0.0)
    out.update(host=other + sp.resident_bytes, disk=sp.disk_bytes, spilled=n, io_s=n * r, added_s=added)
    if hw.nvme_gib is not None and sp.disk_bytes > hw.nvme_gib * GIB:
        out["why"] = f"needs {fmt_bytes(sp.disk_bytes)} of disk, the profile has {fmt_bytes(int(hw.nvme_gib * GIB))}"
        return False, out
    device_ok = mem.unified or mem.device_total <= hw.device_bytes
    return device_ok and engine_refusal(p) is None, out


def _too_small(parts: dict[str, int], fixed: int, other: int, rec: int, least: int, host: int, hilo: bool) -> str:
    """Why no spill plan fits the host, naming the part that is over: what never spills, or one layer's buffer."""
    kept = [k.split(" (")[0] for k in UNSPILLED_PARTS if parts.get(k)]
    kept_s = ", ".join(f"{k} (the hi half)" if hilo and k == "master weights" else k for k in kept)
    need = f"needs at least {fmt_bytes(least)} of host memory"
    if other + fixed > host:
        return (f"what never spills ({kept_s}: {fmt_bytes(fixed)}) with the rest of the host's use ({fmt_bytes(other)}) exceeds the "
                f"host's {fmt_bytes(host)}; {need}")
    return (f"one layer's spilled state ({fmt_bytes(rec)}) does not fit beside what never spills ({kept_s}: "
            f"{fmt_bytes(fixed)}) and the rest of the host's use ({fmt_bytes(other)}) in the host's {fmt_bytes(host)}; {need}")


def nvme_rows(p: Point, hw: Hardware, search: bool = True) -> list[NvmeRow]:
    """One row per mode that keeps gradient clipping (the optimizer in backward cannot, and does not spill) and
    that the point's config takes (hilo needs bf16 compute)."""
    rows = []
    sizes = sorted(SCALE_PRESETS, key=lambda n: PRESETS[n].param_count())
    for label, knobs in MODES:
        if knobs["optimizer_in_backward"]:
            continue
        try:
            q = mode_point(p, knobs)
        except ValueError:
            continue  # EngineConfig refuses the mode at this point: nothing to spill
        pl = plan_mode(q, hw)
        ok, f = nvme_fit(pl, hw)
        best = best_nvme = None
        if search:
            for name in sizes:
                other = plan_mode(with_point(q, model=PRESETS[name]), hw)
                if other.feasible:
                    best = name
                if nvme_fit(other, hw)[0]:
                    best_nvme = name
        rows.append(NvmeRow(label, knobs, HostMaster(knobs["host_master"]).exact, pl.feasible, ok, f["host"], f["disk"],
                            f["spilled"], q.model.num_layers, f["io_s"], f["added_s"], pl.time.step_s + f["added_s"],
                            f["budget"], best, best_nvme, f["why"], f["min_host"]))
    return rows


def format_nvme_rows(rows: list[NvmeRow], hw: Hardware) -> list[str]:
    src = hw.sources.get("nvme_gbs", "")
    rate = f"{hw.nvme_gbs:g} GB/s" if hw.nvme_gbs else "no disk rate"
    size = f", {fmt_bytes(int(hw.nvme_gib * GIB))}" if hw.nvme_gib else ""
    out = [f"  NVMe tier (nvme_path + host_budget_bytes; Adam m/v and the hi/lo lo half of the spilled layers on "
           f"disk), disk {rate}{size} [{src or 'no source'}]; the modes that clip:",
           f"    {'mode':<47}{'host':>11}{'disk':>11}{'spilled':>9}{'I/O/step':>10}{'adds':>9}{'step':>9}  "
           "fits  largest preset (host only -> with NVMe)"]
    for r in rows:
        fit = "yes" if r.fits else "NO"
        out.append(f"    {r.label + ' + NVMe':<47}{fmt_bytes(r.host_bytes):>11}{fmt_bytes(r.disk_bytes):>11}"
                   f"{f'{r.spilled}/{r.layers}':>9}{r.io_s:>9.1f}s{r.added_s:>8.1f}s{r.step_s:>8.1f}s  {fit:<5}"
                   f"{r.largest_without or '-'} -> {r.largest_with or '-'}" + (f"  ({r.why})" if r.why else ""))
        if r.fits and r.spilled:
            cfg = {**mode_settings(r.knobs), "nvme_path": "/path/on/nvme", "host_budget_bytes": r.host_budget_bytes}
            out.append(f"      \"megatrain\": {json.dumps(cfg)}"
                       + ("  (I/O hidden behind the optimizer)" if r.hidden else ""))
    return out
