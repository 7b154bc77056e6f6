"""A plan in full (`megatrain plan --details`): memory by component, the long-context device plan, the fit, the
residency, the host modes, time per layer and per step, the timeline, and beside it the other backends and plain
PyTorch; and one rank's plan with the data-parallel job's figures. The first screen is summary.py's."""

from __future__ import annotations

import json
from typing import Any

from .host_rates import host_bound_line
from .host_work import host_assumptions_line
from .memory import fmt_bytes
from .mode_table import ModeRow, format_mode_table
from .node_path import KEPT_SHARDS as NODE_SHARDS
from .point import context_refusal
from .prediction import Plan
from .reference import reference_line, torch_reference
from .step_time import crossover_closed_form, link_overlap
from .step_timeline import format_timeline
from .summary import fits, fmt_seconds, node_residency_line, nvme_added_s


def _si(x: float, unit: str = "") -> str:
    for p, d in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= d:
            return f"{x / d:.3g}{p}{unit}"
    return f"{x:.3g}{unit}"


def format_plan(pl: Plan, biggest_batch: int | None = None, biggest_context: int | None = None,
                others: list[Plan] | None = None, modes: list[ModeRow] | None = None) -> str:
    p, hw, m, t = pl.point, pl.hardware, pl.point.model, pl.time
    P = m.param_count()
    out = [
        f"{p.backend} plan: {m.name} ({_si(P)} params{_active(m)}, {m.num_layers} layers x {_si(m.layer_params())}) "
        f"on {hw.name} [{hw.link}, {hw.link_gbs_achieved:g} GB/s per direction]",
        f"  context {p.context}, micro-batch {p.batch}, accumulation {p.grad_accum} "
        f"({p.tokens_per_step} tokens/step), compute {p.dtype}"
        + (f", {p.num_buffers} layer buffers" if p.backend == "megatrain" else "")
        + "".join(f", {k}={v}" for k, v in pl.decisions.items()),
    ]
    for pool, comps, total, cap in (("host memory", pl.memory.host, pl.memory.host_total, hw.host_bytes),
                                    ("device memory", pl.memory.device, pl.memory.device_total, hw.device_bytes)):
        out.append(f"  {pool:<34}{'':>12}   B/param")
        for k, v in comps.items():
            if v:
                out.append(f"    {k:<32}{fmt_bytes(v):>12}   {v / P:7.2f}")
        out.append(f"    {'total':<32}{fmt_bytes(total):>12}   {total / P:7.2f}   of {fmt_bytes(cap)}")
        if pool == "host memory" and pl.memory.pinned:
            out.append(f"    {'of which pinned':<32}{fmt_bytes(pl.memory.pinned):>12}   {pl.memory.pinned / P:7.2f}")
    if pl.memory.unified:
        out.append(f"    (unified: host + device = {fmt_bytes(pl.memory.host_total_incl_device)} "
                   f"of {fmt_bytes(hw.host_bytes)})")
    out += _long_context_lines(pl)
    verdict = pl.auto.verdict if pl.auto is not None else ("yes" if pl.feasible else "NO")
    spills = pl.auto is not None and pl.auto.mode.nvme
    reasons = [r.replace("host:", "host, all in memory:", 1) if spills else r for r in pl.reasons + pl.refused]
    out.append("  fits: " + verdict + "".join(f"\n    {r}" for r in reasons))
    if pl.auto is not None and pl.auto.mode.nvme and pl.auto.nvme:
        f = pl.auto.nvme
        out.append(f"    spilling to NVMe: host {fmt_bytes(f['host'])} of {fmt_bytes(hw.host_bytes)}, "
                   f"{f['spilled']}/{m.num_layers} layers' optimizer state on disk ({fmt_bytes(f['disk'])}), "
                   f"adds {fmt_seconds(f['added_s'])} per step" + (f" ({f['why']})" if f.get("why") else ""))
    if p.backend == "megatrain":
        out += _residency_lines(pl)
        section = {**pl.settings, **(pl.auto.settings if pl.auto is not None else {})}
        out.append(f"  \"megatrain\" config section for this plan: {json.dumps(section)}")
        if pl.auto is not None:
            out.append(f"    (host mode \"auto\", the engine's default, chooses {pl.auto.mode.label} here by the "
                       "same rule; the section names it)")
    if modes:
        out += format_mode_table(modes, hw.host_bytes, p)
    lt = t.layer
    out += [
        "  time per streamed layer (one micro-batch):",
        f"    forward  compute {fmt_seconds(lt.fwd_compute)}, h2d {fmt_seconds(lt.fwd_h2d)}, d2h {fmt_seconds(lt.fwd_d2h)} -> {fmt_seconds(lt.fwd)}",
        f"    backward compute {fmt_seconds(lt.bwd_compute)} (recompute incl.), h2d {fmt_seconds(lt.bwd_h2d)}, "
        f"d2h+accumulate {fmt_seconds(lt.bwd_d2h)} -> {fmt_seconds(lt.bwd)}",
        f"  per micro-batch: forward {fmt_seconds(t.forward_s)}, head+loss {fmt_seconds(t.head_s)}, backward {fmt_seconds(t.backward_s)}"
        + (f"; per step: last gradients drain {fmt_seconds(t.fill_drain_s)}" if p.backend == "megatrain"
           else f", pipeline fill/drain {fmt_seconds(t.fill_drain_s)}"),
        f"  per step: embedding/head I/O {fmt_seconds(t.embed_io_s)}, optimizer {fmt_seconds(t.optimizer_busy_s)}"
        + ((" (in backward)" if p.optimizer_in_backward else " (overlapped)" if t.optimizer_overlap
            else " (after backward)") if p.backend == "megatrain" else " (after backward)"),
        _step_detail(pl),
        f"  link per step: h2d {fmt_bytes(t.h2d_bytes)}, d2h {fmt_bytes(t.d2h_bytes)}; compute waits on copies "
        f"{fmt_seconds(t.copy_wait_s)}",
        "  busy per step: " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in t.busy_s.items())
        + f" -> bottleneck: {t.bottleneck}",
    ]
    if pl.crossover_tokens is not None:
        out.append(f"  link stops being the bottleneck at >= {pl.crossover_tokens:,.0f} tokens per micro-batch "
                   f"(Phi/B closed form {crossover_closed_form(hw, p.dtype):,.0f}); this point has {p.tokens:,}")
    if pl.timeline is not None:
        out += format_timeline(pl.timeline)
    if p.backend == "megatrain" and (host := host_bound_line(p, t, t.optimizer_overlap)) is not None:
        out.append(host)  # from how many tokens per step the compute outlasts the host's pass (host_rates.py)
    if p.backend == "megatrain" and not hw.unified_memory:
        out.append(host_assumptions_line(p, hw))  # the threads, bandwidth and NUMA binding the host rates assume
    if m.is_moe and p.backend == "megatrain":
        out += _moe_lines(pl)
    out += _largest_lines(pl, biggest_batch, biggest_context)
    for w in pl.warnings:
        out.append(f"  warning: {w}")
    ref = torch_reference(pl)
    if ref is not None:
        out.append(reference_line(pl, ref))
    for o in others or []:
        ratio = o.time.step_s / t.step_s
        out.append(f"  {o.point.backend} at the same point: step {fmt_seconds(o.time.step_s)}, "
                   f"{o.tokens_per_s:,.0f} tokens/s, {o.model_tflops:.1f} TFLOPS, host {fmt_bytes(o.memory.host_total)}, "
                   f"device {fmt_bytes(o.memory.device_total)}, fits: {'yes' if o.feasible else 'NO'}; "
                   f"throughput {p.backend}/{o.point.backend} = {ratio:.2f}x (its bottleneck: {o.time.bottleneck})")
        if o.point.backend == "zero3":
            out.append("    (zero3 from DeepSpeed's mechanisms: per-module fetches and hooks, gradient buckets, "
                       "DeepSpeedCPUAdam at the profile's rate; checked in results/zero3_mechanisms/README.md)")
    out.append("  (predicted; model TFLOPS = 6*N_nonembed*T + 12*L*h*s*T/2 per step, recompute not counted)")
    return "\n".join(out)


def _step_detail(pl: Plan) -> str:
    """The details' step line: the pipeline's step, with the NVMe tier's time where the chosen mode spills (the
    first screen's headline is their sum), and no throughput claim for a point that does not fit."""
    p, t, hw = pl.point, pl.time, pl.hardware
    added = nvme_added_s(pl)
    if not fits(pl):
        return (f"  step (if it fit; it does not: no throughput is predicted) {fmt_seconds(t.step_s)}, "
                f"{pl.model_tflops:.1f} model TFLOPS at that step")
    total = t.step_s + added
    nv = f" + NVMe {fmt_seconds(added)} = {fmt_seconds(total)}" if added else ""
    return (f"  step {fmt_seconds(t.step_s)}{nv}: {p.tokens_per_step / total:,.0f} tokens/s, "
            f"{pl.model_tflops * t.step_s / total:.1f} model TFLOPS, MFU {100 * pl.mfu * t.step_s / total:.1f}% of "
            f"{hw.peak_flops(p.dtype) / 1e12:g} TFLOPS peak")


def _residency_lines(pl: Plan) -> list[str]:
    """The placement (costs/residency.py) and what the engine will report per step to compare with it."""
    lc, t = pl.long_context, pl.time
    if lc is None:
        return []
    how = ("set" if pl.point.engine.residency_set is not None
           else "the planner's search, as the engine's \"auto\" fills it" if not pl.placement or not pl.placement.differs
           else "the planner's search, which differs from the engine's \"auto\" fill (see the warning)")
    room = "no limit" if lc.residency_room is None else fmt_bytes(lc.residency_room)
    if NODE_SHARDS in pl.memory.device:
        return []  # a rank on the node path: format_multi says its placement (node_residency_lines)
    return [f"  {pl.residency_line} [{how}; room beside the working set: {room}]",
            f"    kept weights {fmt_bytes(lc.kept_weight_bytes)}, kept graphs {fmt_bytes(lc.kept_graph_bytes)}"
            + (f", streaming ring freed {fmt_bytes(lc.ring_freed_bytes)}" if lc.ring_freed_bytes else "")
            + f"; per step: h2d {fmt_bytes(t.h2d_bytes)} ({t.h2d_bytes:,} B), {t.recomputed_layers} layers recomputed"]


def _active(m: Any) -> str:
    return f", {_si(m.active_param_count())} active: {m.moe.top_k} of {m.moe.experts} experts" if m.is_moe else ""


def _moe_lines(pl: Plan) -> list[str]:
    """The overlap condition of a mixture of experts: a layer streams every expert, computes with top-k."""
    p, m = pl.point, pl.point.model
    ov = link_overlap(p, pl.hardware, pl.time)
    return [
        f"  mixture of experts: each layer streams all {m.moe.experts} experts ({_si(m.layer_params())} params, "
        f"{fmt_bytes(m.layer_params() * p.c)}) and computes with {_si(m.active_layer_params())} per token; per step "
        f"{fmt_bytes(ov.streamed_bytes)} host->device take {fmt_seconds(ov.link_s)} against {fmt_seconds(ov.compute_s)} of compute",
        f"    the link binds below {ov.crossover_tokens:,.0f} tokens per micro-batch (a dense model streaming the same "
        f"bytes: {ov.dense_crossover_tokens:,.0f}); at {p.tokens:,} tokens "
        + ("the LINK binds" if ov.link_binds else "compute hides the link"),
    ]


def _largest_lines(pl: Plan, biggest_batch: int | None, biggest_context: int | None) -> list[str]:
    """The search results, for this model: the engine's limits (its positions, the mode) count as well as memory."""
    p, out = pl.point, []
    if pl.auto is not None and pl.auto.mode.nvme and pl.auto.fits:
        # the searches are of host memory alone: say so where the NVMe tier is what fits this point
        none = " (in host memory alone; this point fits with the NVMe tier, see fits)"
    else:
        none = ""
    none = none or (" (none: the host side does not fit at any size)" if not _host_fits(pl)
            else " (none: the engine refuses this point, see fits)" if pl.refused and not context_refusal(p) else "")
    if biggest_batch is not None:
        why = (f" (none: the engine refuses context {p.context:,})" if context_refusal(p) and not biggest_batch
               else none if not biggest_batch else "")
        out.append(f"  largest micro-batch that fits at context {p.context}: {biggest_batch}{why}")
    if biggest_context is not None:
        limit = (f" (at most the model's {p.model.max_positions:,} positions)"
                 if p.backend == "megatrain" and biggest_context else "")
        out.append(f"  largest context that fits at micro-batch {p.batch}: {biggest_context:,}"
                   f"{limit}{none if not biggest_context else ''}")
    return out


def _long_context_lines(pl: Plan) -> list[str]:
    """The engine's device plan for the batch (costs/memory.py), term by term: what long context costs."""
    lc = pl.long_context
    if lc is None:
        return []
    tile = f"sequence tiles of {lc.tile:,} tokens" if lc.tile else "untiled"
    where = "in flight (offloaded to host)" if lc.offload else "resident"
    budget = (f"{fmt_bytes(lc.budget)} budget x {lc.headroom:.0%} headroom = {fmt_bytes(lc.headroom * lc.budget)}"
              if lc.budget else "no budget (a CPU device)")
    phase = "layer" if lc.layer_working_bytes >= lc.loss_workspace_bytes else "loss"
    rows = [(f"one layer's working set ({tile})", lc.layer_working_bytes),
            (f"chunked-loss workspace ({lc.loss_chunk:,}-token chunks)", lc.loss_workspace_bytes),
            (f"boundary activations, {lc.kept_boundaries} {where}", lc.boundary_bytes),
            ("resident weights (layer buffers + embedding/head/norm)", lc.resident_weight_bytes),
            (f"predicted device peak (layer or loss, the larger: {phase})", lc.peak_bytes),
            ("host: offloaded activations", pl.memory.host.get("offloaded activations", 0))]
    return ([f"  long-context device plan (the engine's LongContextPolicy, {pl.point.tokens:,} tokens):"]
            + [f"    {label:<60}{fmt_bytes(v):>12}" for label, v in rows]
            + [f"    planned against {budget}"])


def _host_fits(pl: Plan) -> bool:
    """Whether the model-state side of the host fits (it does not change with batch or context)."""
    if pl.memory.unified:
        return pl.fits or pl.memory.host_total <= pl.hardware.host_bytes
    return pl.memory.host_total - pl.memory.host.get("offloaded activations", 0) <= pl.hardware.host_bytes


def node_residency_lines(mp: Any) -> list[str]:
    """A node-path rank's placement (planner/multi.py node_residency): the graph layers kept whole, the other kept
    layers sharded, and what one GPU moves per step."""
    pl = mp.rank
    lc, t = pl.long_context, pl.time
    if lc is None or NODE_SHARDS not in pl.memory.device:
        return []
    r = lc.residency
    how = ("set" if pl.point.engine.residency_set is not None
           else "the planner's search, as the engine's \"auto\" fills it" if not pl.placement or not pl.placement.differs
           else f"the planner's search; the engine's \"auto\" fill keeps {pl.placement.engine.to_dict()} (the config "
                "section writes the counts)")
    room = "no limit" if lc.residency_room is None else fmt_bytes(lc.residency_room)
    return [f"{node_residency_line(r, lc.n_layers, mp.gpus_per_node, t.h2d_bytes)}",
            f"    [{how}; room beside the working set: {room}]; kept shards {fmt_bytes(pl.memory.device[NODE_SHARDS])}, "
            f"kept whole {fmt_bytes(r.activations * lc.layer_bytes)}, kept graphs {fmt_bytes(lc.kept_graph_bytes)}; "
            f"per step: h2d {t.h2d_bytes:,} B, NVLink busy {fmt_seconds(t.busy_s.get('NVLink', 0.0))}, "
            f"{t.recomputed_layers} layers recomputed"]


def format_multi(mp: Any, biggest_batch: int | None = None, biggest_context: int | None = None,
                 node_hw: Any = None) -> str:
    """One rank's plan (the node's host memory, its GPU's device memory and step) and the job's figures."""
    n, M, c = mp.gpus_per_node, mp.nodes, mp.comm
    hw, rhw = node_hw or mp.single.hardware, mp.rank.hardware
    per_rank = sum(mp.per_rank.values())
    top = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(mp.per_rank.items(), key=lambda kv: -kv[1])[:4])
    out = [format_plan(mp.rank, biggest_batch, biggest_context),
           f"  data parallel: {n} GPU(s) per node x {M} node(s) = {mp.world_size} ranks, "
           + (f"one host store shared by the {mp.store_nodes} nodes" if mp.store_nodes > 1 else "one host store per node")
           + f"; data path {mp.path}: {mp.path_why}",
           f"    host per node {fmt_bytes(mp.host_node_bytes)} = held once {fmt_bytes(sum(mp.layer_state.values()))} "
           f"(layer state + reserve) + {n} x per rank {fmt_bytes(per_rank)} ({top})",
           f"    each GPU's share of the host: link {rhw.link_gbs_achieved:.3g} GB/s (profile {hw.link_gbs_achieved:g}, "
           f"{hw.gpus_per_host_link} GPU(s) per host link), host DRAM {rhw.host_memory_bw_gbs_achieved:.3g} GB/s "
           f"(of {hw.host_memory_bw_gbs_achieved:g})",
           f"    gradient reduction per step: resident parameters across the node through host memory "
           f"{fmt_seconds(c.intra_globals_s)}"
           + (f"; across nodes a ring all-reduce of {fmt_bytes(c.network_bytes)} per node at {hw.network_gbs:g} GB/s: "
              f"layers {fmt_seconds(c.network_layers_s)}, of it not hidden under backward {fmt_seconds(c.network_exposed_s)}, "
              f"resident parameters {fmt_seconds(c.network_globals_s)}" if M > 1 else ""),
           f"    step per rank {fmt_seconds(mp.step_s)} (one GPU alone {fmt_seconds(mp.single_step_s)}): job "
           f"{mp.job_tokens_per_s:,.0f} tokens/s = {mp.world_size} x "
           f"{mp.single.point.tokens_per_step / mp.single_step_s:,.0f} x scaling efficiency {mp.scaling_efficiency:.1%}",
           *node_residency_lines(mp),
           "    (predicted; see megatrain/planner/multi.py and node_path.py for the model)"]
    return "\n".join(out)

