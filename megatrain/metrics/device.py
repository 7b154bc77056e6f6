"""Device peak compute: a table of known accelerators, or a measured matmul peak on the CPU.

MFU is only as honest as its denominator, so every figure says where its peak came from
(`table` or `measured`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..files import env
from ..files.atomic import atomic_write

# Dense (no sparsity) vendor peaks in TFLOPS. FP32 is the non-tensor-core rate because torch does not
# use TF32 for matmuls unless asked to. Order matters: the first substring found in the device name
# wins, so "GH200" must come before "H200" and "H100 PCIe" before "H100".
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("GH200", {"bf16": 989.4, "fp32": 66.9}),
    ("H200", {"bf16": 989.4, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.4, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp32": 91.6}),
    ("RTX 4090", {"bf16": 165.2, "fp32": 82.6}),
]


def device_name(device: torch.device | str | None = None) -> str:
    dev = torch.device(device) if device is not None else _default_device()
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    from megatrain.metrics.provenance import cpu_model

    return f"cpu: {cpu_model()}"


def _default_device() -> torch.device:
    from megatrain.engine import resolve_device

    return resolve_device(None)  # the device the engine would compute on (a CUDA build without a GPU: the CPU)


def table_peak_tflops(name: str, precision: str) -> float | None:
    for key, peaks in PEAK_TFLOPS:
        if key.lower() in name.lower():
            return peaks.get(precision)
    return None


def _cache_file() -> Path:
    return env.cache_dir("device_peaks.json")


def read_cache() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def write_cache(key: str, value: object) -> None:
    f = _cache_file()
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        data = read_cache()
        data[key] = value
        atomic_write(f, json.dumps(data, indent=1, sort_keys=True))  # concurrent points never read half a file
    except OSError:
        pass  # the cache is an optimization; a read-only home only costs a re-measure


def measure_matmul_tflops(device: torch.device | str = "cpu", precision: str = "fp32", n: int = 1024,
                          seconds: float = 0.6) -> float:
    """Best sustained square-matmul rate, the practical peak the model's GEMMs can reach."""
    dev = torch.device(device)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a @ b  # first call pays for kernel selection
    sync()
    best = 0.0
    deadline = time.perf_counter() + seconds
    reps = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        dt = time.perf_counter() - t0
        best = max(best, 2.0 * n**3 * reps / dt / 1e12)
        if time.perf_counter() > deadline:
            return best
        if dt < 0.05:
            reps *= 2


def device_peak_tflops(device: torch.device | str | None = None, precision: str = "fp32") -> tuple[float, str]:
    """(peak TFLOPS, source): the vendor table for known GPUs, else a measured matmul peak (cached
    per device, precision and thread count, because the CPU's peak depends on all three)."""
    dev = torch.device(device) if device is not None else _default_device()
    name = device_name(dev)
    if dev.type == "cuda":
        peak = table_peak_tflops(name, precision)
        if peak is not None:
            return peak, "table"
    key = f"{name}|{precision}|threads={torch.get_num_threads()}"
    cached = read_cache().get(key)
    if isinstance(cached, (int, float)) and cached > 0:
        return float(cached), "measured"
    peak = measure_matmul_tflops(dev, precision)
    write_cache(key, peak)
    return peak, "measured"
