"""One training point's plan (plan_point), the point in each host mode (MODES, mode_point), and the planner's
per-layer timeline: what estimate.plan, the mode table, the NVMe tier's rows and host mode "auto" build on."""

from __future__ import annotations

from typing import Any

from ..config.schema import AUTO
from .alst import default_loss_tile, zero3_alst_memory
from .hardware import Hardware
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
from .point import (
    Point,
    engine_refusal,
    placeholder_mode,
    refusals,
    with_point,
)
from .prediction import Plan
from .step_time import (
    async_globals,
    globals_io,
    head_compute,
    layer_costs,
    torch_time,
    zero3_time,
)

# (label, its EngineConfig settings), the exact ones fastest first (host mode "auto" tries them in
# that order: costs/host_mode.py).
MODES: list[tuple[str, dict[str, Any]]] = [
    ("fp32 master, fp32 grads", dict(host_master="fp32", host_grad_dtype="float32", optimizer_in_backward=False)),
    ("hilo master, fp32 grads", dict(host_master="hilo", host_grad_dtype="float32", optimizer_in_backward=False)),
    ("hilo master, bf16 grads", dict(host_master="hilo", host_grad_dtype="bfloat16", optimizer_in_backward=False)),
    ("fp32 master, optimizer in backward", dict(host_master="fp32", host_grad_dtype="float32", optimizer_in_backward=True)),
    ("hilo master, optimizer in backward", dict(host_master="hilo", host_grad_dtype="float32", optimizer_in_backward=True)),
    ("bf16 master, bf16 grads (paper's code)", dict(host_master="bf16", host_grad_dtype="bfloat16",
                                                    optimizer_in_backward=False)),
    ("bf16 master, optimizer in backward", dict(host_master="bf16", host_grad_dtype="float32", optimizer_in_backward=True)),
]
# The shapes the "largest preset" column ranks (the paper's dense presets, by size).
SCALE_PRESETS = ["llama2-7b", "qwen2.5-7b", "llama3.1-8b", "qwen2.5-14b", "qwen2.5-32b", "llama3.1-70b",
                 "qwen2.5-72b", "dense-120b"]


def mode_settings(knobs: dict[str, Any]) -> dict[str, Any]:
    """A mode's planner knobs under EngineConfig's names, ready for the "megatrain" config section."""
    return {"host_master": knobs["host_master"], "host_grad_dtype": knobs["host_grad_dtype"],
            "optimizer_in_backward": bool(knobs["optimizer_in_backward"])}


def mode_point(p: Point, knobs: dict[str, Any]) -> Point:
    """The point in one mode; the optimizer in backward cannot clip, so its rows plan without clipping (nor
    overlap or speculate: it updates each layer in backward, and its config refuses a speculative step beside it).
    Raises ValueError where the point's EngineConfig refuses the mode (e.g. hilo in FP32 compute)."""
    oib = knobs["optimizer_in_backward"]
    spec = {"speculative_step": AUTO} if oib and p.speculative_step is True else {}
    return with_point(p, **knobs, **spec, grad_clip=p.grad_clip and not oib,
                      optimizer_overlap=p.optimizer_overlap and not oib)


def plan_mode(p: Point, hw: Hardware, host_avail: int | None = None, device_avail: int | None = None) -> Plan:
    """The point's plan on `hw` in the host mode it names (a point whose host mode is still "auto" is planned by
    auto_mode.plan_point, which tries modes through this function); another backend keeps no host mode of the
    engine's."""
    p = placeholder_mode(p)
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
    (stream, kind, layer, start_s, end_s), to set against a measured trace (EngineConfig.trace). `p` names its host
    mode (estimate.predicted_timeline settles "auto" first)."""
    lc = place(p, hw, long_context_plan(p, hw))[0]
    io = globals_io(p, hw)
    costs = layer_costs(p, hw, lc.offload)
    off = async_globals(io, costs)
    head = head_compute(p, hw, True) + (0.0 if off else io.add_s + io.down_s) + hw.microbatch_overhead_s
    sim = simulate_step(p, costs, head, off, lc.residency)[0]
    return [{"stream": lane, "kind": kind, "layer": layer, "start_s": a, "end_s": b}
            for lane, kind, layer, a, b in sim.spans]
