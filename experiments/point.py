"""One sweep point, in its own process: build the model, train warm-up + timed steps, measure.

    python -m experiments.point --point '<json>' --result out.json [--trace trace.json]

Writes a JSON object of results-row fields to --result (atomically) and exits 0; on an error it
still writes {status, reason} and exits 1, so the runner records why. Everything here goes through
the public faces (`megatrain.accelerate.Accelerator`), the way a user would run the backend.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.backend_record import backend_settings, describe_optimizer
from experiments.spec import Point
from megatrain.files.atomic import atomic_write


def _die_with_parent(parent_pid: int | None) -> None:
    """A point must not outlive its runner (a killed runner would leave it burning CPU)."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def build_model(pt: Point):
    """The point's random-weight HF model (see build_preset_model)."""
    return build_preset_model(pt.preset, pt.seed)


def build_preset_model(preset: Any, seed: int = 0):
    """Random-weight HF model for a preset: initialization is skipped and replaced by a cheap
    N(0, 0.02) fill, because the default init of a 70B model on a CPU takes far longer than the run."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    cfg = preset.hf_config()
    with no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.tie_weights()  # skipped with the init above: a tied preset would train an untied, bigger model
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(cfg, "initializer_range", 0.02))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name else 0.0)  # RMSNorm gains 1, biases 0, as HF initializes them
            else:
                p.normal_(0.0, std, generator=gen)
    model.train()
    return model


def flops_per_step(pt: Point) -> float:
    """Model FLOPs of one optimizer step. A mixture of experts computes with its active parameters
    (router and top-k experts) while it stores and streams all of them: FLOPs count the active ones,
    bytes (streamed weights, host memory) the total. Equal to the total in a dense model."""
    from megatrain.costs.flops import model_flops_per_step

    p = pt.preset
    return model_flops_per_step(p.active_nonembed_params(), p.num_layers, p.hidden, pt.seq_len, pt.tokens_per_step)


class DoesNotFit(MemoryError):
    """The model's weights alone exceed the host memory available: refused before allocating."""


def _check_host_room(pt: Point) -> None:
    # The planner's preflight runs before launch; this is the last line of defence for a point run
    # without it (e.g. `megatrain train`): building the FP32 model touches every page of it.
    import psutil

    need = pt.preset.param_count() * 4
    avail = psutil.virtual_memory().available
    if need > avail:
        raise DoesNotFit(f"building {pt.model} needs {need / 2**30:.1f} GiB of host memory for its FP32 weights "
                         f"alone; {avail / 2**30:.1f} GiB is available")


def _find_engine(*objs: Any) -> Any:
    """The MegaTrain engine behind the face (its accounting is the breakdown and link source)."""
    seen: set[int] = set()
    todo = list(objs)
    while todo:
        o = todo.pop(0)
        if o is None or id(o) in seen:
            continue
        seen.add(id(o))
        if hasattr(o, "collect_stats") and hasattr(o, "reset_stats"):
            return o
        for attr in ("engine", "_engine", "backend", "_backend", "module"):
            with contextlib.suppress(Exception):
                todo.append(getattr(o, attr))
    return None


# The engine's counts that add up over steps; the rest (peaks, sizes) hold for the window as a whole.
_ADDITIVE = ("forward_s", "backward_s", "optimizer_s", "optimizer_busy_s", "copy_wait_s", "h2d_bytes", "d2h_bytes",
             "h2d_busy_s", "d2h_busy_s", "tokens", "recomputed_layers")


def per_step(window: dict[str, float], n_steps: int) -> dict[str, float]:
    """A timed window's engine counts as one step's: the additive counts divided by the window's steps."""
    return {k: (v / n_steps if k in _ADDITIVE and v is not None else v) for k, v in window.items()}


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", None) == "cuda":
        torch.cuda.synchronize(device)


def run(pt: Point, trace_path: str | None = None,
        progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Train pt.warmup + pt.steps optimizer steps; return the measured row fields."""
    import torch

    from megatrain.costs.flops import model_tflops
    from megatrain.metrics.device import device_name, device_peak_tflops
    from megatrain.metrics.link import link_peak_gbps
    from megatrain.metrics.samplers import NvmlPcieSampler, RssSampler

    if pt.threads:
        torch.set_num_threads(pt.threads)
    torch.manual_seed(pt.seed)
    rss = RssSampler().start()
    base_rss = rss.rss()
    t_start = time.perf_counter()

    from megatrain.accelerate import Accelerator

    engine_knobs = dict(pt.engine)
    if pt.backend == "megatrain":
        engine_knobs.setdefault("trace", trace_path is not None)
        if pt.precision == "bf16":
            engine_knobs.setdefault("compute_dtype", "bfloat16")
    # One DeepSpeed-style config for every backend, so all three clip the same way.
    config: dict[str, Any] = {"gradient_clipping": pt.grad_clip}
    if pt.backend == "megatrain":
        config["megatrain"] = engine_knobs
    if pt.backend.startswith("zero3") and pt.zero3:
        config["zero_optimization"] = dict(pt.zero3)
    acc = Accelerator(backend=pt.backend, config=config, gradient_accumulation_steps=pt.grad_accum,
                      mixed_precision="bf16" if pt.precision == "bf16" else "no",
                      gradient_checkpointing=pt.recompute)
    _check_host_room(pt)
    model = build_model(pt)
    # Each backend's best kernel: torch's fused AdamW (the default per-tensor loop is ~9x slower on a
    # CPU); megatrain runs it on its host masters; under ZeRO offload Accelerate replaces it with
    # DeepSpeedCPUAdam. The row records what actually ran.
    optimizer = torch.optim.AdamW(model.parameters(), lr=pt.lr, fused=True)
    model, optimizer = acc.prepare(model, optimizer)
    ran_optimizer = describe_optimizer(optimizer)
    ran_settings = json.dumps(backend_settings(acc), sort_keys=True)
    engine = _find_engine(model, acc) if pt.backend == "megatrain" else None
    device = getattr(acc, "device", None) or torch.device("cpu")

    gen = torch.Generator().manual_seed(pt.seed + 1)
    batches = [torch.randint(0, pt.preset.vocab, (pt.micro_batch, pt.seq_len), generator=gen)
               for _ in range(pt.grad_accum)]
    if pt.backend != "megatrain":
        batches = [b.to(device) for b in batches]

    nvml = NvmlPcieSampler(device.index or 0).start() if device.type == "cuda" else None
    n_steps = pt.steps
    # The baselines' breakdown is wall time, which needs the device drained at each phase boundary;
    # the engine times its own phases, and a sync there would cut its copy/compute overlap.
    phase_sync = (lambda: _sync(device)) if engine is None else (lambda: None)
    step_times: list[float] = []
    losses: list[Any] = []
    parts: list[dict[str, float]] = []
    windows: list[tuple[float, float]] = []
    st: dict[str, float] | None = None
    # The timed steps run back to back and the last one's clock stops only once the host work they caused has
    # drained (overlapped layer updates, gradient reductions): stats read between steps would drain that work
    # off the clock (collect_stats() synchronizes), and the last step's leftover would never be counted.
    for step in range(pt.warmup + n_steps):
        timed = step >= pt.warmup
        if step == pt.warmup:
            if engine is not None:
                engine.collect_stats()  # the warm-up's leftover drains here, before the clock starts
                engine.reset_stats()
        _sync(device)
        t0 = time.perf_counter()
        if engine is not None and not timed:
            engine.reset_stats()
        wall = {"forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0}
        loss_sum = None
        for x in batches:
            ctx = acc.accumulate(model) if hasattr(acc, "accumulate") else contextlib.nullcontext()
            with ctx:
                a = time.perf_counter()
                out = model(input_ids=x, labels=x)
                phase_sync()
                b = time.perf_counter()
                acc.backward(out.loss)
                phase_sync()
                c = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad()
                phase_sync()
                d = time.perf_counter()
            wall["forward_s"] += b - a
            wall["backward_s"] += c - b
            wall["optimizer_s"] += d - c
            loss = out.loss.detach()
            loss_sum = loss if loss_sum is None else loss_sum + loss
        if timed and step == pt.warmup + n_steps - 1:
            if engine is not None:
                engine.synchronize()  # on the clock: the last step's queued host work
            _sync(device)
        t1 = time.perf_counter()
        if timed:
            step_times.append(t1 - t0)
            losses.append(loss_sum / len(batches))  # a tensor: .item() would sync inside the window
            parts.append(wall)
            windows.append((t0, t1))
        else:
            st = dict(engine.collect_stats()) if engine is not None else None
        if progress is not None:
            # between two steps' clocks: the loss read syncs the device, not the host's queued work
            info = {"step": step + 1, "timed": timed, "loss": float(loss_sum) / len(batches),
                    "step_time_s": t1 - t0, "tokens_per_s": pt.tokens_per_step / (t1 - t0), "rss_bytes": rss.rss()}
            if st is not None and not timed:
                info["device_bytes"] = st.get("peak_device_bytes")
            elif device.type == "cuda":
                info["device_bytes"] = torch.cuda.max_memory_allocated(device)
            progress(info)
    eng_stats: list[dict[str, float]] = []
    trace_records: list = []
    if engine is not None:
        eng_stats = [per_step(engine.collect_stats(), n_steps)]  # the window drained above: no wait here
        if trace_path:
            last_start = windows[-1][0] - engine.trace_log.origin  # the trace's clock starts at its origin
            trace_records = [(r.stream, r.kind, r.layer, r.t_start, r.t_end) for r in engine.trace
                             if r.t_start >= last_start]
    losses = [float(v) for v in losses]
    if nvml is not None:
        nvml.stop()
    peak_rss = rss.stop()

    p = pt.preset
    # The mean, not the median: each step pays for its predecessor's overlapped host work and the last for its
    # own, so one step's time alone is not a step's cost.
    step_time = statistics.fmean(step_times)
    flops = flops_per_step(pt)
    tflops = model_tflops(flops, step_time)
    peak, peak_src = device_peak_tflops(device, pt.precision)
    dtype_bytes = 2 if pt.precision == "bf16" else 4
    row: dict[str, Any] = {
        "status": "ok", "reason": "", "device_name": device_name(device),
        "step_time_s": step_time, "step_time_min_s": min(step_times), "step_time_max_s": max(step_times),
        "step_times_s": json.dumps([round(t, 6) for t in step_times]),
        "tokens_per_s": pt.tokens_per_step / step_time, "flops_per_step": flops, "model_tflops": tflops,
        "device_peak_tflops": peak, "peak_source": peak_src, "mfu": tflops / peak if peak else None,
        "loss_first": losses[0], "loss_last": losses[-1],
        "peak_host_rss_bytes": peak_rss, "base_host_rss_bytes": base_rss,
        "host_bytes_per_param": (peak_rss - base_rss) / p.param_count(),
        "streamed_weight_bytes": p.num_layers * p.layer_params() * dtype_bytes,
        "threads": torch.get_num_threads(),
        "optimizer": ran_optimizer, "backend_settings": ran_settings,
    }

    def med(key: str, source: list[dict[str, float]]) -> float | None:
        vals = [s[key] for s in source if s.get(key) is not None]
        return statistics.median(vals) if vals else None

    if eng_stats:
        row.update({k: med(k, eng_stats) for k in ("forward_s", "backward_s", "optimizer_s", "copy_wait_s")})
        row["breakdown_source"] = "engine"
        row["peak_device_bytes"] = max(s["peak_device_bytes"] for s in eng_stats)
        row["device_mem_source"] = "cuda" if device.type == "cuda" else "engine"
        row["device_weight_bytes"] = eng_stats[-1].get("device_weight_bytes")
        last = eng_stats[-1]
        if last.get("resident_weight_layers") is not None:
            row["residency"] = f"{int(last['resident_weight_layers'])}/{int(last['kept_graph_layers'])}"
            row["recomputed_layers"] = med("recomputed_layers", eng_stats)
        row["h2d_bytes_per_step"] = med("h2d_bytes", eng_stats)
        row["d2h_bytes_per_step"] = med("d2h_bytes", eng_stats)
        row["h2d_busy_s"] = med("h2d_busy_s", eng_stats)
        row["link_source"] = "engine"
    else:
        row.update({k: med(k, parts) for k in ("forward_s", "backward_s", "optimizer_s")})
        row["breakdown_source"] = "wall"
        if device.type == "cuda":
            row["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
            row["device_mem_source"] = "cuda"
        else:
            row["device_mem_source"] = "none"
        if nvml is not None and nvml.available:
            moved = [nvml.bytes_between(a, b) for a, b in windows]
            moved = [m for m in moved if m is not None]
            if moved:
                row["h2d_bytes_per_step"] = statistics.median(m[0] for m in moved)
                row["d2h_bytes_per_step"] = statistics.median(m[1] for m in moved)
                row["link_source"] = "nvml"
        row.setdefault("link_source", "none")

    if row.get("h2d_bytes_per_step") is not None:
        row["h2d_gbps"] = row["h2d_bytes_per_step"] / step_time / 1e9
        row["d2h_gbps"] = row["d2h_bytes_per_step"] / step_time / 1e9
        if row.get("h2d_busy_s"):
            row["h2d_gbps_busy"] = row["h2d_bytes_per_step"] / row["h2d_busy_s"] / 1e9
        emulated = engine_knobs.get("link_gbps") if pt.backend == "megatrain" else None
        h2d_peak, _, src = link_peak_gbps(device, emulated_gbps=emulated)
        row["link_peak_h2d_gbps"], row["link_peak_source"] = h2d_peak, src
        row["link_util"] = row["h2d_gbps"] / h2d_peak if h2d_peak else None

    if trace_path and trace_records:
        t_origin = min(r[3] for r in trace_records)
        payload = {"label": pt.label, "step_time_s": step_times[-1],
                   "records": [[s, k, layer, a - t_origin, b - t_origin] for s, k, layer, a, b in trace_records]}
        atomic_write(Path(trace_path), json.dumps(payload))
    row["wall_s"] = time.perf_counter() - t_start
    for k, v in list(row.items()):
        if isinstance(v, float) and not math.isfinite(v):
            row[k] = None
    return row


def _classify(exc: BaseException) -> tuple[str, str]:
    """(status, reason) for an exception raised inside the point."""
    name = type(exc).__name__
    line = " ".join(f"{name}: {exc}".split())[:500]
    if name in ("HostMemoryError", "DoesNotFit"):
        return "skipped", line  # the engine's own preflight refused before allocating: does not fit
    if isinstance(exc, MemoryError) or "OutOfMemory" in name or "out of memory" in str(exc).lower():
        return "failed", f"out of memory: {line}"
    return "failed", line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.point", description=__doc__.splitlines()[0])
    ap.add_argument("--point", required=True, help="the point as JSON (experiments.spec.Point fields)")
    ap.add_argument("--result", required=True, help="where to write the result JSON")
    ap.add_argument("--trace", default=None, help="where to write the engine trace of the last timed step")
    ap.add_argument("--parent-pid", type=int, default=None)
    args = ap.parse_args(argv)
    _die_with_parent(args.parent_pid)
    pt = Point.from_dict(json.loads(args.point))
    try:
        row = run(pt, trace_path=args.trace)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the results row
        traceback.print_exc()
        status, reason = _classify(exc)
        atomic_write(Path(args.result), json.dumps({"status": status, "reason": reason}))
        return 1
    atomic_write(Path(args.result), json.dumps(row, default=float))
    print(f"ok: {pt.label}: {row['tokens_per_s']:.1f} tokens/s, step {row['step_time_s']:.3f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
