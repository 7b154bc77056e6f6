"""Performance and memory model of MegaTrain and its baselines: arithmetic over model shapes and
hardware profiles (megatrain/data/hardware.yaml); imports no engine code.

    from megatrain.planner import plan, max_batch, max_context, preflight
    pl = plan("120b", context=4096, batch=8, hardware="h200-pcie")      # -> Plan
    pl.fits, pl.memory.host, pl.memory.device, pl.time.step_s, pl.tokens_per_s, pl.model_tflops
    python -m megatrain.planner --model 120b --context 4096 --batch 8 --hardware h200-pcie

What it charges (c = bytes of the compute dtype, T = tokens per micro-batch, k = layer buffers):
  host (megatrain)  master 4 (bf16: 2) + grad 4 (bf16: 2) + Adam m 4 + v 4 B/param, + a 2 B bf16 shadow
                    of the streamed layers in bf16 mode with an fp32 master, + offloaded boundary
                    activations L*T*h*c, pinned grad staging, optimizer temporaries, runtime.
  device            k layer buffers + their grads, embedding/head/norm and grads, boundary activations
                    (all L, or 2 in flight when offloaded), one layer's recompute+backward working set
                    (measured per-token coefficients; MLP side tiled when tile_tokens is set), the
                    chunked-loss workspace, runtime.
  time per layer    compute = FLOPs / (peak x sustained) + elementwise bytes / device bandwidth, attention
                    included (causal, flash backward = 2.5x forward); h2d = layer bytes / link; d2h =
                    grad bytes / link + host accumulation; max of them with >= 2 buffers, sum with 1.
  per step          grad_accum x (fill + forward + head/loss + backward + drain) + embedding/head I/O +
                    CPU AdamW (bytes touched / host bandwidth), not overlapped unless optimizer_overlap.
  zero3             DeepSpeed's 18 B/param x 1.5 buffers on the host; per module fetches (forward,
                    recompute, backward), head/embedding fetched per micro-batch, HF's full logits and
                    activations on the device; perfect prefetch by default (its best case).
Every assumption is a named constant in estimate.py or a sourced number in the profiles file.
"""

from .cli import add_bench_parser, add_plan_parser, format_plan, run_sweep
from .estimate import (
    BACKENDS,
    Memory,
    Plan,
    Point,
    Time,
    check_fit,
    crossover_closed_form,
    layer_saved_bytes,
    layer_working_set_bytes,
    link_crossover_tokens,
    make_point,
    plan,
    plan_point,
)
from .hardware import Hardware, HostMemory, get_hardware, host_memory_available, load_profiles
from .measure import bench, bench_cpu, bench_cuda
from .search import Preflight, device_memory_available, fits, max_batch, max_context, preflight
from .shapes import resolve_model

__all__ = [
    "BACKENDS", "Hardware", "HostMemory", "Memory", "Plan", "Point", "Preflight", "Time",
    "add_bench_parser", "add_plan_parser", "bench", "bench_cpu", "bench_cuda", "check_fit",
    "crossover_closed_form", "device_memory_available", "fits", "format_plan", "get_hardware",
    "host_memory_available", "layer_saved_bytes", "layer_working_set_bytes", "link_crossover_tokens",
    "load_profiles", "make_point", "max_batch", "max_context", "plan", "plan_point", "preflight",
    "resolve_model", "run_sweep",
]
