"""`megatrain plan` and `megatrain bench` (and `python -m megatrain.planner`)."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from ..config.schema import auto_or, left_auto
from ..config.settings import planner_knobs
from ..config.validate import unknown_key
from ..costs import residency as kept
from ..planner.estimate import host_mode_placeholders, plan
from ..planner.hardware import load_profiles, profile_from_dict, resolve_hardware
from ..planner.host_rates import host_bound_line
from ..planner.host_work import host_assumptions, host_assumptions_line
from ..planner.memory import fmt_bytes
from ..planner.mode_table import ModeRow, format_mode_table, mode_table
from ..planner.nvme_plan import format_nvme_rows, nvme_rows, with_nvme
from ..planner.point import ENGINE_RESIDENCY, context_refusal, make_point, residency_setting
from ..planner.prediction import Plan
from ..planner.reference import reference_line, torch_reference
from ..planner.search import largest_batch, largest_context
from ..planner.shapes import resolve_model
from ..planner.step_time import crossover_closed_form, link_overlap
from ..planner.step_timeline import format_timeline
from ..planner.summary import first_screen, first_screen_multi, fits, nvme_added_s


def _si(x: float, unit: str = "") -> str:
    for p, d in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= d:
            return f"{x / d:.3g}{p}{unit}"
    return f"{x:.3g}{unit}"


def _sec(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


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
                   f"adds {_sec(f['added_s'])} per step" + (f" ({f['why']})" if f.get("why") else ""))
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
        f"    forward  compute {_sec(lt.fwd_compute)}, h2d {_sec(lt.fwd_h2d)}, d2h {_sec(lt.fwd_d2h)} -> {_sec(lt.fwd)}",
        f"    backward compute {_sec(lt.bwd_compute)} (recompute incl.), h2d {_sec(lt.bwd_h2d)}, "
        f"d2h+accumulate {_sec(lt.bwd_d2h)} -> {_sec(lt.bwd)}",
        f"  per micro-batch: forward {_sec(t.forward_s)}, head+loss {_sec(t.head_s)}, backward {_sec(t.backward_s)}"
        + (f"; per step: last gradients drain {_sec(t.fill_drain_s)}" if p.backend == "megatrain"
           else f", pipeline fill/drain {_sec(t.fill_drain_s)}"),
        f"  per step: embedding/head I/O {_sec(t.embed_io_s)}, optimizer {_sec(t.optimizer_busy_s)}"
        + ((" (in backward)" if p.optimizer_in_backward else " (overlapped)" if t.optimizer_overlap
            else " (after backward)") if p.backend == "megatrain" else " (after backward)"),
        _step_detail(pl),
        f"  link per step: h2d {fmt_bytes(t.h2d_bytes)}, d2h {fmt_bytes(t.d2h_bytes)}; compute waits on copies "
        f"{_sec(t.copy_wait_s)}",
        "  busy per step: " + ", ".join(f"{k} {_sec(v)}" for k, v in t.busy_s.items())
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
        out.append(f"  {o.point.backend} at the same point: step {_sec(o.time.step_s)}, "
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
        return (f"  step (if it fit; it does not: no throughput is predicted) {_sec(t.step_s)}, "
                f"{pl.model_tflops:.1f} model TFLOPS at that step")
    total = t.step_s + added
    nv = f" + NVMe {_sec(added)} = {_sec(total)}" if added else ""
    return (f"  step {_sec(t.step_s)}{nv}: {p.tokens_per_step / total:,.0f} tokens/s, "
            f"{pl.model_tflops * t.step_s / total:.1f} model TFLOPS, MFU {100 * pl.mfu * t.step_s / total:.1f}% of "
            f"{hw.peak_flops(p.dtype) / 1e12:g} TFLOPS peak")


def _residency_lines(pl: Plan) -> list[str]:
    """The placement (costs/residency.py) and what the engine will report per step to compare with it."""
    lc, t = pl.long_context, pl.time
    if lc is None:
        return []
    how = ("set" if not left_auto(pl.point.residency)
           else "the planner's search, as the engine's \"auto\" fills it" if not pl.placement or not pl.placement.differs
           else "the planner's search, which differs from the engine's \"auto\" fill (see the warning)")
    room = "no limit" if lc.residency_room is None else fmt_bytes(lc.residency_room)
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
        f"{fmt_bytes(ov.streamed_bytes)} host->device take {_sec(ov.link_s)} against {_sec(ov.compute_s)} of compute",
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


def _switch(v: str) -> bool:
    v = v.lower()
    if v in ("on", "true", "1", "yes"):
        return True
    if v in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{v!r}: use on, off or auto")


def _auto(v: str) -> bool | str:
    return auto_or(v, _switch)


def _auto_int(v: str) -> int | str:
    return auto_or(v, int)


def _tile(v: str) -> int | str | None:
    return auto_or(v, lambda w: None if w.lower() in ("none", "off", "0") else int(w))


def _residency(v: str) -> str | kept.Residency:
    """--residency: auto, stream, W, W,A or the setting's JSON object."""
    return auto_or(v, _residency_counts)


def _residency_counts(v: str) -> kept.Residency:
    if v.lower() == kept.STREAM:
        return kept.parse(kept.STREAM)
    if v.lstrip().startswith("{"):  # as the config writes it, e.g. {"weights": 24, "activations": 24, "offload": 20}
        try:
            return kept.parse(json.loads(v))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{v!r}: {e}") from None
    try:
        counts = [int(x) for x in v.split(",")]
        if len(counts) > 2:
            raise ValueError
        return kept.Residency(*counts)
    except (TypeError, ValueError) as e:
        why = f" ({e})" if str(e) else ""
        raise argparse.ArgumentTypeError(f"{v!r}{why}: use auto, stream, W (kept weights) or W,A (kept weights, "
                                         "kept activations; A <= W)") from None


def _add_plan_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help="a local model directory (with config.json) or a config.json, or a preset name "
                                    "or alias (e.g. 120b, qwen2.5-14b); required without --sweep")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1, help="micro-batch (sequences)")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--hardware", default="h200-pcie",
                    help="profile name (python -m megatrain.planner --list-hardware); with --sweep a comma list")
    ap.add_argument("--hardware-file", help="extra profiles YAML (e.g. `megatrain bench --out`)")
    ap.add_argument("--backend", default="megatrain", choices=["megatrain", "zero3", "zero3-alst", "torch"])
    ap.add_argument("--compare", default="zero3", help="also plan these backends (comma list; '' for none)")
    ap.add_argument("--num-buffers", type=int, default=2)
    ap.add_argument("--offload-activations", type=_auto, default="auto", help="on, off or auto")
    ap.add_argument("--mlp-tile-tokens", "--tile-tokens", dest="mlp_tile_tokens", type=_tile, default="auto",
                    help="MLP sequence tile (EngineConfig.mlp_tile_tokens): int, none or auto; "
                         "--tile-tokens is a deprecated alias")
    ap.add_argument("--device-budget-gib", type=float,
                    help="device memory the engine's 'auto' plans against (EngineConfig.device_budget_bytes)")
    ap.add_argument("--loss-chunk-tokens", type=_auto_int, default="auto",
                    help="head/loss chunk (EngineConfig.loss_chunk_tokens): int or auto (the engine's policy)")
    ap.add_argument("--master", "--host-master", dest="master", default="auto",
                    choices=["auto", "fp32", "hilo", "bf16"],
                    help="host master weights (EngineConfig.host_master): auto (the default: the fastest exact mode "
                         "that fits, the NVMe tier last when the profile has a disk), fp32 (+bf16 shadow), hilo "
                         "(exact hi/lo split) or bf16 (the paper's code, not exact)")
    ap.add_argument("--host-grad-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="host gradient slabs (EngineConfig.host_grad_dtype; bfloat16: exact at accumulation 1; "
                         "auto: chosen with --master auto, else float32)")
    ap.add_argument("--optimizer-in-backward", action="store_true",
                    help="each layer's AdamW during backward, no layer gradient slab "
                         "(EngineConfig.optimizer_in_backward; no clipping, no accumulation)")
    ap.add_argument("--optimizer-overlap", type=_auto, nargs="?", const=True, default="auto",
                    help="on, off or auto (the default, as the engine: on with a CUDA device): the host AdamW a "
                         "layer at a time behind the next forward (EngineConfig.optimizer_overlap); alone: on")
    ap.add_argument("--residency", type=_residency, default=ENGINE_RESIDENCY,
                    help="layers kept on the device (EngineConfig.residency): auto (the planner's placement within "
                         "the device budget), stream (every layer streamed and recomputed), W[,A]: the first W "
                         "layers' weights kept, the first A of them keeping their activations, or the setting's JSON "
                         "object ({\"weights\": W, \"activations\": A, \"offload\": J, \"optimizer\": K}: the last J "
                         "of the A graphs offloaded to host memory); default: the "
                         f"engine's ({residency_setting(ENGINE_RESIDENCY)})")
    ap.add_argument("--link-gbs", type=float, help="override the link rate (GB/s per direction)")
    ap.add_argument("--host-memory-gib", type=float)
    ap.add_argument("--nvme-gbs", type=float, help="the NVMe tier's disk rate, GB/s each way (default: the profile's)")
    ap.add_argument("--nvme-gib", type=float, help="the NVMe tier's disk capacity, GiB (default: the profile's)")
    ap.add_argument("--device-memory-gib", type=float)
    ap.add_argument("--gpus-per-node", type=int, default=1,
                    help="data parallel: GPUs of one node training together, sharing its host store (at most the "
                         "profile's gpus_per_node)")
    ap.add_argument("--nodes", type=int, default=1, help="data parallel: nodes, each with its own host store")
    ap.add_argument("--network-gbs", type=float, help="override the node's network rate to other nodes (GB/s per "
                                                      "direction, all NICs together)")
    ap.add_argument("--gpus-per-host-link", type=int, help="override how many GPUs share one host link")
    ap.add_argument("--data-path", default="auto", choices=["auto", "node", "per-rank"],
                    help="several GPUs per node: the node path (a layer crosses the host link once per node, "
                         "NVLink all-gather; planned, docs/DISTRIBUTED.md) where the profile has NVLink (auto), or "
                         "today's per-rank path")
    ap.add_argument("--details", action="store_true",
                    help="after the first screen, every table: memory by component, time per layer, the "
                         "timeline, the host modes and the NVMe tier")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--no-search", action="store_true", help="skip the largest batch/context searches")
    ap.add_argument("--sweep", help="a harness sweep spec (experiments/sweeps/*.yaml): predicted rows as CSV; "
                                    "megatrain knobs the spec's `engine` leaves unset come from these flags")
    ap.add_argument("--out", help="CSV to write --sweep rows to (default: stdout)")


def _knobs(args: argparse.Namespace) -> dict[str, Any]:
    budget = getattr(args, "device_budget_gib", None)
    engine = dict(num_buffers=args.num_buffers, offload_activations=args.offload_activations,
                  mlp_tile_tokens=args.mlp_tile_tokens, loss_chunk_tokens=args.loss_chunk_tokens,
                  host_master=args.master, host_grad_dtype=args.host_grad_dtype,
                  optimizer_overlap=args.optimizer_overlap, optimizer_in_backward=args.optimizer_in_backward,
                  device_budget_bytes=int(budget * 2**30) if budget else None)
    return {**planner_knobs(engine), "grad_clip": not args.optimizer_in_backward,
            "residency": getattr(args, "residency", ENGINE_RESIDENCY)}


def _resolve_hw(args: argparse.Namespace, name: str | None = None) -> Any:
    name = name or args.hardware
    if args.hardware_file:
        extra = load_profiles(args.hardware_file)
        if name in extra:
            return extra[name]
    return name


def _resolve_hw_list(args: argparse.Namespace) -> list[Any]:
    return [_resolve_hw(args, h.strip()) for h in args.hardware.split(",") if h.strip()]


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return dict(link_gbs=args.link_gbs, host_memory_gib=args.host_memory_gib,
                device_memory_gib=args.device_memory_gib)


def run_plan(args: argparse.Namespace) -> int:
    """The `plan` command; a bad name or value prints one error line and returns 2."""
    try:
        return _run_plan(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run_plan(args: argparse.Namespace) -> int:
    if getattr(args, "sweep", None):
        rows = run_sweep(args.sweep, _resolve_hw_list(args), knobs=_knobs(args), **_overrides(args))
        prov = _provenance()
        _write_rows([{**r, **prov} for r in rows], args.out)
        return 0
    if not args.model:
        raise ValueError("--model is required (or give --sweep SPEC)")
    if (args.gpus_per_node, args.nodes) != (1, 1):
        return _run_plan_multi(args)
    # the NVMe tier's disk (planner/nvme_plan.py) as the user gives it: host mode "auto" may choose the tier
    hw = with_nvme(resolve_hardware(_resolve_hw(args), args.link_gbs, args.host_memory_gib, args.device_memory_gib),
                   args.nvme_gbs, args.nvme_gib)
    knobs = _knobs(args)
    common = dict(context=args.context, batch=args.batch, grad_accum=args.grad_accum, dtype=args.dtype, hardware=hw)
    model = resolve_model(args.model)  # a model directory is read once, for every plan below
    main = plan(model, backend=args.backend, **common, **knobs)
    others = []
    for b in [x.strip() for x in (args.compare or "").split(",") if x.strip()]:
        if b != args.backend:
            others.append(plan(model, backend=b, **common))
    bb = bc = None
    full = args.details or args.json  # the tables behind the first screen
    modes = (mode_table(main.point, main.hardware, search=not args.no_search)
             if args.backend == "megatrain" and full else None)
    if not args.no_search and full:
        bb, bc = largest_batch(main.point, main.hardware), largest_context(main.point, main.hardware)
    nvhw = with_nvme(main.hardware, args.nvme_gbs, args.nvme_gib)  # the NVMe tier (planner/nvme_plan.py)
    nvrows = nvme_rows(main.point, nvhw, search=not args.no_search) if args.backend == "megatrain" and full else []
    if args.json:
        d = main.to_dict()
        d["nvme"] = [dataclasses.asdict(r) for r in nvrows]
        ref = torch_reference(main)
        d.update(max_batch=bb, max_context=bc, compare=[o.to_row() for o in others],
                 modes=[{**dataclasses.asdict(r), "settings": r.settings} for r in modes or []],
                 torch_reference=None if ref is None else ref.to_row())
        if args.backend == "megatrain":
            d["settings"] = main.settings
            if not main.hardware.unified_memory:
                d["host_assumed"] = host_assumptions(main.point, main.hardware)  # as the text's `host assumed:` line
        print(json.dumps(d, indent=2, default=str))
    else:
        print("\n".join(first_screen(main, others, _nodes_hint(main, hw, args))))
        if args.details:
            print(format_plan(main, bb, bc, others, modes))
    if nvrows and not args.json and args.details:
        print("\n".join(format_nvme_rows(nvrows, nvhw)))
    return 0


def _nodes_hint(pl: Plan, hw: Any, args: argparse.Namespace, gpus_per_node: int = 1) -> str | None:
    """Where the point does not fit one node's host memory (or fits only by spilling to NVMe): the fewest nodes
    that hold it sharing one store, with their step and the network's part (planner/multi.py)."""
    from ..planner.multi import node_hardware, smallest_store_nodes

    if pl.point.backend != "megatrain" or (fits(pl) and not nvme_added_s(pl)):
        return None
    node_hw = node_hardware(hw, args.network_gbs, args.gpus_per_host_link)
    if not node_hw.network_gbs:
        return None
    mp = smallest_store_nodes(pl.point, node_hw, gpus_per_node, data_path=args.data_path)
    if mp is None:
        return "no number of nodes up to 64 holds it in host memory (see --details)"
    return (f"--nodes {mp.nodes}{f' --gpus-per-node {gpus_per_node}' if gpus_per_node > 1 else ''}: the fewest "
            f"nodes that hold it in host memory, sharing one store ({mp.auto.mode.label}); step {_sec(mp.step_s)}, "
            f"of which the network carries {_sec(mp.comm.network_layers_s)} (overlapped in the pipeline)")


def _run_plan_multi(args: argparse.Namespace) -> int:
    """`plan --gpus-per-node N --nodes M`: the node's host memory, one GPU's device memory and the job's speed."""
    from ..planner.multi import node_hardware, plan_auto_multi, plan_point_multi
    from ..planner.search import max_batch_multi, max_context_multi

    if getattr(args, "sweep", None):
        raise ValueError("--gpus-per-node/--nodes plan one point; drop them with --sweep")
    hw = node_hardware(resolve_hardware(_resolve_hw(args), args.link_gbs, args.host_memory_gib, args.device_memory_gib),
                       args.network_gbs, args.gpus_per_host_link)
    hw = with_nvme(hw, args.nvme_gbs, args.nvme_gib)
    knobs = _knobs(args)
    auto_master, grad = host_mode_placeholders(knobs)  # host mode "auto" is chosen for the node (plan_auto_multi)
    model = resolve_model(args.model)
    G, N = args.gpus_per_node, args.nodes

    def one(backend: str, kn: dict[str, Any]) -> Any:
        p = make_point(model, args.context, args.batch, args.grad_accum, args.dtype, backend, **kn)
        if backend == "megatrain" and auto_master:
            return plan_auto_multi(p, hw, G, N, grad, args.data_path)
        return plan_point_multi(p, hw, G, N, data_path=args.data_path)

    mp = one(args.backend, knobs if args.backend == "megatrain" else {})
    zero3 = None
    wanted = [x.strip() for x in (args.compare or "").split(",") if x.strip()]
    if args.backend == "megatrain" and "zero3" in wanted:
        zero3 = one("zero3", {})
    bb = bc = None
    if not args.no_search and args.details:
        bb = max_batch_multi(mp.rank.point, hw, G, N)
        bc = max_context_multi(mp.rank.point, hw, G, N)
    if mp.auto is not None:
        mp.rank.auto = mp.auto  # every "fits" of the details is the chosen mode's
    if args.json:
        d = mp.rank.to_dict()  # its "fits": memory and the engine together
        d.update(max_batch=bb, max_context=bc, data_parallel=mp.summary(),
                 compare=[zero3.summary()] if zero3 is not None else [])
        if mp.auto is not None:
            d["auto"] = mp.auto.to_dict()
        print(json.dumps(d, indent=2, default=str))
        return 0
    hint = _nodes_hint(mp.rank, hw, args, G) if mp.nodes == 1 else None
    print("\n".join(first_screen_multi(mp, zero3, hint)))
    if args.details:
        print(format_multi(mp, bb, bc, hw))
    return 0


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
           f"{_sec(c.intra_globals_s)}"
           + (f"; across nodes a ring all-reduce of {fmt_bytes(c.network_bytes)} per node at {hw.network_gbs:g} GB/s: "
              f"layers {_sec(c.network_layers_s)}, of it not hidden under backward {_sec(c.network_exposed_s)}, "
              f"resident parameters {_sec(c.network_globals_s)}" if M > 1 else ""),
           f"    step per rank {_sec(mp.step_s)} (one GPU alone {_sec(mp.single_step_s)}): job "
           f"{mp.job_tokens_per_s:,.0f} tokens/s = {mp.world_size} x "
           f"{mp.single.point.tokens_per_step / mp.single_step_s:,.0f} x scaling efficiency {mp.scaling_efficiency:.1%}",
           "    (predicted; see megatrain/planner/multi.py and node_path.py for the model)"]
    return "\n".join(out)


# Keys of the harness's sweep specs (experiments/sweeps/*.yaml) the planner uses; the rest (warmup,
# steps, timeout_s, threads, seed, lr) do not change a prediction.
_SPEC_TOP = ("name", "description", "defaults", "grid", "grids", "points")


def sweep_points(spec: str | Path) -> list[dict[str, Any]]:
    """The points of a sweep spec in the harness's format (defaults + grid/grids + points; a list
    is an axis, `engine` may be a list of mappings), as plain dicts. Read here rather than through
    experiments/, which the planner may not import."""
    with open(spec) as f:
        d = yaml.safe_load(f) or {}
    if not isinstance(d, dict):
        raise ValueError(f"{spec}: a sweep spec must be a mapping with grid, grids or points")
    found = unknown_key(d, _SPEC_TOP)
    if found:
        unknown = set(d) - set(_SPEC_TOP)
        hint = f" (did you mean {found[1]!r}?)" if found[1] else ""
        raise ValueError(f"{spec}: unknown top-level key(s) {sorted(unknown)}{hint}; known: {', '.join(_SPEC_TOP)}")
    defaults = dict(d.get("defaults") or {})
    grids = ([d["grid"]] if d.get("grid") else []) + list(d.get("grids") or [])
    points = []
    for grid in grids:
        keys = list(grid)
        axes = [v if isinstance(v, list) else [v] for v in grid.values()]
        for combo in itertools.product(*axes):
            points.append({**defaults, **dict(zip(keys, combo))})
    points += [{**defaults, **pt} for pt in (d.get("points") or [])]
    if not points:
        raise ValueError(f"{spec}: the spec defines no points")
    return points


def _spec_to_plan_kwargs(pt: dict[str, Any], knobs: dict[str, Any]) -> dict[str, Any]:
    model = resolve_model(pt["model"])
    if pt.get("max_positions"):
        model = model.with_(max_positions=int(pt["max_positions"]))
    kw: dict[str, Any] = dict(model=model, context=int(pt["seq_len"]), batch=int(pt.get("micro_batch", 1)),
                              grad_accum=int(pt.get("grad_accum", 1)), backend=pt["backend"],
                              dtype="bfloat16" if pt.get("precision", "fp32") == "bf16" else "float32",
                              grad_clip=float(pt.get("grad_clip", 1.0)) > 0)
    if pt["backend"] == "megatrain":
        eng = dict(pt.get("engine") or {})
        kw.update({k: v for k, v in knobs.items() if k not in eng})
        if "residency" in eng:  # the planner's own knob (costs/residency.py), validated by make_point
            kw["residency"] = eng.pop("residency")
        kw.update(planner_knobs(eng))
    else:
        kw["gradient_checkpointing"] = bool(pt.get("recompute", True))
    return kw


def run_sweep(spec: str | Path, hardware: str | list[str] = "h200-pcie",
              knobs: dict[str, Any] | None = None, **overrides: Any) -> list[dict[str, Any]]:
    """Predicted rows (source=predicted) for every point of a harness sweep spec on each hardware.

    knobs: megatrain planner knobs for settings the spec's `engine` mapping leaves unset (e.g.
    offload_activations='auto'); overrides: link_gbs / host_memory_gib / device_memory_gib.
    A point that cannot be planned becomes a row with status=failed and the reason; the sweep goes on.
    """
    hws = [h.strip() for h in hardware.split(",")] if isinstance(hardware, str) else list(hardware)
    name = Path(spec).stem
    rows = []
    for pt in sweep_points(spec):
        for hw in hws:
            try:
                kw = _spec_to_plan_kwargs(pt, knobs or {})
                for k, v in overrides.items():
                    if v is not None:
                        kw.setdefault(k, v)
                row = plan(hardware=hw, **kw).to_row()
            except (ValueError, TypeError, KeyError) as e:
                row = {"source": "predicted", "hardware": hw, "status": "failed", "reason": str(e),
                       "backend": pt.get("backend"), "model": pt.get("model"), "seq_len": pt.get("seq_len")}
            rows.append({"sweep": name, **row})
    return rows


def _provenance() -> dict[str, Any]:
    """Which code made the predictions (the planner follows costs/memory.py, so the commit matters)."""
    from ..metrics.provenance import git_commit, package_versions, utc_now

    commit, dirty = git_commit()
    return {"git_commit": commit, "git_dirty": dirty, "versions": package_versions(), "timestamp": utc_now()}


def _write_rows(rows: list[dict[str, Any]], out: str | None) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    f = open(out, "w", newline="") if out else sys.stdout
    try:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    finally:
        if out:
            f.close()


def run_bench(args: argparse.Namespace) -> int:
    from ..metrics.bench import bench

    prof = bench(quick=args.quick, min_time=args.min_time, threads=args.threads)
    raw = prof.pop("raw")
    if raw.get("warning"):
        print(f"warning: {raw['warning']}", file=sys.stderr)
    name = prof.pop("name")
    profile_from_dict(name, prof)  # validate before writing
    text = yaml.safe_dump({"profiles": {args.name or name: prof}}, sort_keys=False, width=200)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        print(json.dumps({"profile": prof, "raw": raw}, indent=2))
    else:
        print(text)
        print("# raw: " + json.dumps(raw))
    return 0


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `plan` on a subparsers object; sets args.func = run_plan (returns an exit code)."""
    ap = subparsers.add_parser("plan", help="predict memory, step time and fit for a training point",
                               description="Predict host/device memory per component, step time, throughput "
                                           "and fit (megatrain vs ZeRO-3 offload) from shapes and a hardware profile.")
    _add_plan_args(ap)
    ap.set_defaults(func=run_plan)
    return ap


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` on a subparsers object; sets args.func = run_bench (returns an exit code)."""
    ap = subparsers.add_parser("bench", help="measure this machine into a hardware profile",
                               description="Measure matmul rates, memory bandwidth, the CPU AdamW and the host "
                                           "link (or the emulated link on CPU) and print a hardware profile.")
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds), for tests")
    ap.add_argument("--min-time", type=float, help="seconds of repeats per measurement (best rep is kept)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads for the CPU measurements")
    ap.add_argument("--out", help="write the profile YAML here (load it with plan --hardware-file)")
    ap.add_argument("--name", help="profile name to write (default: cpu or cuda)")
    ap.add_argument("--json", action="store_true")
    ap.set_defaults(func=run_bench)
    return ap


def main(argv: list[str] | None = None) -> int:
    """`python -m megatrain.planner [plan] --model ...` or `python -m megatrain.planner bench`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("--list-hardware", "list-hardware"):
        for name, hw in load_profiles().items():
            print(f"{name:<12} {hw.description}")
        return 0
    parser = argparse.ArgumentParser(prog="python -m megatrain.planner")
    sub = parser.add_subparsers(dest="command")
    add_plan_parser(sub)
    add_bench_parser(sub)
    if not argv or argv[0] not in ("plan", "bench", "-h", "--help"):
        argv = ["plan", *argv]
    args = parser.parse_args(argv)
    return int(args.func(args))
