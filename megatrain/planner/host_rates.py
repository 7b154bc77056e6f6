"""Per host mode, how far the host's optimizer pass runs from its bytes bound, and from how many tokens per step
the device's compute outlasts it.

The step-time model (step_time.py) counts the bytes each mode's update moves per parameter and divides them by
the profile's host optimizer rate (Hardware.optimizer_bps: the FP32 AdamW's, measured where a profile has it).
The modes differ in how close their passes come to those bytes (hilo's split and join, bf16 widening, per-layer
jobs), so each mode's rate is the profile's rate times FP32's ratio to the bound over the mode's own. The ratios
are the paired "x bound" (median of the rounds) of results/host_passes/ where measured; a mode not measured there
says "assumed" and what it is assumed to be like.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .point import Point


class Time(Protocol):
    """What these functions read of a planned step (step_time.Time)."""

    optimizer_busy_s: float
    busy_s: dict[str, float]


@dataclass(frozen=True)
class HostRate:
    x_bound: float  # the mode's clip + step + zero_grad time over its bytes bound (1.0: at the bandwidth limit)
    source: str  # "measured: ..." or "assumed: ..."
    threads: int = 2  # the threads it was measured on: on more, a rate above the bound is clamped (host_work.py)


_RUN = "measured: results/host_passes (llama-100m, 2-core CPU, paired median)"
HOST_RATES: dict[str, HostRate] = {
    "fp32": HostRate(0.95, _RUN),
    "fp32, overlap": HostRate(0.78, _RUN),
    "bf16 shadow": HostRate(0.98, _RUN),
    "bf16 shadow, overlap": HostRate(0.94, _RUN),
    "hilo": HostRate(0.99, _RUN),
    "hilo + bf16 slabs": HostRate(0.99, _RUN),
    # Its per-layer updates run with no backward computing beside them ("layer updates alone"): on the 2-core
    # CPU the backward's compute shares the cores (2.16x there), on a GPU host it runs on the device.
    "hilo, optimizer in backward": HostRate(1.26, _RUN + ", per-layer updates alone"),
    "fp32, optimizer in backward": HostRate(0.78, "assumed: as the FP32 fused per-layer pass (fp32, overlap)"),
    "bf16 master": HostRate(0.99, "assumed: as hilo + bf16 slabs (the same passes less the lo half)"),
    # Not a mode: backward's per-layer reduction + norm on the reducer's threads (host_work.py), against copy_ on the
    # same threads. Torch's two passes (accumulate, then the slab's norm), where the one-pass kernel does not apply
    # (bf16 slabs: host_work.reducer_one_pass): the first reduction after zero_grad (0 + g, the only one at
    # accumulation 1) writes the slab without reading it, yet takes as long as an add: its 10 counted bytes run at
    # 1.75x their bound (an add + norm, 14 bytes: 1.1x). Beside it the rounding of the resident masters into their
    # bf16 staging, on a worker of its own (engine/host/resident_upload.py).
    "reducer": HostRate(1.75, "measured: results/reducer_rate (first reduction + norm, 1 of 2 threads, paired "
                              "median, 6 runs)", threads=1),
    # The one-pass kernel (engine/host/reduce_kernel.py), on every reducer thread: write or add, norm and finite
    # flag in one loop, its fixed chunks split over the threads. Measured on one core: the 10 counted bytes at 0.8x
    # the bound of copy_ on that core (first reduction 0.80, an add 0.72: the first, the only one at accumulation
    # 1, is counted); host_work.reducer_bps applies it to the bandwidth of the reducer's threads.
    "reducer, one pass": HostRate(0.8, "measured: results/host_passes/reducer.md (one pass, first reduction + "
                                       "norm, 1 thread, paired median, 11 repetitions)", threads=1),
    "resident rounding": HostRate(1.3, "measured: results/reducer_rate (FP32 -> bf16 copy_, every thread, paired "
                                       "median, 3 runs)"),
}


def host_mode(p: Point, overlapped: bool | None = None) -> str:
    """The HOST_RATES row of a point's host-memory mode; `overlapped`: whether the update overlaps the next
    forward (point.overlap_on at a hardware; default: only when the point sets it)."""
    if p.master == "bf16":
        return "bf16 master"
    if p.optimizer_in_backward:
        return f"{p.master}, optimizer in backward"
    if p.master == "hilo":
        return "hilo + bf16 slabs" if p.host_grad_dtype == "bfloat16" else "hilo"
    base = "bf16 shadow" if p.c == 2 else "fp32"
    return f"{base}, overlap" if (p.optimizer_overlap if overlapped is None else overlapped) else base


def host_slowdown(p: Point, overlapped: bool | None = None) -> float:
    """How much slower than the FP32 whole step the point's mode moves its bytes (1.0 for FP32 itself)."""
    return HOST_RATES[host_mode(p, overlapped)].x_bound / HOST_RATES["fp32"].x_bound


def host_bound_below_tokens(p: Point, t: Time) -> float | None:
    """Tokens per step below which the host's optimizer pass outlasts the device's compute (the step is then
    host-bound, overlapped or not), from the planned step `t`: the host pass is fixed per step and the compute
    grows with the tokens (linearly here: attention's quadratic share makes the real crossing a little lower)."""
    compute = t.busy_s.get("compute", 0.0)
    if compute <= 0 or t.optimizer_busy_s <= 0:
        return None
    return t.optimizer_busy_s * p.tokens_per_step / compute


def host_bound_line(p: Point, t: Time, overlapped: bool | None = None) -> str | None:
    """`megatrain plan`'s line about it."""
    at = host_bound_below_tokens(p, t)
    if at is None:
        return None
    mode = host_mode(p, overlapped)
    rate = HOST_RATES[mode]
    where = "host-bound" if p.tokens_per_step < at else "not host-bound"
    return (f"  host optimizer ({mode}, {rate.x_bound:g}x its bytes bound, {rate.source.split(':')[0]}) "
            f"outlasts the compute below {at:,.0f} tokens per step; this point has {p.tokens_per_step:,} ({where})")
