"""Peak of the host<->device link, the denominator of link utilization.

On CUDA: large pinned transfers timed with CUDA events, best of a few (what a well-behaved copy
stream can reach, ~55 GB/s per direction on PCIe Gen5 x16). On the CPU there is no link: the
engine's copy threads move bytes with memcpy, optionally rate-limited to emulate one, so the peak is
the emulated rate when set and a measured memcpy rate otherwise.
"""

from __future__ import annotations

import time

import torch

from megatrain.metrics.device import device_name, read_cache, write_cache


def _probe_cuda(nbytes: int, reps: int) -> tuple[float, float]:
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best_h2d = best_d2h = 0.0
    for _ in range(reps):
        for direction in ("h2d", "d2h"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if direction == "h2d":
                dev.copy_(host, non_blocking=True)
            else:
                host.copy_(dev, non_blocking=True)
            end.record()
            end.synchronize()
            gbps = nbytes / (start.elapsed_time(end) / 1e3) / 1e9
            if direction == "h2d":
                best_h2d = max(best_h2d, gbps)
            else:
                best_d2h = max(best_d2h, gbps)
    return best_h2d, best_d2h


def _probe_memcpy(nbytes: int, reps: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def link_peak_gbps(device: torch.device | str = "cpu", emulated_gbps: float | None = None,
                   nbytes: int = 256 << 20, reps: int = 5) -> tuple[float, float, str]:
    """(h2d GB/s, d2h GB/s, source) with source in {'probe', 'emulated', 'memcpy'}; cached per device."""
    dev = torch.device(device)
    if dev.type != "cuda" and emulated_gbps:
        return float(emulated_gbps), float(emulated_gbps), "emulated"
    key = f"link|{device_name(dev)}|{torch.get_num_threads()}"
    cached = read_cache().get(key)
    if isinstance(cached, list) and len(cached) == 2:
        return float(cached[0]), float(cached[1]), "probe" if dev.type == "cuda" else "memcpy"
    if dev.type == "cuda":
        h2d, d2h = _probe_cuda(nbytes, reps)
        source = "probe"
    else:
        h2d = d2h = _probe_memcpy(nbytes, reps)
        source = "memcpy"
    write_cache(key, [h2d, d2h])
    return h2d, d2h, source
