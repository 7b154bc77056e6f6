"""Stochastic rounding of FP32 to bf16, for the bf16 master (host_master="bf16", bf16_rounding="stochastic").

Round-to-nearest drops every Adam update smaller than half a bf16 ulp of the weight (about 2^-9 of it), so a
bf16 master stops moving at small learning rates. Rounding up with probability equal to the dropped fraction
keeps each update in expectation: add 16 uniform random bits below the kept half, then truncate.
"""

from __future__ import annotations

import torch

_CHUNK = 1 << 20


def round_stochastic(x: torch.Tensor, out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Write bf16 values of the FP32 `x` into `out`, each rounded up with probability equal to the part
    of it below bf16 precision (unbiased); infinities stay, NaN becomes the canonical quiet NaN."""
    if x.dtype != torch.float32 or out.dtype != torch.bfloat16 or x.numel() != out.numel():
        raise TypeError(f"round_stochastic takes float32 -> bfloat16 of one size, got {x.dtype} {x.numel()} -> "
                        f"{out.dtype} {out.numel()}")
    u_all, o_all = x.reshape(-1).view(torch.int32), out.reshape(-1).view(torch.int16)
    for s in range(0, u_all.numel(), _CHUNK):
        u = u_all[s: s + _CHUNK]
        r = torch.randint(0, 1 << 16, u.shape, dtype=torch.int32, generator=generator)
        mag = u & 0x7FFFFFFF
        # Adding to the int32 pattern adds to the magnitude bits for either sign (no carry reaches the sign).
        v = torch.where(mag >= 0x7F800000, u, u + r) >> 16
        o_all[s: s + _CHUNK].copy_(torch.where(mag > 0x7F800000, 0x7FC0, v))
    return out
