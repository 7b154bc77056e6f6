"""`megatrain bench`: measure this machine into a hardware profile the planner can use.

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

from .hardware import GIB, _meminfo

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


def _runtime_rss() -> tuple[float, str]:
    """The host runtime's share of a training process: this process's RSS with python and torch (and
    whatever else it has imported) loaded, before any model; measured, since it varies with versions."""
    import sys

    import psutil

    mods = ", ".join(m for m in ("torch", "transformers", "deepspeed") if m in sys.modules)
    rss = psutil.Process().memory_info().rss
    return float(rss), f"measured: RSS of the bench process (python + {mods} imported, no model)"


def _entry(value: float, source: str, digits: int = 3) -> dict[str, Any]:
    return {"value": float(f"{value:.{digits}g}"), "source": source}


def bench_cpu(quick: bool = False, min_time: float | None = None, threads: int | None = None) -> dict[str, Any]:
    """Measure this CPU as a planner profile ('cpu': the device is this host, memory unified).

    Returns a dict in hardware.yaml's profile schema (plus 'name' and 'raw'), ready for
    `get_hardware(...)` or to paste under `profiles:`.
    """
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _bench_cpu(torch, quick, min_time)
    finally:
        torch.set_num_threads(before)


def _bench_cpu(torch, quick: bool, min_time: float | None) -> dict[str, Any]:
    min_time = min_time if min_time is not None else (0.01 if quick else 0.5)
    nthreads = torch.get_num_threads()
    shapes = QUICK_SHAPES if quick else ENGINE_SHAPES
    fp32 = _matmul_rates(torch, torch.float32, "cpu", shapes, min_time)
    bf16 = _matmul_rates(torch, torch.bfloat16, "cpu", shapes[:1] if quick else shapes, min_time)
    nbytes = (8 if quick else 256) * 1024**2
    host_bw = _copy_bw(torch, nbytes, min_time)
    link = _thread_link_bw(torch, nbytes, min_time)
    opt_bw = _optimizer_bw(torch, (1 if quick else 64) * 256 * 1024, min_time)
    info = _meminfo("/proc/meminfo")
    mem_total = info.get("MemTotal", 0) / GIB
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    src = (f"measured by megatrain bench on {platform.node() or 'this host'} ({_cpu_name()}, "
           f"{nthreads} threads, torch {torch.__version__}, load {load:.1f}{', quick' if quick else ''}) {when}")

    def peak_and_sustained(rates: list[tuple[float, float]]) -> tuple[float, float]:
        peak = max(best for best, _ in rates)
        sustained = statistics.median(med for _, med in rates) / peak
        return peak, min(1.0, sustained)

    busy = load > 0.5 * (os.cpu_count() or 1)
    p32, s32 = peak_and_sustained(fp32)
    p16, s16 = peak_and_sustained(bf16)
    reserved, reserved_src = _runtime_rss()
    return {
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
    host = bench_cpu(quick=quick, min_time=min_time, threads=threads)
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
