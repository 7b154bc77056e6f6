"""A training point's plan: bytes (memory.py) and seconds (step_time.py) per component, from shapes and a
hardware profile, and whether it fits.

Three backends are modelled at the same training point:
  megatrain  layers streamed through k device buffers, all state on the host (docs/DESIGN.md),
  zero3      DeepSpeed ZeRO-3 (or ZeRO-2) with parameters and optimizer offloaded to the CPU (zero3_model.py),
  torch      plain PyTorch + AdamW with everything on the device (the reference).
"""

from __future__ import annotations

from typing import Any

from . import point_plan
from .auto_mode import plan_point as plan_point
from .hardware import GIB, Hardware, resolve_hardware
from .point import Point, make_point
from .prediction import Plan


def plan(model: Any, context: int, batch: int = 1, grad_accum: int = 1, dtype: str = "bfloat16",
         hardware: str | Hardware | dict = "h200-pcie", backend: str = "megatrain", *,
         engine_config: Any = None, link_gbs: float | None = None, host_memory_gib: float | None = None,
         device_memory_gib: float | None = None, **knobs: Any) -> Plan:
    """Predict memory per component, step time, throughput and fit for one training point.

    knobs: num_buffers, offload_activations (True/False/'auto'), mlp_tile_tokens (None/'auto'/int;
    tile_tokens is its deprecated alias), device_budget_bytes,
    loss_chunk_tokens, host_master (its old name master: 'auto' (default: the fastest exact mode that fits, auto_mode.py)/'fp32'/'hilo'/
    'bf16'), host_grad_dtype ('auto'/'float32'/'bfloat16'), optimizer_overlap,
    grad_clip, gradient_checkpointing (zero3/torch), zero3_pin_memory.
    link_gbs / host_memory_gib / device_memory_gib override the profile (e.g. an emulated link).
    """
    p = make_point(model, context, batch, grad_accum, dtype, backend, engine_config, **knobs)
    if engine_config is not None:
        if link_gbs is None:
            link_gbs = getattr(engine_config, "link_gbps", None)  # the emulated link on CPU
        budget = getattr(engine_config, "device_budget_bytes", None)
        if device_memory_gib is None and budget:
            device_memory_gib = budget / GIB  # what the engine's "auto" plans against
    hw = resolve_hardware(hardware, link_gbs, host_memory_gib, device_memory_gib)
    return plan_point(p, hw)  # host mode "auto" (the engine's default) chosen there


def predicted_timeline(p: Point, hw: Hardware) -> list[dict[str, Any]]:
    """The planner's per-layer timeline of one step up to the optimizer, in the engine's trace format (stream, kind,
    layer, start_s, end_s), in the host mode the point plans (the one "auto" chooses where it is left open)."""
    return point_plan.predicted_timeline(plan_point(p, hw).point, hw)
