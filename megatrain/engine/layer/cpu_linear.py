"""The layers' FP32 linears on a CPU device through oneDNN's GEMM in the forward.

torch's FP32 `F.linear` on the CPU is MKL's sgemm on `x @ W.T`; oneDNN's GEMM on the same operands ran 8-25%
faster for a ~100M Llama's layer shapes on the 2-core AMD EPYC (AVX-512) this project measures on (1024 tokens:
hidden 1024 -> 2752 36.1 vs 27.7 ms, 2752 -> 1024 30.1 vs 27.1 ms, 1024 -> 1024 11.5 vs 10.7 ms). Both are
IEEE FP32: the outputs differ by accumulation order, not precision. The backward is the two GEMMs autograd runs
for `F.linear`, with its operand order and layout (MmBackward of `x @ W.T`), so weight and input gradients
of the same output gradient have its bits. Used where the engine runs a layer in FP32 on a CPU device
(templates.py), after a self-check against `F.linear`; otherwise, and for anything but a float32 CPU linear,
`F.linear` runs as is.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# A self-check's bound on the relative difference from F.linear: FP32 accumulation-order noise is ~1e-7.
CHECK_RTOL = 1e-5


def _onednn(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x2, w, b, "none", [], "")


@functools.cache
def available() -> bool:
    """Whether this torch build has oneDNN's linear and it agrees with F.linear on probe data."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(s, generator=g) for s in ((67, 96), (80, 96), (80,)))
        for bias in (None, b):
            want, got = F.linear(x, w, bias), _onednn(x, w, bias)
            if got.shape != want.shape or ((got - want).abs().max() / want.abs().max()).item() > CHECK_RTOL:
                return False
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def for_device(device: torch.device, compute_dtype: torch.dtype) -> OneDnnLinears | None:
    """The linears a layer's calls take: oneDNN's on a CPU device computing in FP32 where it agrees with F.linear
    (faster FP32 GEMMs there), else None (F.linear)."""
    if device.type == "cpu" and compute_dtype == torch.float32 and available():
        return OneDnnLinears()
    return None


def _fresh(y: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`y` in `shape` as a tensor of its own, not a view: a model may write into a linear's output in place
    (Llama 4's MoE scales its router output), which autograd refuses on a custom Function's view output. The new
    tensor shares `y`'s storage (no copy); `y` itself is dropped, and the backward saves neither."""
    if y.shape == shape:
        return y
    stride, step = [], 1
    for n in reversed(shape):
        stride.insert(0, step)
        step *= n
    return y.new_empty(0).set_(y.untyped_storage(), y.storage_offset(), shape, stride)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        y = _onednn(x.reshape(-1, x.shape[-1]), w, b)
        return _fresh(y, (*x.shape[:-1], w.shape[0]))

    @staticmethod
    def backward(ctx, gy: torch.Tensor):  # noqa: ANN001, ANN205
        x, w = ctx.saved_tensors
        g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
        gx = g2.mm(w).view_as(x) if ctx.needs_input_grad[0] else None
        # as autograd's MmBackward gives W.T's gradient in W.T's layout: a contiguous W-shaped result, which the
        # slab's one-pass reduction takes (a transposed one would be copied strided)
        gw = g2.t().mm(x2) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def _usable(x: object, w: object, b: object) -> bool:
    return (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.device.type == "cpu"
            and x.dtype == torch.float32 and w.dtype == torch.float32 and x.dim() >= 1 and w.dim() == 2
            and x.shape[-1] == w.shape[1] and x.numel() > 0
            and (b is None or isinstance(b, torch.Tensor) and b.dtype == torch.float32 and b.dim() == 1))


class OneDnnLinears(TorchFunctionMode):
    """Within it, `F.linear` on float32 CPU tensors runs through oneDNN (forward) and autograd's own GEMMs
    (backward); `calls` counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is F.linear:
            x, w, b = (*args, *(kwargs.get(k) for k in ("input", "weight", "bias")[len(args):]))[:3]
            if _usable(x, w, b):
                self.calls += 1
                return _Linear.apply(x, w, b)
        return func(*args, **kwargs)
