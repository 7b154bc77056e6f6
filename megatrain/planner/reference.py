"""The reference a user whose model fits the device would run: plain PyTorch with everything on the device, no
gradient checkpointing, fused AdamW on the device. `megatrain plan` prints its step beside megatrain's where the
whole training state fits (bf16 weights + FP32 masters + Adam state + gradients + activations); megatrain's
target there is a step within TORCH_TARGET of it."""

from __future__ import annotations

from .estimate import plan_point
from .point import with_point
from .prediction import Plan

TORCH_TARGET = 1.10  # megatrain's step at most this many times plain PyTorch's, where the model fits


def torch_reference(pl: Plan) -> Plan | None:
    """Plain PyTorch at `pl`'s point and hardware, or None where it does not fit (or `pl` is not megatrain's)."""
    if pl.point.backend != "megatrain":
        return None
    ref = plan_point(with_point(pl.point, backend="torch", gradient_checkpointing=False), pl.hardware)
    return ref if ref.fits else None


def reference_line(pl: Plan, ref: Plan) -> str:
    """`megatrain plan`'s line for it."""
    ratio = pl.time.step_s / ref.time.step_s
    verdict = "within" if ratio <= TORCH_TARGET else "OUTSIDE"
    return (f"  plain PyTorch here (the whole model fits the device: no checkpointing, fused AdamW on the device): "
            f"step {ref.time.step_s * 1e3:,.1f} ms, {ref.model_tflops:.1f} TFLOPS, device "
            f"{ref.memory.device_total / 2**30:.2f} GiB; megatrain's step is {ratio:.2f}x its, {verdict} the "
            f"{TORCH_TARGET:.2f}x target")
