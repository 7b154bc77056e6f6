"""`megatrain plan`'s first screen: at most FIRST_SCREEN_LINES lines, the rest behind `--details`.

What it says, in order: the point; fits (the chosen host mode's verdict, the one every other "fits" agrees with);
the host mode and the host bytes per parameter (the speculative step's rollback copy apart); host and device
bytes; the data path (several GPUs); the step and tokens/s of the chosen mode, NVMe spill included, and none
where the point does not fit; the scaling efficiency (several GPUs); the bottleneck; the comparison backend; what
to change. Every figure comes from the plan objects; nothing here is computed twice.
"""

from __future__ import annotations

import json
from typing import Any

from .host_rates import host_bound_below_tokens
from .memory import fmt_bytes
from .node_path import NODE
from .prediction import Plan

FIRST_SCREEN_LINES = 25
# The README's host bytes per parameter of the default modes; above it the plan says what the excess is.
README_B_PER_PARAM = (16.0, 18.0)
SPECULATIVE_KEY = "speculative rollback copy"


def _si(x: float) -> str:
    for p, d in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= d:
            return f"{x / d:.3g}{p}"
    return f"{x:.3g}"


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def nvme_added_s(pl: Plan) -> float:
    """What the NVMe tier adds to the step of the mode "auto" chose (0 when it does not spill)."""
    return pl._nvme_added_s


def fits(pl: Plan) -> bool:
    """The plan's verdict: host mode "auto"'s choice (NVMe tier included) where it chose, else memory and engine."""
    return pl._fits_as_chosen


def headline_step_s(pl: Plan) -> float:
    return pl.time.step_s + nvme_added_s(pl)


def host_after_spill(pl: Plan) -> int:
    return int(pl.auto.nvme.get("host", pl.memory.host_total)) if nvme_added_s(pl) or (
        pl.auto is not None and pl.auto.mode.nvme) else pl.memory.host_total


def b_per_param(pl: Plan) -> tuple[float, float]:
    """(host bytes per parameter of the model's state, of which the speculative step's rollback copy)."""
    P = pl.point.model.param_count()
    spec = pl.memory.host.get(SPECULATIVE_KEY, 0)
    state = ("master weights", "gradients", "adam m", "adam v", "bf16 shadow (streams)", SPECULATIVE_KEY)
    return sum(pl.memory.host.get(k, 0) for k in state) / P, spec / P


def _idle(pl: Plan) -> str:
    idle = {k: v for k, v in pl.time.idle_s.items() if v > 0 and k != "other"}
    if not idle or pl.time.step_s <= 0:
        return ""
    frac = 1 - pl.time.busy_s.get("compute", 0.0) / pl.time.step_s
    cause = max(idle, key=lambda k: idle[k])
    return f"; GPU idle {max(0.0, frac):.0%} (most: {cause}, {fmt_seconds(idle[cause])})"


def _advice(pl: Plan, nodes_hint: str | None, multi: Any = None) -> list[str]:
    """What to change, most useful first (at most three)."""
    p, t, out = pl.point, pl.time, []
    if not fits(pl):
        host_over = any(r.startswith("host") and "DOES NOT FIT" in r for r in pl.reasons)
        if nodes_hint:
            out.append(nodes_hint)
        if host_over and pl.hardware.nvme_gbs is None:
            out.append("an NVMe tier (--nvme-gbs, --nvme-gib) spills optimizer state to disk")
        if any(r.startswith("device") and "DOES NOT FIT" in r for r in pl.reasons):
            out.append("a smaller --batch or --context (the device side is over; see --details)")
        return out[:3]
    added = nvme_added_s(pl)
    if added:
        out.append(f"NVMe adds {fmt_seconds(added)} per step: " + (nodes_hint or "more host memory holds the state without it"))
    spec_total, spec = b_per_param(pl)
    if spec and spec_total > README_B_PER_PARAM[1]:
        out.append(f"the speculative step's rollback copy is {spec:.1f} B/param (host state {spec_total:.1f} B/param, "
                   f"above the README's {README_B_PER_PARAM[0]:g}-{README_B_PER_PARAM[1]:g}); speculative_step: false "
                   f"holds {spec_total - spec:.1f}")
    if multi is not None and multi.path != NODE and multi.gpus_per_node > 1 and multi.path != "zero3":
        out.append("GPUs joined by NVLink take the node path (one trip per layer per node; docs/DISTRIBUTED.md)")
    if t.bottleneck == "optimizer" and p.backend == "megatrain":
        at = host_bound_below_tokens(p, t)
        more = f" (compute outlasts it from ~{at:,.0f} tokens per step)" if at else ""
        out.append(f"the host update is paid once per step: more tokens per step (--batch, --grad-accum) amortize "
                   f"it{more}")
    elif t.bottleneck == "link" and pl.crossover_tokens:
        out.append(f"the link binds below {pl.crossover_tokens:,.0f} tokens per micro-batch: raise --batch or "
                   "--context")
    return out[:3]


def _head(pl: Plan, where: str) -> list[str]:
    p, m = pl.point, pl.point.model
    act = f", {_si(m.active_param_count())} active" if m.is_moe else ""
    return [f"{p.backend} plan: {m.name} ({_si(m.param_count())} params{act}, {m.num_layers} layers) on {where}",
            f"  point: context {p.context:,}, micro-batch {p.batch}, accumulation {p.grad_accum} "
            f"({p.tokens_per_step:,} tokens per step per GPU), compute {p.dtype}"]


def _fit_lines(pl: Plan, host_scope: str, host_cap: int) -> list[str]:
    verdict = pl.auto.verdict if pl.auto is not None else ("yes" if pl.feasible else "NO")
    out = [f"  fits: {verdict}"]
    if not fits(pl):
        why = [r for r in pl.reasons + pl.refused if "DOES NOT FIT" in r or r in pl.refused]
        if pl.auto is not None and pl.auto.nvme.get("why"):
            why.append(f"NVMe tier: {pl.auto.nvme['why']}")
        out += [f"    {w[:220]}" for w in why[:2]]
    if pl.point.backend == "megatrain":
        total, spec = b_per_param(pl)
        mode = pl.auto.mode.label if pl.auto is not None else "as set"
        how = "host mode \"auto\" chose it" if pl.auto is not None else "set by --master / --host-grad-dtype"
        share = " (this node's share)" if "share one store" in host_scope else ""
        out.append(f"  host mode: {mode} ({how}); model state {total:.1f} B/param{share}"
                   + (f", of it the speculative rollback copy {spec:.1f}" if spec else ""))
    host = host_after_spill(pl)
    spill = f" after spilling {pl.auto.nvme.get('spilled', 0)} layers to NVMe" if nvme_added_s(pl) else ""
    scope = f" {host_scope}" if host_scope else ""
    out.append(f"  memory: host {fmt_bytes(host)} of {fmt_bytes(host_cap)}{scope}{spill}; device "
               f"{fmt_bytes(pl.memory.device_total)} of {fmt_bytes(pl.hardware.device_bytes)} per GPU")
    return out


def _step_line(pl: Plan, step: float, per_gpu_tokens: int, job: str = "") -> str:
    if not fits(pl):
        return "  step: none (the point does not fit, so no throughput is predicted; --details has the figures)"
    nv = nvme_added_s(pl)
    nvs = f", NVMe included ({fmt_seconds(nv)})" if nv else ""
    mfu = pl.model_tflops * pl.time.step_s / step / (pl.hardware.peak_flops(pl.point.dtype) / 1e12)
    return (f"  step {fmt_seconds(step)}{nvs}: {per_gpu_tokens / step:,.0f} tokens/s per GPU{job}, MFU {mfu:.1%}")


def _compare_line(ours_tps: float, ours_fits: bool, other: Any, label: str) -> str:
    if other is None:
        return ""
    o_fits = fits(other) if isinstance(other, Plan) else other.fits
    o_step = other.time.step_s if isinstance(other, Plan) else other.step_s
    o_tps = other.tokens_per_s if isinstance(other, Plan) else other.job_tokens_per_s
    if not o_fits:
        return f"  {label}: does not fit (no throughput)"
    ratio = f"; megatrain/{label.split()[0]} = {ours_tps / o_tps:.2f}x" if ours_fits else ""
    return f"  {label}: step {fmt_seconds(o_step)}, {o_tps:,.0f} tokens/s, fits{ratio}"


def first_screen(pl: Plan, others: list[Plan] | None = None, nodes_hint: str | None = None) -> list[str]:
    """One GPU: the first screen of `megatrain plan`."""
    hw = pl.hardware
    out = _head(pl, f"{hw.name} [{hw.link}, {hw.link_gbs_achieved:g} GB/s per direction]")
    out += _fit_lines(pl, "", hw.host_bytes)
    step = headline_step_s(pl)
    out.append(_step_line(pl, step, pl.point.tokens_per_step))
    if fits(pl):
        out.append(f"  bottleneck: {pl.time.bottleneck}{_idle(pl)}")
    for o in others or []:
        line = _compare_line(pl.point.tokens_per_step / step, fits(pl), o, f"{o.point.backend} at the same point")
        if line:
            out.append(line)
    return _finish(out, pl, _advice(pl, nodes_hint))


def first_screen_multi(mp: Any, zero3: Any = None, nodes_hint: str | None = None) -> list[str]:
    """G GPUs per node x N nodes: the first screen (the node's host, one GPU's device, the job's throughput)."""
    pl, hw = mp.rank, mp.rank.hardware
    if mp.auto is not None:
        pl.auto = mp.auto
    base = hw.name.split(",")[0]
    out = _head(pl, f"{base} x {mp.gpus_per_node} GPU(s) per node x {mp.nodes} node(s) = {mp.world_size} GPUs")
    scope = "per node" + (f" (1/{mp.store_nodes} of the layers' state: {mp.store_nodes} nodes share one store)"
                          if mp.store_nodes > 1 else "")
    out += _fit_lines(pl, scope, hw.host_bytes)
    state = "what the engine's 'auto' runs on GPUs with peer access (tested on gloo ranks; no GPU has run it)" if mp.path == NODE else "what the engine runs"
    out.append(f"  data path: {mp.path}: {mp.path_why} [{state}]")
    if mp.path == NODE and pl.long_context is not None:
        out.append(node_residency_line(pl.long_context.residency, mp.rank.point.model.num_layers, mp.gpus_per_node,
                                       pl.time.h2d_bytes))
    step = mp.step_s
    out.append(_step_line(pl, step, mp.rank.point.tokens_per_step, f", job {mp.job_tokens_per_s:,.0f} tokens/s"))
    if mp.fits:
        alone = mp.single_step_s
        out.append(f"  scaling: efficiency {mp.scaling_efficiency:.1%} = job / ({mp.world_size} x one GPU alone, "
                   f"{mp.single.point.tokens_per_step / alone:,.0f} tokens/s at {fmt_seconds(alone)} per step)")
        out.append(f"  bottleneck: {pl.time.bottleneck}{_idle(pl)}")
    if zero3 is not None:
        out.append(_compare_line(mp.job_tokens_per_s, mp.fits, zero3, "zero3 at the same point and GPUs"))
    return _finish(out, pl, _advice(pl, nodes_hint, mp))


def node_residency_line(r: Any, n_layers: int, gpus: int, h2d_bytes: int) -> str:
    """The node path's placement (planner/node_path.py: the graph layers kept whole, the other kept layers sharded)
    and what crosses one GPU's host link per step."""
    link = f"host->device {fmt_bytes(h2d_bytes)} per GPU per step"
    if not r.weights:
        return f"  residency (node): all {n_layers} layers streamed; {link}"
    whole = f", {r.activations} kept whole with their graphs (not recomputed)" if r.activations else ""
    return (f"  residency (node): {r.weights - r.activations} of {n_layers} layers kept sharded (1/{gpus} per GPU)"
            f"{whole}; {link}")


def _finish(out: list[str], pl: Plan, advice: list[str]) -> list[str]:
    if advice:
        out.append("  to change:")
        out += [f"    - {a}" for a in advice]
    if pl.point.backend == "megatrain" and fits(pl):
        section = {**pl.settings, **(pl.auto.settings if pl.auto is not None else {})}
        out.append(f"  \"megatrain\" config section: {json.dumps(section)}")
    out.append("  (predicted; --details: memory by component, time per layer, timeline, modes and NVMe tables)")
    out = [line for line in out if line]
    assert len(out) <= FIRST_SCREEN_LINES, out  # a bug in this module, not the user's input
    return out
