"""Fit questions over the memory model: does it fit, the largest batch/context, and preflight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..costs.host_memory import host_memory_available
from .auto_mode import plan_point
from .estimate import plan
from .hardware import Hardware, get_hardware, resolve_hardware
from .memory import check_fit
from .multi import node_memory, plan_point_multi
from .point import Point, make_point, with_point

MAX_SEARCH = 1 << 24  # 16M tokens of context / micro-batch size: beyond any profile here
# Preflight compares against memory that is free now, so the OS is already out of it; what remains
# to charge is the run's own process: python + torch + transformers measured at ~0.35 GiB RSS on
# CPU (0.6 with slack), and with CUDA the mapped CUDA libraries and pinned pools on the host plus the
# context, cuBLAS workspace and allocator slack on the device (assumptions).
PREFLIGHT_HOST_RUNTIME_GIB = {"cpu": 0.6, "cuda": 3.0}
PREFLIGHT_DEVICE_RUNTIME_GIB = 1.5


def fits(model: Any, context: int, batch: int = 1, grad_accum: int = 1, dtype: str = "bfloat16",
         hardware: str | Hardware | dict = "h200-pcie", backend: str = "megatrain", **knobs: Any) -> bool:
    """Whether the point fits the profile's host and device memory."""
    return plan(model, context, batch, grad_accum, dtype, hardware, backend, **knobs).fits


def _largest(ok, lo: int, granularity: int) -> int:
    """Largest n (a multiple of granularity, >= lo) with ok(n), assuming ok is monotone; 0 if none."""
    if not ok(lo):
        return 0
    hi = lo
    while hi < MAX_SEARCH and ok(min(hi * 2, MAX_SEARCH)):
        hi = min(hi * 2, MAX_SEARCH)
    if hi >= MAX_SEARCH:
        return MAX_SEARCH
    good, bad = hi, min(hi * 2, MAX_SEARCH)
    while bad - good > granularity:
        mid = (good + bad) // 2 // granularity * granularity
        if mid <= good:
            break
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good


def max_batch(model: Any, context: int, dtype: str = "bfloat16", hardware: str | Hardware | dict = "h200-pcie",
              backend: str = "megatrain", grad_accum: int = 1, **knobs: Any) -> int:
    """Largest micro-batch that fits at this context (0 when not even 1 does)."""
    hw_over = {k: knobs.pop(k) for k in ("link_gbs", "host_memory_gib", "device_memory_gib") if k in knobs}
    hw = resolve_hardware(hardware, **{k: hw_over.get(k) for k in ("link_gbs", "host_memory_gib", "device_memory_gib")})
    base = make_point(model, context, 1, grad_accum, dtype, backend, **knobs)
    return _largest(lambda b: plan_point(with_point(base, batch=b), hw).fits, 1, 1)


def max_context(model: Any, batch: int = 1, dtype: str = "bfloat16", hardware: str | Hardware | dict = "h200-pcie",
                backend: str = "megatrain", grad_accum: int = 1, granularity: int = 1024, **knobs: Any) -> int:
    """Largest context (a multiple of `granularity`) that fits at this micro-batch; memory only, so it
    may exceed the model's max_position_embeddings, which the engine refuses (largest_context counts that)."""
    hw_over = {k: knobs.pop(k) for k in ("link_gbs", "host_memory_gib", "device_memory_gib") if k in knobs}
    hw = resolve_hardware(hardware, **{k: hw_over.get(k) for k in ("link_gbs", "host_memory_gib", "device_memory_gib")})
    base = make_point(model, granularity, batch, grad_accum, dtype, backend, **knobs)
    return _largest(lambda s: plan_point(with_point(base, context=s), hw).fits, granularity, granularity)


def largest_batch(base: Point, hw: Hardware) -> int:
    """Largest micro-batch at the point's context that fits and that the engine runs (0 when none does:
    memory, or a context or mode the engine refuses)."""
    return _largest(lambda b: plan_point(with_point(base, batch=b), hw).feasible, 1, 1)


def largest_context(base: Point, hw: Hardware, granularity: int = 1024) -> int:
    """Largest context at the point's micro-batch that fits and that the engine runs: a multiple of
    granularity, or the model's own limit (max_position_embeddings, RoPE scaling included) when that fits."""
    return _longest(lambda s: plan_point(with_point(base, context=s), hw).feasible, base, granularity)


def _longest(ok, base: Point, granularity: int) -> int:
    # the engine refuses a context beyond the model's positions, so the search stops there
    limit = base.model.max_positions if base.backend == "megatrain" else MAX_SEARCH
    if ok(limit):
        return limit
    step = min(granularity, limit)
    return _largest(lambda s: s < limit and ok(s), step, step)


def max_batch_multi(base: Point, hw: Hardware, gpus_per_node: int, nodes: int) -> int:
    """Largest micro-batch per rank whose node fits and the engine runs (0 when none does)."""
    return _largest(lambda b: plan_point_multi(with_point(base, batch=b), hw, gpus_per_node, nodes).rank.feasible,
                    1, 1)


def max_context_multi(base: Point, hw: Hardware, gpus_per_node: int, nodes: int, granularity: int = 1024) -> int:
    """Largest context (a multiple of granularity, or the model's limit) whose node fits at the point's
    micro-batch and the engine runs."""
    return _longest(lambda s: plan_point_multi(with_point(base, context=s), hw, gpus_per_node, nodes).rank.feasible,
                    base, granularity)


@dataclass
class Preflight:
    ok: bool
    reason: str
    host_needed: int
    host_available: int
    device_needed: int
    device_available: int

    def __iter__(self):  # so `ok, reason = preflight(...)` works
        return iter((self.ok, self.reason))


def device_memory_available() -> int | None:
    """Free bytes on the current CUDA device, or None without one (torch imported only here)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return int(free)


def preflight(model: Any, context: int, batch: int = 1, backend: str = "megatrain", dtype: str = "bfloat16",
              *, grad_accum: int = 1, host_available: int | None = None, device_available: int | None = None,
              hardware: str | Hardware | dict | None = None, gpus_per_node: int = 1, nodes: int = 1,
              **knobs: Any) -> Preflight:
    """Check a point against the memory this machine has free before allocating anything.

    host_available: bytes (default: cgroup headroom if a limit is set, else MemAvailable).
    device_available: bytes (default: free CUDA memory; without CUDA the device is this host, so
    device allocations are charged to host memory). gpus_per_node, nodes: a data-parallel job whose
    gpus_per_node ranks share this host's one store (planner/multi.py): the host side is the node's.
    Returns Preflight (unpacks as ok, reason).
    """
    for name, v in (("gpus_per_node", gpus_per_node), ("nodes", nodes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}: must be a whole number >= 1")
    host_src = "given"
    if host_available is None:
        hm = host_memory_available()
        host_available, host_src = hm.available_bytes, hm.source
    if device_available is None:
        device_available = device_memory_available()
    # Only the memory side of the profile matters here; the runtime reserve stays in the plan.
    hw = get_hardware(hardware if hardware is not None else ("cpu" if device_available is None else "h200-pcie"))
    unified = device_available is None
    hw = hw.with_(unified_memory=unified, host_memory_gib=host_available / 1024**3,
                  device_memory_gib=(device_available if device_available is not None else host_available) / 1024**3,
                  host_reserved_gib=PREFLIGHT_HOST_RUNTIME_GIB["cpu" if unified else "cuda"],
                  device_reserved_gib=PREFLIGHT_DEVICE_RUNTIME_GIB)
    p = make_point(model, context, batch, grad_accum, dtype, backend, **knobs)
    pl = plan_point(p, hw, host_available, device_available if device_available is not None else host_available)
    if gpus_per_node * nodes > 1:
        pl.memory = node_memory(pl, gpus_per_node, nodes)[0]
    ok, lines = check_fit(pl.memory, hw, host_available,
                          device_available if device_available is not None else host_available)
    ranks = f" ({gpus_per_node} ranks sharing this host)" if gpus_per_node > 1 else ""
    head = (f"{p.backend} {p.model.name} context {p.context} x batch {p.batch} {p.dtype}{ranks}: "
            f"{'fits' if ok else 'does not fit'} (host available from {host_src})")
    extra = [f"chosen: {k}={v}" for k, v in pl.decisions.items()] + pl.warnings
    reason = "; ".join([head, *lines, *extra])
    dev_need = pl.memory.device_total
    return Preflight(ok, reason, pl.memory.host_total_incl_device if unified else pl.memory.host_total,
                     host_available, dev_need,
                     device_available if device_available is not None else host_available)

