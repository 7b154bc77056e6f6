"""Validate the planner's step-time and host-memory prediction against the engine on this machine.

    python -m experiments.studies.validation [--model small-7m] [--context 128] [--steps 3]
                                           [--gbps 0.005,0.01,0.02,0.05,0.2,none] [--out results/validation]
    python -m experiments.studies.validation --host-models small-7m,llama-100m,llama-0.6b [--host-context 256]
    python -m experiments.studies.validation --backends megatrain,zero3,torch [--backend-contexts 128,384,1024]

The engine streams every layer (`residency: "stream"`, the path whose step model this validates) on the CPU
with its copy engine rate-limited (`EngineConfig(link_gbps=...)`) to a range of emulated links, from
link-bound to compute-bound; each point's median step time is set
against `megatrain.planner.plan` for a "cpu" profile measured in the same run by the planner's own
`bench_cpu` (GEMM, copy and AdamW rates, mid-run between the passes; the profile in hardware.yaml was
measured under a different load, and a shared box drifts), whose fp32 compute rate and fixed costs are
then fitted to the engine itself (`bench.with_engine_overhead`): real unthrottled Engine steps of the
same model at 1/2, 3/4, 3/2 and 2 times the validated context (never the validated point), run in fresh
processes right after the compute-bound point of every pass and pooled, each layer's forward and
backward period and the time outside the layers split by least squares into one rate and fixed seconds
per layer per phase and per micro-batch. Beside it, for comparison: the prediction with the rate of one
layer timed alone (`bench.layer_seconds`, no fixed costs), with the isolated-GEMM rate, and with the
device compute rate rescaled so the unthrottled point matches (a diagnostic of how much error is rate
and how much structure; not the prediction).

Each point runs in a fresh process, so its peak RSS is its own (VmHWM, the high-water mark of the
process image; not ru_maxrss, which a child inherits from its parent across exec). The baseline is that process's RSS once the runtime is warm
(`bench.warm_runtime`: one engine training step of a one-layer toy of the same family, so the modeling
code, the kernel libraries' first-use workspaces and the engine's copy threads are in it, as in every
run); the planner's host "runtime" term is set to it (`megatrain bench` measures it the same way), and
its prediction of the rest (what the engine allocates for this model) is checked against the measured
RSS growth. `--host-models` does that across model sizes, under glibc's default allocator and with its
mmap threshold fixed (EngineConfig.host_mmap_threshold_bytes), where RSS falls back to the live bytes.

The crossover: on both the measured and the predicted curve, the link rate at which the time compute
waits on copies (the engine's copy_wait_s; the planner's simulated wait) falls below 10% of the step.
Rows go to OUT/validation.csv with provenance; nothing here fits the link model to the measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

GIB = 1024**3
DEFAULT_GBPS = "0.005,0.01,0.02,0.05,0.1,0.2,0.5,none"
BEND_WAIT_SHARE = 0.10  # the link is "the bottleneck" while compute waits on copies for more of the step


def parse_gbps(text: str) -> list[float | None]:
    out: list[float | None] = []
    for tok in text.split(","):
        tok = tok.strip().lower()
        out.append(None if tok in ("none", "inf", "") else float(tok))
    return out


def build_model(preset: Any, seed: int = 0):
    from experiments.point import build_preset_model

    return build_preset_model(preset, seed)


def measure_point(preset: Any, context: int, gbps: float | None, warmup: int, steps: int,
                  seed: int = 0, mmap_threshold: int | None = None) -> dict[str, Any]:
    """Median step time and host memory of the engine at one emulated link rate (in this process:
    call it in a fresh one, see `measure_in_child`, for a peak RSS of its own)."""
    import gc

    import torch

    from megatrain.config.schema import EngineConfig
    from megatrain.engine import Engine
    from megatrain.metrics.bench import warm_runtime
    from megatrain.metrics.samplers import RssSampler

    warm_runtime(preset)
    rss = RssSampler().start()
    base_rss = rss.rss()
    cfg = EngineConfig(device="cpu", link_gbps=gbps, residency="stream",
                       host_mmap_threshold_bytes=mmap_threshold)
    eng = Engine(build_model(preset, seed), config=cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, preset.vocab, (1, context), generator=gen)
    times: list[float] = []
    stats: list[dict[str, float]] = []
    for i in range(warmup + steps):
        eng.reset_stats()
        t0 = time.perf_counter()
        out = eng(input_ids=x, labels=x)
        eng.backward(out.loss)
        eng.clip_grad_norm_(1.0)  # the planner charges clipping by default (grad_clip=True)
        eng.step()
        eng.zero_grad()
        st = eng.collect_stats()  # waits for outstanding copies, so they count in the step
        t1 = time.perf_counter()
        if i >= warmup:
            times.append(t1 - t0)
            stats.append(st)
    peak = rss.stop()
    del eng
    gc.collect()

    def med(key: str) -> float:
        return statistics.median(float(s.get(key, 0.0)) for s in stats)

    return {"step_times": times, "measured_step_s": statistics.median(times),
            "measured_h2d_bytes": med("h2d_bytes"), "measured_d2h_bytes": med("d2h_bytes"),
            "measured_copy_wait_s": med("copy_wait_s"), "measured_forward_s": med("forward_s"),
            "measured_backward_s": med("backward_s"), "measured_optimizer_s": med("optimizer_s"),
            "measured_device_weight_bytes": med("device_weight_bytes"),
            "engine_predicted_peak_device_bytes": med("predicted_peak_device_bytes"),
            "peak_rss_bytes": peak, "base_rss_bytes": base_rss,
            "loadavg": os.getloadavg()[0]}  # a shared box: other work on the cores stretches compute


def measure_in_child(preset: Any, context: int, gbps: float | None, warmup: int, steps: int,
                     threads: int | None = None, mmap_threshold: int | None = None) -> dict[str, Any]:
    """measure_point in a fresh python process (torch limited to `threads`; the allocator setting is
    process-wide); the preset travels as its fields."""
    import dataclasses
    import subprocess

    job = json.dumps({"preset": dataclasses.asdict(preset), "context": context, "gbps": gbps,
                      "warmup": warmup, "steps": steps, "threads": threads, "mmap_threshold": mmap_threshold})
    out = subprocess.run([sys.executable, "-m", "experiments.studies.validation", "--measure-one", job],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"measuring link {gbps} GB/s failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fit_periods_in_child(preset: Any, tokens: tuple[int, ...], threads: int | None = None) -> list[list[float]]:
    """bench.engine_layer_periods at each token count, in a fresh python process like the points."""
    import dataclasses
    import subprocess

    job = json.dumps({"preset": dataclasses.asdict(preset), "tokens": list(tokens), "threads": threads})
    out = subprocess.run([sys.executable, "-m", "experiments.studies.validation", "--fit-one", job],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the engine fit at {tokens} tokens failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fit_one(job: str) -> int:
    import torch

    from megatrain.metrics.bench import engine_layer_periods
    from megatrain.models.presets import ModelPreset

    d = json.loads(job)
    if d.get("threads"):
        torch.set_num_threads(d["threads"])
    preset = ModelPreset(**d["preset"])
    print(json.dumps([list(engine_layer_periods(preset, T)) for T in d["tokens"]]))
    return 0


def _measure_one(job: str) -> int:
    from megatrain.models.presets import ModelPreset

    d = json.loads(job)
    if d.get("threads"):
        import torch

        torch.set_num_threads(d["threads"])
    m = measure_point(ModelPreset(**d["preset"]), d["context"], d["gbps"], d["warmup"], d["steps"],
                      mmap_threshold=d.get("mmap_threshold"))
    print(json.dumps(m))
    return 0


def pool_runs(ms: list[dict[str, Any]]) -> dict[str, Any]:
    """One point's repeated runs as one: step times pooled (their median is the point's), the
    per-step engine counters as medians over runs, memory from the first run (same allocations)."""
    out = dict(ms[0])
    out["step_times"] = [t for m in ms for t in m["step_times"]]
    out["measured_step_s"] = statistics.median(out["step_times"])
    for k in ("measured_copy_wait_s", "measured_forward_s", "measured_backward_s", "measured_optimizer_s",
              "loadavg"):
        out[k] = statistics.median(m[k] for m in ms)
    return out


def bend_gbps(gbps: list[float | None], wait_s: list[float], step_s: list[float]) -> float:
    """The link rate at which the link stops being the bottleneck: where the share of the step that
    compute spends waiting on copies falls through BEND_WAIT_SHARE, interpolated in log(rate) between
    the two finite links around it; nan if it never crosses on the grid."""
    pts = sorted((g, w / s) for g, w, s in zip(gbps, wait_s, step_s) if g is not None)
    for (g0, f0), (g1, f1) in zip(pts, pts[1:]):
        if f0 >= BEND_WAIT_SHARE > f1:
            x = (f0 - BEND_WAIT_SHARE) / (f0 - f1)
            return math.exp(math.log(g0) + x * (math.log(g1) - math.log(g0)))
    return float("nan")


def predict(preset: Any, context: int, gbps: float | None, hw: Any):
    from megatrain.config.schema import EngineConfig
    from megatrain.planner import plan

    return plan(preset, context=context, batch=1, dtype="float32", hardware=hw,
                engine_config=EngineConfig(device="cpu", link_gbps=gbps, residency="stream"))


def layer_profile(preset: Any, context: int, hw: Any, threads: int | None, quick: bool) -> tuple[Any, float]:
    """The bench profile with its sustained fp32 fraction measured end to end on one of this model's
    layers (bench.layer_seconds: forward, recompute, backward, in isolation; no link, no pipeline)
    instead of on isolated GEMMs. Returns (profile, the layer's seconds)."""
    import torch

    from megatrain.metrics.bench import layer_seconds
    from megatrain.planner import make_point, sustained_from_layer_time

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        seconds = layer_seconds(preset, context, "float32", min_time=0.1 if quick else 1.0)
    finally:
        torch.set_num_threads(before)
    frac = sustained_from_layer_time(make_point(preset, context, 1, dtype="float32"), hw, seconds)
    return hw.with_(sustained_fp32=frac), seconds


def overhead_tokens(context: int) -> tuple[int, ...]:
    """Token counts the engine fit runs at: half, three quarters, one and a half and twice the validated
    context, bracketing it evenly in log scale and never the validated point itself. Even on both sides,
    because the engine's rate drifts with size (a small-7m layer at 512 tokens runs at a lower FLOP rate
    than at 128: its activations leave the caches), and a one-sided fit extrapolates that drift."""
    pts = (context // 2, 3 * context // 4, 3 * context // 2, 2 * context)
    return tuple(sorted({max(8, t) for t in pts} - {context}))


def engine_profile(prof: dict[str, Any], preset: Any, context: int,
                   periods: list[list[list[float]]]) -> dict[str, Any]:
    """The bench profile with its fp32 rate and fixed costs fitted (bench.with_engine_overhead) to engine
    periods of this model's layers at other token counts than the validated one: `periods` holds one
    fit_periods_in_child run per pass, pooled here by the median per token count and phase."""
    from megatrain.metrics.bench import with_engine_overhead

    tokens = overhead_tokens(context)
    pooled = [tuple(statistics.median(run[i][k] for run in periods) for k in range(3)) for i in range(len(tokens))]
    return with_engine_overhead(prof, preset=preset, tokens=tokens, periods=pooled)


def calibrate_compute(preset: Any, context: int, hw: Any, measured_s: float) -> tuple[Any, float]:
    """The profile with its device compute rate (GEMM and elementwise alike) scaled by one factor so
    the unthrottled point's predicted step equals the measured one; bisection in log space since the
    step is monotone in that rate. Returns (profile, factor)."""
    lo, hi = 1e-3, 1e3

    def step(f: float) -> float:
        h = hw.with_(sustained_fp32=hw.sustained_fp32 * f, device_memory_bw_gbs=hw.device_memory_bw_gbs * f)
        return predict(preset, context, None, h).time.step_s

    if not (step(hi) <= measured_s <= step(lo)):
        return hw, float("nan")  # the unthrottled step is not compute-limited in the model: leave it
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if step(mid) > measured_s:
            lo = mid
        else:
            hi = mid
    f = math.sqrt(lo * hi)
    return hw.with_(sustained_fp32=hw.sustained_fp32 * f, device_memory_bw_gbs=hw.device_memory_bw_gbs * f), f


def err_pct(pred: float, meas: float) -> float:
    return 100.0 * (pred - meas) / meas


def validate(model: str = "small-7m", context: int = 128, gbps: list[float | None] | None = None,
             warmup: int = 1, steps: int = 3, quick_bench: bool = False, threads: int | None = 1,
             repeats: int = 1, log=print) -> list[dict[str, Any]]:
    """Measure and predict every link rate; rows in the order given. The engine and the bench run with
    `threads` torch threads (None: torch's default): on a shared 2-core box one thread leaves a core to
    the neighbours, and the bench measures the rate the run gets."""
    from megatrain.metrics.bench import bench_cpu
    from megatrain.planner import get_hardware, resolve_model

    preset = resolve_model(model)
    gbps = parse_gbps(DEFAULT_GBPS) if gbps is None else gbps
    runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(gbps))}
    profile: tuple | None = None
    fastest = max(range(len(gbps)), key=lambda i: math.inf if gbps[i] is None else gbps[i])
    fit_runs: list[list[list[float]]] = []
    for r in range(repeats):
        # alternate the order, so a neighbour's load that comes or goes mid-sweep lands on every point
        for i in (range(len(gbps)) if r % 2 == 0 else reversed(range(len(gbps)))):
            m = measure_in_child(preset, context, gbps[i], warmup, steps, threads)
            log(f"  link {gbps[i] if gbps[i] is not None else 'unthrottled'} GB/s: median step "
                f"{m['measured_step_s']:.3f} s ({', '.join(f'{t:.3f}' for t in m['step_times'])})")
            runs[i].append(m)
            if i == fastest:
                # The engine fit, in fresh processes like the points, right after the compute-bound point
                # in every pass: its rate and that point's step share the minute (a shared box drifts by
                # 10-20% from one minute to the next, which a fit taken elsewhere in time would carry).
                fit_runs.append(fit_periods_in_child(preset, overhead_tokens(context), threads))
        if r == (repeats - 1) // 2:
            # GEMM, copy and optimizer rates mid-run, between the passes, next to the compute-bound points.
            prof = bench_cpu(quick=quick_bench, threads=threads, engine_fit=False, bf16=False)  # plans FP32
            hw_gemm = get_hardware(prof)
            profile = (prof, hw_gemm, *layer_profile(preset, context, hw_gemm, threads, quick_bench))
    measured = [(g, pool_runs(runs[i])) for i, g in enumerate(gbps)]
    prof, hw_gemm, hw_layer, layer_s = profile
    fit_prof = engine_profile(prof, preset, context, fit_runs)
    hw = get_hardware(fit_prof)
    fit = fit_prof["raw"].get("engine_fit", {})
    log(f"bench_cpu: fp32 peak {hw.peak_fp32_tflops * 1e3:.1f} GFLOPS x sustained {hw_gemm.sustained_fp32:.2f} "
        f"(GEMMs) / {hw_layer.sustained_fp32:.2f} (a {preset.name} layer alone, {layer_s * 1e3:.1f} ms) / "
        f"{hw.sustained_fp32:.2f} (engine fit at {fit.get('tokens')} tokens: fixed {hw.layer_overhead_fwd_s * 1e3:.2f} "
        f"ms fwd + {hw.layer_overhead_bwd_s * 1e3:.2f} ms bwd per layer, {hw.microbatch_overhead_s * 1e3:.2f} ms "
        f"per micro-batch), link {hw.link_gbs_achieved:.2f} GB/s, optimizer {hw.optimizer_bps / 1e9:.2f} GB/s")
    # Calibrate on the fastest-link point, the one nearest compute-bound.
    ref = next((m for g, m in measured if g is None), max(measured, key=lambda gm: gm[0] or 0)[1])
    hw_cal, factor = calibrate_compute(preset, context, hw, ref["measured_step_s"])
    plans = {g: predict(preset, context, g, hw.with_(host_reserved_gib=m["base_rss_bytes"] / GIB))
             for g, m in measured}
    links = [g for g, _ in measured]
    bend_meas = bend_gbps(links, [m["measured_copy_wait_s"] for _, m in measured],
                          [m["measured_step_s"] for _, m in measured])
    bend_pred = bend_gbps(links, [plans[g].time.copy_wait_s for g in links], [plans[g].time.step_s for g in links])
    log(f"crossover (copy wait < {BEND_WAIT_SHARE:.0%} of the step): measured {bend_meas:.3g} GB/s, "
        f"predicted {bend_pred:.3g} GB/s")
    rows = []
    for g, m in measured:
        pl = plans[g]
        pl_cal = predict(preset, context, g, hw_cal)
        pl_gemm = predict(preset, context, g, hw_gemm)
        pl_layer = predict(preset, context, g, hw_layer)
        pred_host = pl.memory.host_total_incl_device
        runtime = pl.memory.host["runtime"]
        growth = m["peak_rss_bytes"] - m["base_rss_bytes"]
        lc = pl.long_context
        rows.append({
            "model": preset.name, "params": preset.param_count(), "seq_len": context, "micro_batch": 1,
            "precision": "fp32",
            "link_gbps": g if g is not None else float("nan"),
            "link_gbps_used_by_planner": pl.hardware.link_gbs_achieved,
            "measured_step_s": m["measured_step_s"], "measured_loadavg": m["loadavg"],
            "step_times_s": json.dumps([round(t, 5) for t in m["step_times"]]),
            "predicted_step_s": pl.time.step_s,
            "error_pct": err_pct(pl.time.step_s, m["measured_step_s"]),
            "predicted_cal_step_s": pl_cal.time.step_s,
            "error_cal_pct": err_pct(pl_cal.time.step_s, m["measured_step_s"]),
            "compute_scale": factor,
            # the same prediction with the sustained rate of one layer timed alone, no fixed costs
            "predicted_layer_rate_step_s": pl_layer.time.step_s,
            "error_layer_rate_pct": err_pct(pl_layer.time.step_s, m["measured_step_s"]),
            # the same prediction with the sustained rate of isolated GEMMs (bench_cpu alone)
            "predicted_gemm_rate_step_s": pl_gemm.time.step_s,
            "error_gemm_rate_pct": err_pct(pl_gemm.time.step_s, m["measured_step_s"]),
            "measured_layer_s": layer_s, "sustained_fp32_layer": hw_layer.sustained_fp32,
            "sustained_fp32_engine_fit": hw.sustained_fp32,
            "layer_overhead_fwd_s": hw.layer_overhead_fwd_s, "layer_overhead_bwd_s": hw.layer_overhead_bwd_s,
            "microbatch_overhead_s": hw.microbatch_overhead_s,
            "engine_fit_tokens": json.dumps(fit.get("tokens")),
            "engine_fit_fwd_bwd_outside_ms": json.dumps(fit.get("fwd_bwd_outside_ms")),
            "engine_fit_max_rel_residual": fit.get("max_rel_residual", float("nan")),
            "sustained_fp32_gemm": hw_gemm.sustained_fp32,
            # the parts of the prediction, so an error can be traced to a term
            "measured_forward_s": m["measured_forward_s"], "predicted_forward_s": pl.time.forward_s,
            "measured_backward_s": m["measured_backward_s"],
            "predicted_backward_s": pl.time.head_s + pl.time.backward_s,
            "measured_optimizer_s": m["measured_optimizer_s"], "predicted_optimizer_s": pl.time.optimizer_busy_s,
            "predicted_embed_io_s": pl.time.embed_io_s, "predicted_drain_s": pl.time.fill_drain_s,
            "predicted_bottleneck": pl.time.bottleneck,
            "predicted_crossover_tokens": pl.crossover_tokens,
            "measured_crossover_gbps": bend_meas, "predicted_crossover_gbps": bend_pred,
            "crossover_error_pct": err_pct(bend_pred, bend_meas),
            # the planner's closed forms at this point: forward / backward compute hides a layer's load
            "predicted_fwd_crossover_gbps": pl.point.model.layer_params() * pl.point.c / pl.time.layer.fwd_compute / 1e9,
            "predicted_bwd_crossover_gbps": pl.point.model.layer_params() * pl.point.c / pl.time.layer.bwd_compute / 1e9,
            "measured_h2d_bytes": m["measured_h2d_bytes"], "predicted_h2d_bytes": pl.time.h2d_bytes,
            "measured_d2h_bytes": m["measured_d2h_bytes"], "predicted_d2h_bytes": pl.time.d2h_bytes,
            "measured_copy_wait_s": m["measured_copy_wait_s"], "predicted_copy_wait_s": pl.time.copy_wait_s,
            "measured_device_weight_bytes": m["measured_device_weight_bytes"],
            "predicted_device_weight_bytes": pl.device_weight_bytes,
            "engine_predicted_peak_device_bytes": m["engine_predicted_peak_device_bytes"],
            "planner_policy_peak_device_bytes": lc.peak_bytes if lc else float("nan"),
            # each point in its own process: peak RSS is its own high-water mark; the baseline is the
            # runtime (python, torch, transformers, modeling code), which the planner is given
            "measured_peak_rss_bytes": m["peak_rss_bytes"], "base_rss_bytes": m["base_rss_bytes"],
            "measured_rss_growth_bytes": growth,
            "predicted_host_bytes": pred_host, "predicted_host_growth_bytes": pred_host - runtime,
            "host_error_pct": err_pct(pred_host - runtime, growth),
            "host_total_error_pct": err_pct(pred_host, m["peak_rss_bytes"]),
            "bench_fp32_gflops": hw.peak_fp32_tflops * 1e3, "bench_sustained_fp32": hw.sustained_fp32,
            "bench_link_gbps": hw.link_gbs_achieved, "bench_optimizer_gbps": hw.optimizer_bps / 1e9,
            "bench_loadavg": prof["raw"].get("loadavg"), "torch_threads": prof["raw"].get("threads"),
            "hardware": "cpu (measured by megatrain.planner.bench_cpu at run time)",
        })
    return rows


# The allocator settings the host validation runs under: glibc as every run gets it, and with its mmap
# threshold fixed at its initial 128 KiB (EngineConfig.host_mmap_threshold_bytes), where freed transients
# leave the resident set, so RSS is the live bytes the planner models plus what the allocator keeps.
HOST_ALLOCATORS = {"glibc default": None, "mmap threshold 128 KiB": 128 * 1024}


def validate_host(models: list[str], context: int = 256, warmup: int = 1, steps: int = 2,
                  threads: int | None = 1, allocators: dict[str, int | None] | None = None,
                  log=print) -> list[dict[str, Any]]:
    """Peak host memory predicted vs measured across model sizes: each model trains `warmup + steps` steps
    (unthrottled link) in a fresh process per allocator setting; its peak RSS growth over the warm runtime
    is set against the planner's host total (device allocations included: the CPU device's memory is the
    host's) less its runtime term. The runtime term is that process's own measured baseline, so what is
    checked is the planner's model of everything the engine allocates for this model."""
    from megatrain.planner import get_hardware, resolve_model

    rows = []
    for name in models:
        preset = resolve_model(name)
        for alloc, threshold in (HOST_ALLOCATORS if allocators is None else allocators).items():
            m = measure_in_child(preset, context, None, warmup, steps, threads, mmap_threshold=threshold)
            hw = get_hardware("cpu").with_(host_reserved_gib=m["base_rss_bytes"] / GIB)
            pl = predict(preset, context, None, hw)
            runtime = pl.memory.host["runtime"]
            pred = pl.memory.host_total_incl_device - runtime
            growth = m["peak_rss_bytes"] - m["base_rss_bytes"]
            parts = {**{f"host: {k}": v for k, v in pl.memory.host.items() if k != "runtime" and v},
                     **{f"device: {k}": v for k, v in pl.memory.device.items() if k != "runtime" and v}}
            if pl.memory.shared:
                parts["shared (device globals are the host masters)"] = -pl.memory.shared
            rows.append({"model": preset.name, "params": preset.param_count(), "seq_len": context,
                         "micro_batch": 1, "precision": "fp32", "steps": warmup + steps, "allocator": alloc,
                         "measured_peak_rss_bytes": m["peak_rss_bytes"], "base_rss_bytes": m["base_rss_bytes"],
                         "measured_rss_growth_bytes": growth, "predicted_host_growth_bytes": pred,
                         "host_error_pct": err_pct(pred, growth),
                         "host_total_error_pct": err_pct(pred + runtime, m["peak_rss_bytes"]),
                         "measured_growth_bytes_per_param": growth / preset.param_count(),
                         "predicted_growth_bytes_per_param": pred / preset.param_count(),
                         "measured_step_s": m["measured_step_s"],
                         "predicted_components": json.dumps(parts), "measured_loadavg": m["loadavg"],
                         "hardware": "cpu (this machine; the device is the host)"})
            log(f"  {preset.name}, {alloc}: peak RSS growth {growth / 2**20:.1f} MiB measured, "
                f"{pred / 2**20:.1f} MiB predicted ({rows[-1]['host_error_pct']:+.1f}%), "
                f"step {m['measured_step_s']:.2f} s")
    return rows


def validate_backends(model: str = "small-7m", contexts: tuple[int, ...] = (128, 384, 1024),
                      backends: tuple[str, ...] = ("megatrain", "zero3", "torch"), steps: int = 3,
                      threads: int | None = 1, work_dir: Path | None = None, quick_bench: bool = False,
                      log=print) -> list[dict[str, Any]]:
    """Step time predicted vs measured for every backend, the baselines included: each (context, backend)
    point runs through the harness (experiments.point in its own process, through the Accelerate-style
    face, the way a user runs it: ZeRO-3 is the real DeepSpeed), and `plan(..., backend=b)` predicts it
    on a profile measured here at the start (`bench_cpu`, its engine fit at OVERHEAD_TOKENS, which the
    default contexts avoid). What this checks for the baselines is the compute, optimizer and fixed
    costs the planner charges them on this CPU; no link is emulated (ZeRO-3's offload is host to host
    here), so its fetch model is not exercised."""
    import tempfile

    from experiments.execute import run_point_subprocess
    from experiments.spec import Point
    from megatrain.metrics.bench import bench_cpu
    from megatrain.planner import BACKENDS, get_hardware, plan, resolve_model

    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise ValueError(f"backends {unknown or backends!r}: name one or more of {', '.join(BACKENDS)}")
    preset = resolve_model(model)  # an unknown model is refused here, before the minute of benchmarking
    prof = bench_cpu(quick=quick_bench, threads=threads)
    hw = get_hardware(prof)
    log(f"bench_cpu: {hw.peak_fp32_tflops * 1e3:.1f} GFLOPS x sustained {hw.sustained_fp32:.2f}, fixed "
        f"{hw.layer_overhead_fwd_s * 1e3:.2f} / {hw.layer_overhead_bwd_s * 1e3:.2f} ms per layer")
    work = Path(work_dir or tempfile.mkdtemp(prefix="megatrain-backends-"))
    rows: list[dict[str, Any]] = []
    for ctx in contexts:
        for b in backends:
            pt = Point(backend=b, model=preset.name, seq_len=ctx, warmup=1, steps=steps, threads=threads)
            m = run_point_subprocess(pt, work)
            if m.get("status") != "ok":
                raise RuntimeError(f"{pt.label} failed: {m.get('reason')}")
            pl = plan(preset, context=ctx, batch=1, dtype="float32", hardware=hw, backend=b)
            rows.append({"model": preset.name, "params": preset.param_count(), "backend": b, "seq_len": ctx,
                         "micro_batch": 1, "precision": "fp32", "measured_step_s": m["step_time_s"],
                         "step_times_s": json.dumps(m.get("step_times_s")),
                         "predicted_step_s": pl.time.step_s, "error_pct": err_pct(pl.time.step_s, m["step_time_s"]),
                         "measured_forward_s": m.get("forward_s"), "measured_backward_s": m.get("backward_s"),
                         "measured_optimizer_s": m.get("optimizer_s"), "predicted_optimizer_s": pl.time.optimizer_s,
                         "bench_fp32_gflops": hw.peak_fp32_tflops * 1e3, "bench_sustained_fp32": hw.sustained_fp32,
                         "layer_overhead_fwd_s": hw.layer_overhead_fwd_s,
                         "layer_overhead_bwd_s": hw.layer_overhead_bwd_s,
                         "microbatch_overhead_s": hw.microbatch_overhead_s, "torch_threads": threads,
                         "measured_loadavg": os.getloadavg()[0],
                         "hardware": "cpu (measured by megatrain.planner.bench_cpu at run time)"})
            log(f"  {b:9s} {ctx:5d} tokens: measured {m['step_time_s']:.3f} s, predicted {pl.time.step_s:.3f} s "
                f"({rows[-1]['error_pct']:+.1f}%)")
    # The comparison the planner exists for: each backend's step over torch's, measured and predicted.
    by = {(r["seq_len"], r["backend"]): r for r in rows}
    for r in rows:
        ref = by.get((r["seq_len"], "torch"))
        r["measured_vs_torch"] = r["measured_step_s"] / ref["measured_step_s"] if ref else float("nan")
        r["predicted_vs_torch"] = r["predicted_step_s"] / ref["predicted_step_s"] if ref else float("nan")
    return rows


def _write(rows: list[dict[str, Any]], path: Path, cols: list[str]) -> None:
    import pandas as pd

    from megatrain.metrics.provenance import provenance

    prov = provenance()
    prov["versions"] = json.dumps(prov["versions"]) if not isinstance(prov["versions"], str) else prov["versions"]
    df = pd.DataFrame([{**r, **prov} for r in rows])
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(path, index=False)
    print(df[[c for c in cols if c in df.columns]].to_string(index=False))
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small-7m")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--gbps", default=DEFAULT_GBPS, help="comma-separated emulated link rates; 'none' = unthrottled")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="sweeps over the links, in alternating order")
    ap.add_argument("--quick-bench", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the runs and the bench (0: default)")
    ap.add_argument("--out", default="results/validation")
    ap.add_argument("--host-models", default="",
                    help="instead of the link sweep: peak host memory predicted vs measured for these presets "
                         "(comma list), written to OUT/host_memory.csv")
    ap.add_argument("--host-context", type=int, default=256, help="tokens per step for --host-models")
    ap.add_argument("--backends", default="",
                    help="instead of the link sweep: every listed backend (comma list of megatrain, zero3, torch) "
                         "predicted vs measured at --backend-contexts, written to OUT/backends.csv")
    ap.add_argument("--backend-contexts", default="128,384,1024", help="tokens per step for --backends")
    ap.add_argument("--measure-one", help=argparse.SUPPRESS)  # internal: one point, JSON in and out
    ap.add_argument("--fit-one", help=argparse.SUPPRESS)  # internal: the engine fit's periods, JSON in and out
    args = ap.parse_args(argv)
    if args.measure_one:
        return _measure_one(args.measure_one)
    if args.fit_one:
        return _fit_one(args.fit_one)

    out = Path(args.out)
    if args.host_models:
        rows = validate_host([m for m in args.host_models.split(",") if m], args.host_context,
                             threads=args.threads or None)
        _write(rows, out / "host_memory.csv", ["model", "params", "allocator", "measured_rss_growth_bytes",
                                               "predicted_host_growth_bytes", "host_error_pct", "measured_step_s"])
        return 0
    if args.backends:
        rows = validate_backends(args.model, tuple(int(c) for c in args.backend_contexts.split(",")),
                                 tuple(b for b in args.backends.split(",") if b), args.steps,
                                 args.threads or None)
        _write(rows, out / "backends.csv", ["backend", "seq_len", "measured_step_s", "predicted_step_s", "error_pct",
                                            "measured_vs_torch", "predicted_vs_torch"])
        return 0
    rows = validate(args.model, args.context, parse_gbps(args.gbps), args.warmup, args.steps, args.quick_bench,
                    args.threads or None, args.repeats)
    _write(rows, out / "validation.csv",
           ["link_gbps", "measured_step_s", "predicted_step_s", "error_pct", "error_cal_pct",
            "predicted_bottleneck", "host_error_pct", "measured_crossover_gbps", "predicted_crossover_gbps"])
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:  # bad input: the message names it and the fix, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
