"""Phase bandwidth: pinned and pageable host<->device copies timed with CUDA events, both directions at once,
the engine's own copy stream, and the bf16/fp32 matmul rates (the link and compute ceilings)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from .common import Ctx, _sync


def _timed_copies(dst: Any, src: Any, reps: int, stream: Any) -> list[float]:
    """Seconds per copy, from CUDA events around each one (after one warm-up copy)."""
    import torch

    times = []
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return times


def phase_bandwidth(ctx: Ctx) -> None:
    import torch

    if not ctx.cuda:
        def memcpy() -> dict[str, Any]:
            src = torch.ones(16 << 20, dtype=torch.uint8)
            dst = torch.empty_like(src)
            best = 0.0
            for _ in range(5):
                t0 = time.perf_counter()
                dst.copy_(src)
                best = max(best, src.numel() / (time.perf_counter() - t0) / 1e9)
            return {"ok": best > 0, "memcpy_gbps": best, "note": "no link on the CPU: host memcpy rate"}

        ctx.check("memcpy", memcpy)
        ctx.check("matmul", lambda: _matmul_rates(ctx, n_bf16=256, n_fp32=256, reps=3))
        return

    sizes = [16 << 20, 64 << 20, 256 << 20, 1 << 30]
    buf = {"host": torch.empty(sizes[-1], dtype=torch.uint8, pin_memory=True),
           "host2": torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True),
           "dev": torch.empty(sizes[-1], dtype=torch.uint8, device=ctx.device),
           "dev2": torch.empty(256 << 20, dtype=torch.uint8, device=ctx.device)}
    host, host2, dev, dev2 = buf["host"], buf["host2"], buf["dev"], buf["dev2"]
    host.fill_(1)
    side = torch.cuda.Stream()

    def pinned() -> dict[str, Any]:
        res: dict[str, Any] = {"sizes_bytes": sizes, "h2d_gbps": {}, "d2h_gbps": {}}
        for n in sizes:
            h2d = _timed_copies(dev[:n], host[:n], 5, side)
            d2h = _timed_copies(host[:n], dev[:n], 5, side)
            res["h2d_gbps"][str(n)] = {"best": n / min(h2d) / 1e9, "median": n / statistics.median(h2d) / 1e9}
            res["d2h_gbps"][str(n)] = {"best": n / min(d2h) / 1e9, "median": n / statistics.median(d2h) / 1e9}
        res["h2d_peak_gbps"] = max(v["best"] for v in res["h2d_gbps"].values())
        res["d2h_peak_gbps"] = max(v["best"] for v in res["d2h_gbps"].values())
        res["ok"] = res["h2d_peak_gbps"] > 1 and res["d2h_peak_gbps"] > 1
        return res

    def pageable() -> dict[str, Any]:
        n = 256 << 20
        src = torch.ones(n, dtype=torch.uint8)  # not pinned: the fallback when pinning fails
        h2d = _timed_copies(dev[:n], src, 3, side)
        d2h = _timed_copies(src, dev[:n], 3, side)
        return {"ok": True, "bytes": n, "h2d_gbps": n / min(h2d) / 1e9, "d2h_gbps": n / min(d2h) / 1e9}

    def bidirectional() -> dict[str, Any]:
        # The engine's backward streams weights in and gradients out at once.
        n = 256 << 20
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        best = 0.0
        for _ in range(4):
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            e1, e2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(s1)
            s2.wait_event(start)
            with torch.cuda.stream(s1):
                dev[:n].copy_(host[:n], non_blocking=True)
                e1.record(s1)
            with torch.cuda.stream(s2):
                host2.copy_(dev2, non_blocking=True)
                e2.record(s2)
            torch.cuda.synchronize()
            sec = max(start.elapsed_time(e1), start.elapsed_time(e2)) / 1e3
            best = max(best, 2 * n / sec / 1e9)
        return {"ok": best > 1, "bytes_each_way": n, "aggregate_gbps": best}

    def engine_stream() -> dict[str, Any]:
        # The engine's own copy stream and its event-based busy time: what the results' h2d_gbps_busy uses.
        from megatrain.engine.parts import DONE, CopyStream, Trace

        cs = CopyStream("h2d", ctx.device, Trace(False, ctx.device))
        n, jobs = 128 << 20, 16

        def job(i: int) -> Callable[[], int]:
            def fn() -> int:
                dev[(i % 4) * n: (i % 4 + 1) * n].copy_(host[(i % 4) * n: (i % 4 + 1) * n], non_blocking=True)
                return n
            return fn

        for i in range(jobs):  # warm-up
            cs.submit(job(i), DONE, "load", i)
        cs.reset_counters()
        t0 = time.perf_counter()
        for i in range(jobs):
            cs.submit(job(i), DONE, "load", i)
        enqueue_s = time.perf_counter() - t0
        cs.synchronize()
        wall = time.perf_counter() - t0
        busy = cs.busy_s
        return {"ok": busy > 0 and cs.bytes == n * jobs, "bytes": cs.bytes, "busy_s": busy,
                "gbps_busy": cs.bytes / busy / 1e9 if busy else None, "gbps_wall": cs.bytes / wall / 1e9,
                "host_enqueue_s": enqueue_s}

    for name, fn in (("pinned", pinned), ("pageable", pageable), ("bidirectional", bidirectional),
                     ("engine_stream", engine_stream)):
        ctx.check(name, fn)
    buf.clear()
    host = host2 = dev = dev2 = None  # noqa: F841 - the matmul probe wants the memory back
    torch.cuda.empty_cache()
    ctx.check("matmul", lambda: _matmul_rates(ctx, n_bf16=8192, n_fp32=4096, reps=10))


def _matmul_rates(ctx: Ctx, n_bf16: int, n_fp32: int, reps: int) -> dict[str, Any]:
    import torch

    res: dict[str, Any] = {"ok": True}
    for label, dtype, n in (("bf16", torch.bfloat16, n_bf16), ("fp32", torch.float32, n_fp32)):
        a = torch.randn(n, n, device=ctx.device, dtype=dtype)
        b = torch.randn(n, n, device=ctx.device, dtype=dtype)
        for _ in range(3):
            a @ b
        _sync(ctx.device)
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(ctx.device)
        res[f"{label}_tflops"] = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12
        res[f"{label}_n"] = n
    return res
