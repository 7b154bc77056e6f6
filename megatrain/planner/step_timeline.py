"""A megatrain step as a GPU user sees it: how long the device computes, each link direction copies and each host
thread works, the fraction of the step the device sits idle, and the term that idles it most (step_time.py's
Time.idle_s, the engine's pipeline replayed with the reducer's, the launch thread's and the rounding worker's host
work counted; host_work.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .hardware import Hardware
from .host_work import reducer_bytes_per_param, reducer_threads
from .point import Point
from .step_time import IDLE_ROUND, Time

SERIAL = "serial (resident update + rounding)"  # step_time.py's host busy entry for both, split by thread here
LAUNCH = "launch thread (resident update)"
ROUNDING = "resident rounding (its worker)"


@dataclass(frozen=True)
class ReducerTerm:
    """Backward's per-layer gradient reduction on the host (CUDA), as the engine runs it."""

    threads: int  # the reducer's torch threads (engine/runtime/stream.py side_threads)
    bytes_per_param: int  # per micro-batch, on average over the step
    gbs: float  # its rate on those threads
    per_layer_s: float  # one layer's reduction
    per_layer_backward_s: float  # one layer's backward compute (recompute included), what it must keep up with
    busy_s: float  # per step


@dataclass(frozen=True)
class StepTimeline:
    step_s: float
    gpu_busy_s: float
    link_busy_s: dict[str, float]  # per direction
    host_busy_s: dict[str, float]  # per host job (the resident work by the thread that runs it)
    idle_s: dict[str, float]  # the device's idle seconds per step, by cause
    optimizer_overlap: bool  # as the engine resolves the point's setting
    reducer: ReducerTerm | None  # None off CUDA (a CPU device adds on its copy worker)

    @property
    def gpu_idle_fraction(self) -> float:
        return max(0.0, 1.0 - self.gpu_busy_s / self.step_s) if self.step_s > 0 else 0.0

    @property
    def idle_cause(self) -> str:
        """The term that idles the device longest ("none" when it never waits)."""
        worst = max(self.idle_s, key=lambda k: self.idle_s[k], default=None)
        return worst if worst is not None and self.idle_s[worst] > 0 else "none"

    def to_dict(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "gpu_busy_s": self.gpu_busy_s, "gpu_idle_fraction": self.gpu_idle_fraction,
                "idle_cause": self.idle_cause, "idle_s": dict(self.idle_s), "link_busy_s": dict(self.link_busy_s),
                "host_busy_s": dict(self.host_busy_s), "optimizer_overlap": self.optimizer_overlap,
                "reducer": None if self.reducer is None else dict(vars(self.reducer))}


def step_timeline(p: Point, hw: Hardware, t: Time) -> StepTimeline:
    """The timeline of a planned megatrain step `t` at `p` on `hw`."""
    busy = t.busy_s
    host = {k.removeprefix("host "): v for k, v in busy.items() if k.startswith("host ")}
    if SERIAL in host:
        # The engine rounds on a worker of its own (engine/host/resident_upload.py): the launch thread spends only
        # the update; the device waits for both (idle_s), the rounding as the forward's fence on that worker.
        both, rounding = host.pop(SERIAL), t.idle_s.get(IDLE_ROUND, 0.0)
        host[LAUNCH], host[ROUNDING] = both - rounding, rounding
    reducer = None
    # layers whose gradients the host reducer adds (an optimizer-resident layer's are added on the device)
    reduced = p.model.num_layers - (t.residency.optimizer if t.residency is not None else 0)
    if busy.get("host reducer", 0.0) > 0 and reduced:  # CUDA (the node path adds none at accumulation 1)
        per_layer = busy["host reducer"] / (p.grad_accum * reduced)
        nbytes = reducer_bytes_per_param(p)
        reducer = ReducerTerm(reducer_threads(hw), nbytes, p.model.layer_params() * nbytes / per_layer / 1e9,
                              per_layer, t.layer.bwd_compute, busy["host reducer"])
    return StepTimeline(t.step_s, busy["compute"], {"h2d": busy["link h2d"], "d2h": busy["link d2h"]}, host,
                        dict(t.idle_s), t.optimizer_overlap, reducer)


def ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def format_timeline(tl: StepTimeline) -> list[str]:
    """`megatrain plan`'s lines for it."""
    out = [f"  step timeline: GPU busy {ms(tl.gpu_busy_s)} of {ms(tl.step_s)}, GPU idle {tl.gpu_idle_fraction:.1%} "
           f"(most from: {tl.idle_cause}); optimizer_overlap {'on' if tl.optimizer_overlap else 'off'} "
           "(as the engine resolves it)",
           "    link busy: " + ", ".join(f"{k} {ms(v)}" for k, v in tl.link_busy_s.items())
           + "; host busy: " + ", ".join(f"{k} {ms(v)}" for k, v in tl.host_busy_s.items()),
           "    GPU idle by cause: " + (", ".join(f"{k} {ms(v)}" for k, v in
                                                sorted(tl.idle_s.items(), key=lambda kv: -kv[1]) if v >= 5e-5) or "none")]
    r = tl.reducer
    if r is not None:
        out.append(f"    reducer: {r.threads} thread(s), {r.bytes_per_param} B/param at {r.gbs:.3g} GB/s -> "
                   f"{ms(r.per_layer_s)} per layer against {ms(r.per_layer_backward_s)} of backward compute"
                   + (" (it paces backward)" if r.per_layer_s > r.per_layer_backward_s else ""))
    return out
