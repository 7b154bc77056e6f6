"""The host work the engine puts in a CUDA step's way, with the threads it gets: the backward's gradient reducer
and the serial work on the launch thread at each step.

As the engine runs it (engine/pipeline/schedule.py, engine/runtime/stream.py, engine/update/update.py, engine/engine.py):
- the reducer: each layer's gradients land in pinned staging (STAGING_SLOTS slots, costs/pinning.py) and one host
  thread adds them into the FP32 slab, with `side_threads()` = a quarter of torch's threads (at least one). The
  first reduction after zero_grad() writes 0 + g (read the staging, write the slab), later ones add (read the
  staging, read + write the slab), and the norm is measured with them (engine/host/slab_state.py): c + 8 bytes
  per parameter counted. With FP32 slabs this is one pass (engine/host/reduce_kernel.py, measured at 0.8x that
  bound on one core) split by fixed chunks over every reducer thread; bf16 slabs are not the kernel's: torch's
  two passes on every reducer thread (1.75x: the norm reads the slab again).
- the resident work at each step: `step()` updates the resident parameters (embedding, head, final norm) on the
  launch thread after the layer jobs are queued (the device has nothing queued meanwhile), then their FP32
  masters are rounded into the bf16 staging the upload reads on a worker of their own, fenced by an event
  (engine/host/resident_upload.py): the launch thread returns at once, and the next forward's embedding waits
  for the worker. So the rounding is the worker's time, not the launch thread's, and the device still idles for
  it: it shares the host's memory bandwidth with the layer updates running beside it (each pass reaches that
  bandwidth on its own), so its bytes delay the forward whether or not the layers' updates are hidden. What it
  overlaps is the caller's own work between steps (zero_grad, the next batch), which is not modelled here.

A memory-bound pass on n of a host's cores reaches its achieved bandwidth x min(1, n / (cores x
SATURATING_SHARE)): a few cores per memory channel saturate it, one core alone is far from it.

Two clamps keep these rates at what a host can give:
- a rate measured on fewer threads than it is applied to is held at or below the bytes bound there: the one-pass
  reducer's 0.8x of copy_'s bound was measured on one core, where copy_ is far from the bandwidth; on a quarter
  of a big host's cores copy_ reaches it, and no pass moves its bytes faster than the bandwidth
  (`HostRate.threads`, `bounded_bps`);
- lanes that run at the same time share the host's bandwidth: the layers' reducer and the resident parameters'
  own (engine/pipeline/global_grads.py, a quarter of the cores each, running while the first layers' reductions
  do) each get at most their threads' share of it (`lane_share_bps`), not the whole of it each.
The bandwidth is the profile's achieved one, of the socket the GPU hangs off: a run bound to that socket
(docs/HOST_MODES.md, "Binding a run to the GPU's socket"). `host_assumptions` is what `megatrain plan` prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .hardware import Hardware, _is_bf16
from .host_rates import HOST_RATES
from .point import Point

# Host cores (torch's default intra-op threads: physical cores) of the packaged GPU profiles. A profile not listed
# (`megatrain bench`'s, the "cpu" one) is this machine's, unless it names its `host_cores`. Assumed: the paper's
# 2-socket Xeon host (2 x 56), GH200's 72 Grace cores (NVIDIA's data sheet); DGX H100 / H200: 2 x Xeon 8480C (56 each).
HOST_CORES = {"h200-pcie": 112, "h200-sxm": 112, "h100-sxm": 112, "h100-pcie": 112, "a100-pcie": 64, "gh200": 72}
# Assumed: the share of a host's cores a streaming add needs to reach its achieved bandwidth.
SATURATING_SHARE = 0.5
REDUCER_SHARE = 4  # engine/runtime/stream.py side_threads(): a quarter of the cores
GLOBALS_SHARE = 4  # the resident parameters' gradient worker (engine/pipeline/global_grads.py): side_threads() too


def host_cores(hw: Hardware) -> int:
    # a data-parallel rank's view of a node keeps the profile's name before a comma (planner/multi.py); the node
    # path's rank names its own team's cores (planner/node_path.py)
    if hw.host_cores:
        return hw.host_cores
    return HOST_CORES.get(hw.name.split(",")[0], os.cpu_count() or 1)


def reducer_threads(hw: Hardware) -> int:
    """The reducer's torch threads, as engine/runtime/stream.py side_threads() gives them."""
    return max(1, host_cores(hw) // REDUCER_SHARE)


def threads_bps(hw: Hardware, threads: int) -> float:
    """Bytes/s a streaming pass on `threads` of the host's cores reaches."""
    return hw.host_bw_bps * min(1.0, threads / max(1.0, host_cores(hw) * SATURATING_SHARE))


def globals_threads(hw: Hardware) -> int:
    """The resident parameters' gradient worker's torch threads (global_grads.py: side_threads() too)."""
    return max(1, host_cores(hw) // GLOBALS_SHARE)


def lane_share_bps(hw: Hardware, threads: int, beside: int) -> float:
    """Bytes/s a streaming lane on `threads` reaches while another on `beside` threads runs: its threads' rate,
    at most its share of the host's bandwidth (the two together never exceed it)."""
    return min(threads_bps(hw, threads), hw.host_bw_bps * threads / max(1, threads + beside))


def bounded_bps(bound_bps: float, key: str, threads: int) -> float:
    """`bound_bps` (the bytes bound of the threads a pass runs on) at HOST_RATES[key]'s distance from it, clamped:
    on more threads than the rate was measured on, a pass faster than its bound (x_bound < 1) is held at the
    bound (it cannot beat a bandwidth its threads already reach)."""
    rate = HOST_RATES[key]
    x = rate.x_bound if threads <= rate.threads else max(rate.x_bound, 1.0)
    return bound_bps / x


def reducer_bytes_per_param(p: Point) -> int:
    """Host bytes per layer parameter one micro-batch's reduction moves, on average over the step (see above):
    with FP32 slabs c + 8 (a bf16 slab: c + 4), the norm's read included."""
    slab = 2 if _is_bf16(p.host_grad_dtype) else 4
    return p.c + 2 * slab


def reducer_one_pass(p: Point, hw: Hardware) -> bool:
    """Whether the engine reduces with its one-pass kernel (engine/host/reduce_kernel.py pays/usable): into FP32
    slabs, on any number of reducer threads (its chunks split over them)."""
    return not _is_bf16(p.host_grad_dtype)


def reducer_rate_key(p: Point, hw: Hardware) -> str:
    """The HOST_RATES row the reducer runs at."""
    return "reducer, one pass" if reducer_one_pass(p, hw) else "reducer"


def reducer_bps(p: Point, hw: Hardware) -> float:
    """The reducer's rate on a CUDA host, on the reducer's threads beside the globals' worker (sharing the host's
    bandwidth), at the measured distance of its pass from the bytes bound (host_rates.py: the one-pass kernel's,
    or torch's two passes'), clamped to the bound where it was measured on fewer threads."""
    rt = reducer_threads(hw)
    return bounded_bps(lane_share_bps(hw, rt, globals_threads(hw)), reducer_rate_key(p, hw), rt)


def globals_reduce_bps(p: Point, hw: Hardware) -> float:
    """The resident parameters' gradient adds on their own worker (CUDA), beside the layers' reducer: the
    same pass (the one-pass kernel into FP32 slabs) on its share of the bandwidth."""
    gt = globals_threads(hw)
    return bounded_bps(lane_share_bps(hw, gt, reducer_threads(hw)), reducer_rate_key(p, hw), gt)


def host_assumptions(p: Point, hw: Hardware) -> dict[str, object]:
    """What the host-side rates assume, for `megatrain plan` to print and a caller to record."""
    cores = host_cores(hw)
    known = hw.host_cores or hw.name.split(",")[0] in HOST_CORES
    return {"host_cores": cores, "cores_from": "profile" if known else "this machine",
            "host_bw_gbs": hw.host_bw_bps / 1e9, "reducer_threads": reducer_threads(hw),
            "globals_threads": globals_threads(hw), "reducer_gbs": reducer_bps(p, hw) / 1e9,
            "globals_reduce_gbs": globals_reduce_bps(p, hw) / 1e9,
            "numa": "the run bound to the GPU's socket (numactl --cpunodebind/--membind); the bandwidth is that "
                    "socket's"}


def host_assumptions_line(p: Point, hw: Hardware) -> str:
    a = host_assumptions(p, hw)
    return (f"  host assumed: {a['host_cores']} cores ({a['cores_from']}), {a['host_bw_gbs']:.0f} GB/s shared by the "
            f"reducer ({a['reducer_threads']} threads, {a['reducer_gbs']:.0f} GB/s) and the globals' worker "
            f"({a['globals_threads']} threads, {a['globals_reduce_gbs']:.0f} GB/s); NUMA: {a['numa']} "
            "(docs/HOST_MODES.md)")


@dataclass(frozen=True)
class SerialWork:
    """Seconds per step between the last backward and the next forward, with nothing queued on the device (CUDA)."""

    resident_update_s: float  # AdamW over the embedding, head and final norm: the launch thread's, in step()
    resident_round_s: float  # their FP32 masters rounded into the bf16 upload staging: the rounding worker's,
    #                          which the next forward's embedding waits for (resident_upload.py)

    @property
    def launch_thread_s(self) -> float:
        """The part the launch thread spends (the rounding is its worker's)."""
        return self.resident_update_s

    @property
    def total_s(self) -> float:
        """The device's wait for both."""
        return self.resident_update_s + self.resident_round_s


def serial_work(p: Point, hw: Hardware, resident_params: int, update_s: float) -> SerialWork:
    """`update_s`: the resident parameters' optimizer pass at the mode's rate (step_time.py counts it). The
    rounding reads 4 and writes c bytes per parameter on its worker's threads (every core), at its measured
    distance from that bound (host_rates.py; a bf16 compute dtype on CUDA only: FP32 compute uploads the masters
    themselves)."""
    if p.c != 2 or hw.unified_memory:
        return SerialWork(update_s, 0.0)
    round_s = resident_params * (4 + p.c) / hw.host_bw_bps * HOST_RATES["resident rounding"].x_bound
    return SerialWork(update_s, round_s)
