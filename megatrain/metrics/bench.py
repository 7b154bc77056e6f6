"""This machine and the engine's layers, measured: the hardware profile `megatrain bench` writes for the planner,
and the layer timings the validation studies set against its predictions.

It sits above the planner and the engine (the measurements' tier): it times real Engine steps (the engine's own per-layer cost),
which the planner, arithmetic only, never runs.

Measures matmul rates at the engine's shapes (fp32 and bf16), host memory bandwidth (a large copy),
the CPU AdamW's effective bandwidth, and the host<->device link: real pinned copies on CUDA, or on a
CPU-only machine the unthrottled copy rate of a worker thread (what the engine's emulated link can
reach before any rate limit).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import threading
import time
from typing import Any

from ..costs.host_memory import _meminfo

GIB = 1024**3  # the profiles' unit (planner/hardware.py counts GiB alike)

# (tokens, in, out): the layer GEMMs of a ~100M-parameter Llama (hidden 1024, MLP 2752) at 1k tokens
ENGINE_SHAPES = ((1024, 1024, 1024), (1024, 1024, 2752), (1024, 2752, 1024))
QUICK_SHAPES = ((64, 128, 128), (64, 128, 344), (64, 344, 128))


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _timeit(fn, min_time: float, max_reps: int = 50, sync=None, min_reps: int = 3) -> list[float]:
    fn()  # warm-up (allocations, thread pool, kernel selection)
    if sync:
        sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < min_time and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return times


def _matmul_rates(torch, dtype, device, shapes, min_time: float, sync=None) -> list[tuple[float, float]]:
    """(best, median) FLOP/s per shape."""
    out = []
    for t, k, n in shapes:
        a = torch.randn(t, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        ts = _timeit(lambda a=a, b=b: a @ b, min_time, sync=sync)
        flops = 2.0 * t * k * n
        out.append((flops / min(ts), flops / statistics.median(ts)))
    return out


def _copy_bw(torch, nbytes: int, min_time: float) -> float:
    """Host memory bandwidth: bytes read + written per second by a large tensor copy."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    ts = _timeit(lambda: dst.copy_(src), min_time)
    return 2 * nbytes / min(ts)


def _thread_link_bw(torch, nbytes: int, min_time: float) -> float:
    """One-way bytes/s of a worker-thread copy between host buffers (the emulated link, unthrottled)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    result: list[float] = []

    def work() -> None:
        ts = _timeit(lambda: dst.copy_(src), min_time)
        result.append(nbytes / min(ts))

    th = threading.Thread(target=work, name="megatrain-bench-link")
    th.start()
    th.join()
    return result[0]


def _optimizer_bw(torch, n_params: int, min_time: float) -> float:
    """Effective bytes/s of torch's CPU AdamW step + zero_grad, counting the bytes the planner
    charges for it (read+write master, m, v; read grad; zero grad: 32 B/param)."""
    p = torch.nn.Parameter(torch.randn(n_params))
    p.grad = torch.randn(n_params)
    try:
        opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
        opt.step()
    except (RuntimeError, TypeError):  # no fused CPU kernel in this build
        opt = torch.optim.AdamW([p], lr=1e-3)

    def step() -> None:
        opt.step()
        p.grad.zero_()

    ts = _timeit(step, min_time)
    return n_params * 32 / min(ts)


def warm_runtime(preset: Any = None, tokens: int = 64) -> None:
    """Bring this process to what any training run holds before its model: one real engine training
    step (forward, backward, clipping, AdamW) of a one-layer toy of `preset`'s family (llama if None),
    then freed. Importing alone misses the kernel libraries' first-use workspaces, the modeling code and
    the engine's copy threads, which every run carries whatever its size."""
    import gc

    import torch
    import transformers

    from .. import planner  # noqa: F401  the placement advisor's modules: a run under a budget imports them
    from ..config.schema import EngineConfig
    from ..engine import Engine
    from ..models.presets import get_preset

    base = preset if preset is not None else get_preset("tiny")
    toy = base.with_(name="runtime-toy", num_layers=1, hidden=64, intermediate=128, heads=4, kv_heads=2,
                     vocab=256)
    torch.manual_seed(0)
    eng = Engine(transformers.AutoModelForCausalLM.from_config(toy.hf_config()), config=EngineConfig(device="cpu"))
    x = torch.randint(0, toy.vocab, (1, tokens))
    out = eng(input_ids=x, labels=x)
    eng.backward(out.loss)
    eng.clip_grad_norm_(1.0)
    eng.step()
    eng.zero_grad()
    eng.collect_stats()
    del eng, out
    gc.collect()


def _runtime_rss() -> tuple[float, str]:
    """The host runtime's share of a training process: this process's RSS once python, torch and the
    engine are warm (warm_runtime), before any model; measured, since it varies with versions."""
    import sys

    import psutil

    warm_runtime()
    mods = ", ".join(m for m in ("torch", "transformers", "deepspeed") if m in sys.modules)
    rss = psutil.Process().memory_info().rss
    return float(rss), (f"measured: RSS of the bench process ({mods} imported, one toy engine training step "
                        "run and freed, no model)")


def _entry(value: float, source: str, digits: int = 3) -> dict[str, Any]:
    return {"value": float(f"{value:.{digits}g}"), "source": source}


def bench_cpu(quick: bool = False, min_time: float | None = None, threads: int | None = None,
              engine_fit: bool = True, bf16: bool = True) -> dict[str, Any]:
    """Measure this CPU as a planner profile ('cpu': the device is this host, memory unified).
    engine_fit: also measure the engine's own per-layer rate and fixed costs (with_engine_overhead).
    bf16: time bf16 GEMMs at every engine shape; False: at the first only (as quick does), for a caller that plans
    FP32 alone (most of a full bench's time on a CPU without bf16 units), the profile's source says so.

    Returns a dict in hardware.yaml's profile schema (plus 'name' and 'raw'), ready for
    `get_hardware(...)` or to paste under `profiles:`.
    """
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        prof = _bench_cpu(torch, quick, min_time, bf16)
        return with_engine_overhead(prof, quick=quick) if engine_fit else prof
    finally:
        torch.set_num_threads(before)


def _bench_cpu(torch, quick: bool, min_time: float | None, all_bf16: bool = True) -> dict[str, Any]:
    min_time = min_time if min_time is not None else (0.01 if quick else 0.5)
    nthreads = torch.get_num_threads()
    shapes = QUICK_SHAPES if quick else ENGINE_SHAPES
    fp32 = _matmul_rates(torch, torch.float32, "cpu", shapes, min_time)
    bf16 = _matmul_rates(torch, torch.bfloat16, "cpu", shapes if all_bf16 and not quick else shapes[:1], min_time)
    nbytes = (8 if quick else 256) * 1024**2
    host_bw = _copy_bw(torch, nbytes, min_time)
    link = _thread_link_bw(torch, nbytes, min_time)
    opt_bw = _optimizer_bw(torch, (1 if quick else 64) * 256 * 1024, min_time)
    info = _meminfo("/proc/meminfo")
    mem_total = info.get("MemTotal", 0) / GIB
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    src = (f"measured by megatrain bench on {platform.node() or 'this host'} ({_cpu_name()}, "
           f"{nthreads} threads, torch {torch.__version__}, load {load:.1f}{', quick' if quick else ''}"
           f"{', bf16 at one shape' if not all_bf16 and not quick else ''}) {when}")

    def peak_and_sustained(rates: list[tuple[float, float]]) -> tuple[float, float]:
        peak = max(best for best, _ in rates)
        sustained = statistics.median(med for _, med in rates) / peak
        return peak, min(1.0, sustained)

    busy = load > 0.5 * (os.cpu_count() or 1)
    p32, s32 = peak_and_sustained(fp32)
    p16, s16 = peak_and_sustained(bf16)
    reserved, reserved_src = _runtime_rss()
    prof = {
        "name": "cpu",
        "description": f"this machine as the device: {_cpu_name()}, {nthreads} threads (CPU-only runs; "
                       "peak = best measured GEMM rate, not a datasheet number)",
        "unified_memory": True,
        "link": "emulated (worker-thread copies between host buffers; rate-limit with link_gbps)",
        "peak_bf16_tflops": _entry(p16 / 1e12, src),
        "peak_fp32_tflops": _entry(p32 / 1e12, src),
        "sustained_bf16": _entry(s16, src),
        "sustained_fp32": _entry(s32, src),
        "device_memory_gib": _entry(mem_total, src),
        "device_memory_bw_gbs": _entry(host_bw / 1e9, src),
        "device_reserved_gib": _entry(0.01, "assumption: no separate device runtime on CPU", 2),
        "link_gbs_theoretical": _entry(link / 1e9, src),
        "link_gbs_achieved": _entry(link / 1e9, src),
        "host_memory_gib": _entry(mem_total, src),
        "host_memory_bw_gbs_theoretical": _entry(host_bw / 1e9, src),
        "host_memory_bw_gbs_achieved": _entry(host_bw / 1e9, src),
        "host_reserved_gib": _entry(reserved / GIB, reserved_src),
        "host_optimizer_gbs": _entry(opt_bw / 1e9, src),
        "raw": {
            "threads": nthreads,
            "fp32_gflops_best_median": [(round(b / 1e9, 1), round(m / 1e9, 1)) for b, m in fp32],
            "bf16_gflops_best_median": [(round(b / 1e9, 1), round(m / 1e9, 1)) for b, m in bf16],
            "shapes": [list(s) for s in shapes],
            "host_copy_gbs": round(host_bw / 1e9, 2),
            "thread_link_gbs": round(link / 1e9, 2),
            "adamw_gbs": round(opt_bw / 1e9, 2),
            "loadavg": round(load, 2),
            "warning": (f"load average {load:.1f} on {os.cpu_count()} CPUs: other work shared the cores, so "
                        "these rates are low; re-run on an idle machine") if busy else "",
        },
    }
    return prof


def with_engine_overhead(prof: dict[str, Any], quick: bool = False, preset: Any = None,
                         tokens: tuple[int, ...] | None = None,
                         periods: list[tuple[float, float, float]] | None = None) -> dict[str, Any]:
    """`prof` with its fp32 compute rate and fixed costs measured through the engine (layer_overhead):
    sustained_fp32 becomes the FLOP-proportional rate of the engine's own layers (the GEMM figure stays
    in raw), and layer_overhead_fwd_s / layer_overhead_bwd_s / microbatch_overhead_s are the fit's
    intercepts (a negative one, fit noise, is recorded as 0). quick: two small token counts, two steps
    each; periods: engine_layer_periods already measured at `tokens` (e.g. in other processes), fitted
    instead of measuring here. If the times cannot be fitted the fixed costs are 0, marked as not measured."""
    from ..planner import profile_from_dict

    preset = preset or OVERHEAD_PRESET
    tokens = tokens or (QUICK_OVERHEAD_TOKENS if quick else OVERHEAD_TOKENS)
    out = dict(prof)
    out["raw"] = dict(prof.get("raw", {}))
    try:
        fit = layer_overhead(profile_from_dict(str(prof.get("name", "cpu")), prof), preset, tokens,
                             steps=2 if quick else 3, periods=periods)
    except (RuntimeError, ValueError) as exc:
        src = f"assumption: 0, the engine fit failed ({str(exc)[:120]})"
        for key in ("layer_overhead_fwd_s", "layer_overhead_bwd_s", "microbatch_overhead_s"):
            out[key] = {"value": 0.0, "source": src}
        return out
    base = prof["peak_fp32_tflops"]["source"]
    how = (f"{base}; fitted over real Engine steps (unthrottled link) of {fit['preset']} at "
           f"{'/'.join(map(str, fit['tokens']))} tokens: per-layer periods and the time outside the layers, "
           "least squares, one rate + fixed costs (measure.layer_overhead)")
    out["sustained_fp32"] = _entry(fit["sustained"], how)
    out["layer_overhead_fwd_s"] = _entry(max(0.0, fit["overhead_fwd_s"]), how)
    out["layer_overhead_bwd_s"] = _entry(max(0.0, fit["overhead_bwd_s"]), how)
    out["microbatch_overhead_s"] = _entry(max(0.0, fit["overhead_microbatch_s"]), how)
    out["raw"]["sustained_fp32_gemm"] = prof["sustained_fp32"]["value"]
    out["raw"]["engine_fit"] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in fit.items()}
    return out


def layer_seconds(preset: Any, tokens: int, dtype: str = "float32", min_time: float = 0.5,
                  device: str = "cpu") -> float:
    """Median seconds of one decoder layer of `preset` as the engine runs it in a step: a forward
    without autograd, then a recomputing forward and its backward (input and weight gradients), on
    `tokens` tokens. The compute rate a device sustains end to end on a layer (GEMMs, attention,
    norms, elementwise, framework overhead) is what the profile's `sustained_*` fraction stands for;
    isolated GEMMs overstate it on a CPU, where the non-GEMM ops of a small layer weigh."""
    import torch
    import transformers

    torch.manual_seed(0)
    dt = torch.bfloat16 if str(dtype) in ("bfloat16", "bf16") else torch.float32
    model = transformers.AutoModelForCausalLM.from_config(preset.with_(num_layers=1).hf_config())
    model = model.to(device=device, dtype=dt)
    layer = model.model.layers[0]
    x = torch.randn(1, tokens, preset.hidden, device=device, dtype=dt)
    pe = model.model.rotary_emb(x, torch.arange(tokens, device=device)[None])
    params = list(layer.parameters())
    sync = torch.cuda.synchronize if device != "cpu" else None

    def step() -> None:
        with torch.no_grad():
            layer(x, position_embeddings=pe)
        xx = x.detach().requires_grad_(True)
        y = layer(xx, position_embeddings=pe)
        y = y[0] if isinstance(y, tuple) else y
        torch.autograd.grad(y, (xx, *params), torch.ones_like(y))

    return statistics.median(_timeit(step, min_time, sync=sync, min_reps=5))


def bench_cuda(quick: bool = False, min_time: float | None = None, threads: int | None = None) -> dict[str, Any]:
    """Measure the current CUDA device and its host link (pinned copies) into a profile."""
    import torch

    min_time = min_time if min_time is not None else (0.05 if quick else 0.5)
    host = bench_cpu(quick=quick, min_time=min_time, threads=threads, engine_fit=False)
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    big = ((8192, 8192, 8192), (16384, 8192, 8192), (16384, 8192, 28672))
    shapes = ((2048, 2048, 2048),) if quick else big
    bf16 = _matmul_rates(torch, torch.bfloat16, dev, shapes, min_time, sync)
    fp32 = _matmul_rates(torch, torch.float32, dev, shapes[:1], min_time, sync)
    nbytes = (64 if quick else 1024) * 1024**2
    h_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d_buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h2d = nbytes / min(_timeit(lambda: d_buf.copy_(h_buf, non_blocking=True), min_time, sync=sync))
    d2h = nbytes / min(_timeit(lambda: h_buf.copy_(d_buf, non_blocking=True), min_time, sync=sync))
    props = torch.cuda.get_device_properties(dev)
    src = host["peak_fp32_tflops"]["source"].replace("measured by megatrain bench on",
                                                     f"measured by megatrain bench ({props.name}) on")
    peak16 = max(b for b, _ in bf16)
    peak32 = max(b for b, _ in fp32)
    prof = dict(host)
    prof.update({
        "name": "cuda",
        "description": f"{props.name} measured by megatrain bench (peak = best measured GEMM rate)",
        "unified_memory": False,
        "link": "measured pinned cudaMemcpy",
        "peak_bf16_tflops": _entry(peak16 / 1e12, src),
        "peak_fp32_tflops": _entry(peak32 / 1e12, src),
        "sustained_bf16": _entry(statistics.median(m for _, m in bf16) / peak16, src),
        "sustained_fp32": _entry(statistics.median(m for _, m in fp32) / peak32, src),
        "device_memory_gib": _entry(props.total_memory / GIB, src),
        "device_reserved_gib": _entry(2.0, "assumption: CUDA context, workspaces, allocator slack"),
        "link_gbs_theoretical": _entry(max(h2d, d2h) / 1e9, src),
        "link_gbs_achieved": _entry(min(h2d, d2h) / 1e9, src),
    })
    # device memory bandwidth: a device-to-device copy, read + write
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dbw = 2 * nbytes / min(_timeit(lambda: a.copy_(d_buf), min_time, sync=sync))
    prof["device_memory_bw_gbs"] = _entry(dbw / 1e9, src)
    prof["raw"] = dict(host["raw"], h2d_gbs=round(h2d / 1e9, 2), d2h_gbs=round(d2h / 1e9, 2),
                       bf16_tflops_best_median=[(round(b / 1e12, 1), round(m / 1e12, 1)) for b, m in bf16])
    return prof


def bench(quick: bool = False, min_time: float | None = None, threads: int | None = None) -> dict[str, Any]:
    """bench_cuda on a CUDA machine, else bench_cpu."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    return bench_cuda(quick, min_time, threads) if has_cuda else bench_cpu(quick, min_time, threads)


# ------------------------------------------------------------------ the engine's own per-layer cost

OVERHEAD_PRESET = "small-7m"  # the layer shape `bench` measures the engine's per-layer overhead on
OVERHEAD_TOKENS = (64, 256, 512)  # token counts: the fixed parts are the fit's intercepts
QUICK_OVERHEAD_TOKENS = (32, 128)


def engine_layer_periods(preset: Any, tokens: int, dtype: str = "float32", warmup: int = 1, steps: int = 3,
                         seed: int = 0) -> tuple[float, float, float]:
    """(forward, backward, outside) seconds of real `megatrain.engine.Engine` steps on this CPU
    (unthrottled emulated link, trace on). forward and backward are per decoder layer: the median
    interval between the starts of consecutive layers' compute spans, so each layer's whole cost in the
    engine's code path counts (binding its weights, the pipeline's acquire/release and events, sending
    its gradient, the copy and add threads running beside it on the shared cores), not only its
    arithmetic; backward intervals hold the recompute too. outside is the median per micro-batch time
    of forward() + backward() outside the layer spans: embedding, head and loss forward and backward,
    global gradient adds."""
    import torch
    import transformers

    from ..config.schema import EngineConfig
    from ..engine import Engine

    if preset.num_layers < 2:
        raise ValueError("engine_layer_periods needs a model of at least 2 layers (it times layer to layer)")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(preset.hf_config())
    model.train()
    cd = "bfloat16" if str(dtype) in ("bfloat16", "bf16") else "float32"
    eng = Engine(model, config=EngineConfig(device="cpu", trace=True, compute_dtype=cd))
    clock = eng.trace_log.now
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, preset.vocab, (1, tokens), generator=gen)
    fwd: list[float] = []
    bwd: list[float] = []
    outside: list[float] = []
    for i in range(warmup + steps):
        eng.reset_stats()
        t0 = clock()
        out = eng(input_ids=x, labels=x)
        eng.backward(out.loss)
        t1 = clock()
        eng.clip_grad_norm_(1.0)
        eng.step()
        eng.zero_grad()
        eng.collect_stats()
        if i < warmup:
            continue
        recs = [r for r in eng.trace if r.stream == "compute"]
        f = sorted((r.t_start, r.t_end, r.layer) for r in recs if r.kind == "fwd")
        b = sorted((r.t_start, r.t_end, r.layer) for r in recs if r.kind == "bwd")
        fwd += [s1 - s0 for (s0, _, l0), (s1, _, l1) in zip(f, f[1:]) if l1 == l0 + 1]
        bwd += [s1 - s0 for (s0, _, l0), (s1, _, l1) in zip(b, b[1:]) if l1 == l0 - 1]
        outside.append((t1 - t0) - (f[-1][1] - f[0][0]) - (b[-1][1] - b[0][0]))
    del eng, model
    return statistics.median(fwd), statistics.median(bwd), statistics.median(outside)


def fit_layer_overhead(preset: Any, tokens: tuple[int, ...], periods: list[tuple[float, float, float]],
                       hw: Any, dtype: str = "float32") -> dict[str, float]:
    """Split measured engine times (engine_layer_periods at several token counts) into one compute rate
    and fixed costs, on the planner's own compute model (planner/step_time.py: layer_flops, head_compute):
        layer forward      = F_fwd(T) / R + elem(T) + o_fwd
        layer backward     = F_bwd(T) / R + 2 elem(T) + o_bwd          (recompute + backward)
        outside the layers = F_head(T) / R + head elem(T) + adds(T) + o_mb   (per micro-batch)
    one rate R for all of the device's FLOPs, fixed costs per phase, by least squares over every row
    (relative errors, so the small token counts weigh as much as the large). Returns sustained
    (R / the profile's peak), o_fwd, o_bwd, o_mb in seconds and the fit's largest relative residual."""
    import numpy as np

    from ..planner import compute_terms

    rows, rhs = [], []
    for T, (pf, pb, po) in zip(tokens, periods):
        t = compute_terms(preset, T, hw, dtype)
        for row, y in (([t.layer_fwd_flops, 1.0, 0.0, 0.0], pf - t.layer_elem_s),
                       ([t.layer_bwd_flops, 0.0, 1.0, 0.0], pb - 2 * t.layer_elem_s),
                       ([t.head_flops, 0.0, 0.0, 1.0], po - t.head_fixed_s)):
            w = 1.0 / (pf if row[1] else pb if row[2] else po)
            rows.append([v * w for v in row])
            rhs.append(y * w)
    A, y = np.array(rows), np.array(rhs)
    sol, *_ = np.linalg.lstsq(A, y, rcond=None)
    inv_r, o_f, o_b, o_mb = (float(v) for v in sol)
    if not inv_r > 0:
        raise RuntimeError(f"engine times do not grow with tokens ({periods}): no rate to fit")
    return {"sustained": 1.0 / inv_r / hw.peak_flops(dtype), "overhead_fwd_s": o_f, "overhead_bwd_s": o_b,
            "overhead_microbatch_s": o_mb, "max_rel_residual": float(np.max(np.abs(A @ sol - y)))}


def layer_overhead(hw: Any, preset: Any = OVERHEAD_PRESET, tokens: tuple[int, ...] = OVERHEAD_TOKENS,
                   dtype: str = "float32", steps: int = 3,
                   periods: list[tuple[float, float, float]] | None = None) -> dict[str, Any]:
    """Measure the engine on `preset` at each token count (engine_layer_periods; or take `periods` so
    measured) and split the times (fit_layer_overhead) against profile `hw`'s peak and memory bandwidth.
    Returns the fit plus the raw periods."""
    from ..planner import resolve_model

    m = resolve_model(preset)
    if periods is None:
        periods = [engine_layer_periods(m, T, dtype, steps=steps) for T in tokens]
    fit = fit_layer_overhead(m, tuple(tokens), periods, hw, dtype)
    fit.update({"preset": m.name, "tokens": list(tokens),
                "fwd_bwd_outside_ms": [tuple(round(v * 1e3, 2) for v in per) for per in periods]})
    return fit
