"""The one definition of model FLOPs used by every backend, the planner and the reports."""

from __future__ import annotations


def model_flops_per_step(nonembed_params: int, num_layers: int, hidden: int, seq_len: int,
                         tokens_per_step: int, causal: bool = True) -> float:
    """6*N*T + 12*L*h*s*T*c (DESIGN.md). Recompute FLOPs are not counted; embeddings are not counted."""
    c = 0.5 if causal else 1.0
    return 6.0 * nonembed_params * tokens_per_step + 12.0 * num_layers * hidden * seq_len * tokens_per_step * c


def model_tflops(flops_per_step: float, step_time_s: float) -> float:
    return flops_per_step / step_time_s / 1e12
