"""A training point's plan: bytes (memory.py) and seconds (step_time.py) per component, from shapes and a
hardware profile, and whether it fits.

Three backends are modelled at the same training point:
  megatrain  layers streamed through k device buffers, all state on the host (docs/DESIGN.md),
  zero3      DeepSpeed ZeRO-3 (or ZeRO-2) with parameters and optimizer offloaded to the CPU (zero3_model.py),
  torch      plain PyTorch + AdamW with everything on the device (the reference).
"""

from __future__ import annotations

from typing import Any

from .alst import default_loss_tile, zero3_alst_memory
from .hardware import GIB, Hardware, resolve_hardware
from .memory import (
    check_fit,
    fmt_bytes,
    long_context_plan,
    megatrain_memory,
    torch_memory,
    zero3_memory,
)
from .pipeline_sim import simulate_step
from .placement import place
from .point import Point, engine_refusal, make_point, refusals
from .prediction import Plan
from .step_time import (
    async_globals,
    globals_io,
    head_compute,
    layer_costs,
    torch_time,
    zero3_time,
)


def plan(model: Any, context: int, batch: int = 1, grad_accum: int = 1, dtype: str = "bfloat16",
         hardware: str | Hardware | dict = "h200-pcie", backend: str = "megatrain", *,
         engine_config: Any = None, link_gbs: float | None = None, host_memory_gib: float | None = None,
         device_memory_gib: float | None = None, **knobs: Any) -> Plan:
    """Predict memory per component, step time, throughput and fit for one training point.

    knobs: num_buffers, offload_activations (True/False/'auto'), mlp_tile_tokens (None/'auto'/int;
    tile_tokens is its deprecated alias), device_budget_bytes,
    loss_chunk_tokens, master ('auto' (default: the fastest exact mode that fits, auto_mode.py)/'fp32'/'hilo'/
    'bf16'), host_grad_dtype ('auto'/'float32'/'bfloat16'), optimizer_overlap,
    grad_clip, gradient_checkpointing (zero3/torch), zero3_pin_memory.
    link_gbs / host_memory_gib / device_memory_gib override the profile (e.g. an emulated link).
    """
    if "host_master" in knobs:  # EngineConfig's name for the same knob
        knobs["master"] = knobs.pop("host_master")
    auto_master = backend == "megatrain" and knobs.get("master", "auto") == "auto"
    grad = knobs.get("host_grad_dtype", "auto")
    if knobs.get("master", "auto") == "auto":
        knobs["master"] = "fp32"  # a placeholder: "auto" chooses below
    if grad == "auto":
        knobs["host_grad_dtype"] = "float32"  # an explicit master keeps FP32 slabs, as EngineConfig does
    p = make_point(model, context, batch, grad_accum, dtype, backend, engine_config, **knobs)
    if engine_config is not None:
        if link_gbs is None:
            link_gbs = getattr(engine_config, "link_gbps", None)  # the emulated link on CPU
        budget = getattr(engine_config, "device_budget_bytes", None)
        if device_memory_gib is None and budget:
            device_memory_gib = budget / GIB  # what the engine's "auto" plans against
    hw = resolve_hardware(hardware, link_gbs, host_memory_gib, device_memory_gib)
    if auto_master:
        from .auto_mode import plan_auto  # it plans through plan_point

        return plan_auto(p, hw, grad)
    return plan_point(p, hw)


def plan_point(p: Point, hw: Hardware, host_avail: int | None = None, device_avail: int | None = None) -> Plan:
    notes = []
    if p.context > p.model.max_positions:
        notes.append(f"context {p.context} exceeds the model's max_position_embeddings "
                     f"{p.model.max_positions}: the engine refuses it unless RoPE is extended")
    if p.backend == "megatrain" and p.optimizer_overlap and hw.unified_memory:
        notes.append("on a CPU 'device' the overlapped optimizer competes with compute for the same cores")
    lc = None
    if p.backend == "megatrain":
        refused = engine_refusal(p)
        if refused:
            notes.append(f"the engine refuses this mode here: {refused}")
        # the offload/tile choice is the engine's own (tiling.LongContextPolicy), so the plan is what runs
        lc = long_context_plan(p, hw)
        if lc.budget is not None and lc.peak_bytes > lc.headroom * lc.budget:
            notes.append(f"the engine's predicted device peak {fmt_bytes(lc.peak_bytes)} exceeds "
                         f"{lc.headroom:.0%} of its budget {fmt_bytes(lc.budget)}; it will warn and may run out")
        # residency: the planner's placement for "auto" (placement.py), the point's counts otherwise
        lc, t, placement = place(p, hw, lc)
        mem = megatrain_memory(p, hw, lc)
        decisions: dict[str, Any] = {"offload_activations": lc.offload, "mlp_tile_tokens": lc.tile,
                                     "loss_chunk_tokens": lc.loss_chunk, "residency": lc.residency.to_dict()}
        if placement is not None and placement.differs:
            notes.append(_placement_note(p, placement))
    elif p.backend == "zero3":
        mem, t = zero3_memory(p, hw), zero3_time(p, hw)
        decisions = {"gradient_checkpointing": p.gradient_checkpointing}
    elif p.backend == "zero3-alst":
        mem, t = zero3_alst_memory(p, hw), zero3_time(p, hw)
        decisions = {"mlp_tile_tokens": p.model.hidden, "loss_tile_tokens": default_loss_tile(p.model.vocab)}
        notes.append("zero3-alst step time is zero3's (its MLP and loss tiles' recompute not counted)")
    else:
        mem, t = torch_memory(p, hw), torch_time(p, hw)
        decisions = {"gradient_checkpointing": p.gradient_checkpointing}
    ok, reasons = check_fit(mem, hw, host_avail, device_avail)
    return Plan(p, hw, mem, t, ok, reasons, decisions, notes, lc, refusals(p),
                placement if p.backend == "megatrain" else None)


def _placement_note(p: Point, pl: Any) -> str:
    e, c = pl.engine, pl.chosen
    gain = pl.step_s[e] / pl.step_s[c] - 1
    _, h2d, recomputed = pl.replayed[e]
    return (f"residency: the engine's \"auto\" fill (weights first, then graphs) would keep {e.weights} layers' "
            f"weights and {e.activations} graphs (per step h2d {h2d:,} B, {recomputed} layers recomputed); keeping "
            f"{c.weights} and {c.activations} instead predicts {gain:.1%} more throughput (the config section sets "
            "them)")


def predicted_timeline(p: Point, hw: Hardware) -> list[dict[str, Any]]:
    """The planner's per-layer timeline of one step up to the optimizer, in the engine's trace format
    (stream, kind, layer, start_s, end_s), to set against a measured trace (EngineConfig.trace)."""
    lc = place(p, hw, long_context_plan(p, hw))[0]
    io = globals_io(p, hw)
    costs = layer_costs(p, hw, lc.offload)
    off = async_globals(io, costs)
    head = head_compute(p, hw, True) + (0.0 if off else io.add_s + io.down_s) + hw.microbatch_overhead_s
    sim = simulate_step(p, costs, head, off, lc.residency)[0]
    return [{"stream": lane, "kind": kind, "layer": layer, "start_s": a, "end_s": b}
            for lane, kind, layer, a, b in sim.spans]
