"""A plan: one point's predicted memory and time on one hardware profile, whether it fits, and the same
as a dict or as a flat row under the experiment harness's column names."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from ..costs.flops import model_flops_per_step
from .hardware import Hardware
from .memory import LongContext, Memory
from .placement import Placement
from .point import Point, engine_settings, with_point
from .step_time import Time, link_crossover_tokens
from .step_timeline import StepTimeline, step_timeline


@dataclass
class Plan:
    point: Point
    hardware: Hardware
    memory: Memory
    time: Time
    fits: bool
    reasons: list[str]
    decisions: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    long_context: LongContext | None = None  # megatrain only
    # What the engine would refuse about the point (a context beyond the model's positions, a host-memory mode
    # it does not run): `fits` answers for memory alone, `feasible` for memory and the engine together.
    refused: list[str] = field(default_factory=list)
    placement: Placement | None = None  # megatrain with residency "auto": the planner's search (placement.py)
    auto: Any = None  # host mode "auto": what it chose (auto_mode.py's AutoChoice); None for an explicit mode

    @property
    def settings(self) -> dict[str, Any]:
        """The "megatrain" config section that runs this plan: the point's settings, and the planner's placement
        where it differs from what the engine's "auto" would keep."""
        p = self.point
        if self.placement is not None and self.placement.differs:
            p = with_point(p, residency=self.placement.chosen)
        return engine_settings(p)

    @property
    def residency_line(self) -> str | None:
        """megatrain: "residency: W of L layers' weights on the device, A keep activations"."""
        lc = self.long_context
        return None if lc is None else lc.residency.describe(self.point.model.num_layers)

    @property
    def feasible(self) -> bool:
        """Whether the point fits in memory and the engine would run it (`megatrain plan`'s verdict)."""
        return self.fits and not self.refused

    @property
    def tokens_per_s(self) -> float:
        return self.point.tokens_per_step / self.time.step_s

    @property
    def model_flops(self) -> float:
        m = self.point.model
        # a mixture of experts: the parameters a token computes with (top-k experts), not all it stores
        return model_flops_per_step(m.active_nonembed_params(), m.num_layers, m.hidden, self.point.context,
                                    self.point.tokens_per_step)

    @property
    def model_tflops(self) -> float:
        return self.model_flops / self.time.step_s / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.time.step_s / self.hardware.peak_flops(self.point.dtype)

    @property
    def host_bytes_per_param(self) -> float:
        return self.memory.host_total / self.point.model.param_count()

    @property
    def host_store_bytes(self) -> int:
        """Model state on the host (the engine's host_store_bytes for megatrain)."""
        keys = ("master weights", "gradients", "adam m", "adam v", "bf16 shadow (streams)",
                "fp32 master weights", "fp32 gradients", "params (compute dtype)")
        return sum(v for k, v in self.memory.host.items() if k in keys)

    @property
    def device_weight_bytes(self) -> int:
        """Weights resident on the device (the engine's device_weight_bytes for megatrain)."""
        keys = ("layer buffers", "embedding/head/norm", "fetched layer params", "fetched embedding/head",
                "fp32 weights")
        return sum(v for k, v in self.memory.device.items() if k in keys)

    @property
    def crossover_tokens(self) -> float | None:
        """Tokens per micro-batch above which forward compute hides the weight stream (megatrain)."""
        return link_crossover_tokens(self.point, self.hardware) if self.point.backend != "torch" else None

    @property
    def timeline(self) -> StepTimeline | None:
        """megatrain: the step's GPU busy, link busy, host busy and GPU idle fraction with its causes."""
        return step_timeline(self.point, self.hardware, self.time) if self.point.backend == "megatrain" else None

    def to_dict(self) -> dict[str, Any]:
        p = self.point.as_dict()
        p["model"] = self.point.model.name
        return {
            "point": p,
            "hardware": self.hardware.name,
            "memory": {"host": dict(self.memory.host), "device": dict(self.memory.device),
                       "host_total": self.memory.host_total, "device_total": self.memory.device_total,
                       "pinned": self.memory.pinned, "unified": self.memory.unified},
            "time": dataclasses.asdict(self.time),
            "fits": self.feasible if self.auto is None else self.auto.fits,
            "memory_fits": self.fits,
            "host_mode": None if self.auto is None else self.auto.to_dict(),
            "refused": list(self.refused),
            "reasons": list(self.reasons) + list(self.refused),
            "decisions": dict(self.decisions),
            "warnings": list(self.warnings),
            "long_context": dataclasses.asdict(self.long_context) if self.long_context else None,
            "tokens_per_s": self.tokens_per_s,
            # the first screen's headline: the chosen mode's step (its NVMe time included), none where it does not fit
            "headline_step_s": self.time.step_s + self._nvme_added_s if self._fits_as_chosen else None,
            "headline_tokens_per_s": (self.point.tokens_per_step / (self.time.step_s + self._nvme_added_s)
                                      if self._fits_as_chosen else None),
            "model_tflops": self.model_tflops,
            "mfu": self.mfu,
            "host_bytes_per_param": self.host_bytes_per_param,
            "crossover_tokens": self.crossover_tokens,
            "timeline": None if self.timeline is None else self.timeline.to_dict(),
            "residency": self._residency_dict(),
        }

    @property
    def _fits_as_chosen(self) -> bool:
        return self.feasible if self.auto is None else self.auto.fits

    @property
    def _nvme_added_s(self) -> float:
        return self.auto.nvme.get("added_s", 0.0) if self.auto is not None and self.auto.mode.nvme else 0.0

    def _residency_dict(self) -> dict[str, Any] | None:
        """megatrain: the placement, and the per-step figures the engine reports to compare with (h2d_bytes,
        recomputed_layers)."""
        lc = self.long_context
        if lc is None:
            return None
        return {**lc.residency.to_dict(), "layers": self.point.model.num_layers, "line": self.residency_line,
                "h2d_bytes_per_step": self.time.h2d_bytes, "recomputed_layers_per_step": self.time.recomputed_layers,
                "kept_weight_bytes": lc.kept_weight_bytes, "kept_graph_bytes": lc.kept_graph_bytes,
                "room_bytes": lc.residency_room,
                "search": None if self.placement is None else self.placement.to_dict()}

    def to_row(self) -> dict[str, Any]:
        """A flat record marked source=predicted, with the harness's results column names where a
        column means the same thing (experiments/results.py), so predicted and measured rows join
        on backend, model, seq_len, micro_batch, grad_accum and precision."""
        p, t, m, hw = self.point, self.time, self.point.model, self.hardware
        g = p.grad_accum
        measured_peak = "measured by megatrain bench" in hw.sources.get("peak_bf16_tflops", "")
        return {
            "source": "predicted",
            "hardware": hw.name,
            "status": "ok" if self.feasible else "skipped",
            "reason": "" if self.feasible else "; ".join(r for r in self.reasons + self.refused if "DOES NOT FIT" in r),
            "backend": p.backend,
            "model": m.name,
            "family": m.family,
            "num_layers": m.num_layers,
            "hidden": m.hidden,
            "intermediate": m.intermediate,
            "heads": m.heads,
            "kv_heads": m.kv_heads,
            "vocab": m.vocab,
            "params": m.param_count(),
            "nonembed_params": m.nonembed_params(),
            "active_params": m.active_param_count(),
            "seq_len": p.context,
            "micro_batch": p.batch,
            "grad_accum": g,
            "tokens_per_step": p.tokens_per_step,
            "precision": "bf16" if p.c == 2 else "fp32",
            "recompute": t.recomputed_layers > 0,
            "recomputed_layers_per_step": t.recomputed_layers,
            "residency_weights": self.long_context.residency.weights if self.long_context else None,
            "residency_activations": self.long_context.residency.activations if self.long_context else None,
            "num_buffers": p.num_buffers if p.backend == "megatrain" else None,
            "offload_activations": self.decisions.get("offload_activations"),
            "mlp_tile_tokens": self.decisions.get("mlp_tile_tokens"),
            "master": p.master if p.backend == "megatrain" else None,
            "host_grad_dtype": p.host_grad_dtype if p.backend == "megatrain" else None,
            "optimizer_in_backward": p.optimizer_in_backward if p.backend == "megatrain" else None,
            "step_time_s": t.step_s,
            "tokens_per_s": self.tokens_per_s,
            "flops_per_step": self.model_flops,
            "model_tflops": self.model_tflops,
            "device_peak_tflops": hw.peak_flops(p.dtype) / 1e12,
            "peak_source": "measured" if measured_peak else "table",
            "mfu": self.mfu,
            "forward_s": t.forward_s * g,
            "backward_s": (t.backward_s + t.head_s) * g,
            "optimizer_s": t.optimizer_busy_s,
            "copy_wait_s": t.copy_wait_s,
            "breakdown_source": "predicted",
            "bottleneck": t.bottleneck,
            "gpu_idle_fraction": self.timeline.gpu_idle_fraction if self.timeline else None,
            "gpu_idle_cause": self.timeline.idle_cause if self.timeline else None,
            "peak_device_bytes": self.memory.device_total,
            "device_weight_bytes": self.device_weight_bytes,
            "host_bytes": self.memory.host_total,
            "host_store_bytes": self.host_store_bytes,
            "host_bytes_per_param": self.host_bytes_per_param,
            "streamed_weight_bytes": m.num_layers * m.layer_params() * p.c,
            "h2d_bytes_per_step": t.h2d_bytes,
            "d2h_bytes_per_step": t.d2h_bytes,
            "h2d_gbps": t.h2d_bytes / t.step_s / 1e9,
            "d2h_gbps": t.d2h_bytes / t.step_s / 1e9,
            "link_peak_h2d_gbps": hw.link_gbs_achieved,
            "link_util": t.h2d_bytes / t.step_s / 1e9 / hw.link_gbs_achieved,
            "crossover_tokens": self.crossover_tokens,
            "memory_host": json.dumps(self.memory.host, separators=(",", ":")),
            "memory_device": json.dumps(self.memory.device, separators=(",", ":")),
            **self._long_context_columns(),
        }

    def _long_context_columns(self) -> dict[str, Any]:
        lc = self.long_context
        if lc is None:
            return {}
        return {"loss_chunk_tokens": lc.loss_chunk,
                "layer_working_bytes": lc.layer_working_bytes, "loss_workspace_bytes": lc.loss_workspace_bytes,
                "boundary_device_bytes": lc.boundary_bytes, "kept_boundaries": lc.kept_boundaries,
                "offloaded_activation_bytes": self.memory.host.get("offloaded activations", 0),
                "policy_peak_device_bytes": lc.peak_bytes}
