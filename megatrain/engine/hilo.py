"""Exact split FP32 master: a bf16 "hi" half that streams to the device as is, and a 16-bit "lo" remainder.

hi is the bf16 round-to-nearest-even (RNE) of the FP32 value, computed here on the bits (not by a CPU's
bf16 conversion instruction, some of which flush subnormals), and lo is the value's low 16 bits. The
upper 16 bits come back as hi, minus one when RNE rounded up, which lo tells apart: above 0x8000 it
rounded up, below it did not. At exactly 0x8000 (a tie) RNE rounded up iff the upper half was odd, and
then hi is even either way: the two values 2k.8000 and (2k-1).8000 both have hi = 2k and lo = 0x8000.
No 16-bit lo can tell them apart (an even hi has 65537 FP32 preimages, see test_hilo.py), so the ties that
rounded up are kept as a sorted list of positions, empty for almost every layer: a tie needs the low 16
bits to be exactly 0x8000 and the upper half odd, one value in 131072 of random bits.

Infinities and values that round to infinity come back exactly. A NaN comes back as the canonical quiet
NaN 0x7FC00000 (sign and payload dropped), which is also what the FP32 mode's bf16 shadow streams for it.
"""

from __future__ import annotations

import torch

_CHUNK = 1 << 20  # elements per pass: int32 temporaries stay in cache-friendly sizes
_NAN_HI = 0x7FC0
_EXP_MASK = 0x7F800000


def split(x: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Write hi (bf16) and lo (int16) for the FP32 values `x` (1-D, contiguous); return the positions
    (int64, ascending) whose RNE rounded up at an exact tie."""
    if x.dtype != torch.float32 or hi.dtype != torch.bfloat16 or lo.dtype != torch.int16:
        raise TypeError(f"split takes float32 -> (bfloat16, int16), got {x.dtype} -> ({hi.dtype}, {lo.dtype})")
    if not (x.numel() == hi.numel() == lo.numel()):
        raise ValueError(f"split: sizes differ ({x.numel()}, {hi.numel()}, {lo.numel()})")
    u_all = x.reshape(-1).view(torch.int32)
    hi_all, lo_all = hi.reshape(-1).view(torch.int16), lo.reshape(-1)
    ties = []
    for s in range(0, u_all.numel(), _CHUNK):
        u = u_all[s: s + _CHUNK]
        low = u & 0xFFFF
        up = u >> 16  # arithmetic shift: the upper half, sign-extended (its low 16 bits are the pattern)
        nan = (u & 0x7FFFFFFF) > _EXP_MASK
        # RNE on the bits: add half an ulp of bf16, plus one when the kept half is odd (ties to even).
        rne = (up + ((low + 0x7FFF + (up & 1)) >> 16))
        hi_all[s: s + _CHUNK].copy_(torch.where(nan, _NAN_HI, rne))  # int32 -> int16 keeps the low 16 bits
        low.masked_fill_(nan, 0)
        lo_all[s: s + _CHUNK].copy_(low)
        tie_up = ((u & 0x1FFFF) == 0x18000) & ~nan  # lo exactly 0x8000, upper half odd: rounded up
        if tie_up.any():
            ties.append(tie_up.nonzero().flatten() + s)
    return torch.cat(ties) if ties else torch.empty(0, dtype=torch.int64)


def join(hi: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The FP32 values whose split gave (hi, lo, ties), written into `out` (1-D FP32) and returned."""
    if out.dtype != torch.float32 or hi.dtype != torch.bfloat16 or lo.dtype != torch.int16:
        raise TypeError(f"join takes (bfloat16, int16) -> float32, got ({hi.dtype}, {lo.dtype}) -> {out.dtype}")
    if not (out.numel() == hi.numel() == lo.numel()):
        raise ValueError(f"join: sizes differ ({out.numel()}, {hi.numel()}, {lo.numel()})")
    u_all = out.reshape(-1).view(torch.int32)
    hi_all, lo_all = hi.reshape(-1).view(torch.int16), lo.reshape(-1)
    for s in range(0, u_all.numel(), _CHUNK):
        low = lo_all[s: s + _CHUNK].to(torch.int32) & 0xFFFF
        up = hi_all[s: s + _CHUNK].to(torch.int32) - (low > 0x8000).to(torch.int32)
        # up * 65536 wraps like a shift in int32 two's complement: the sign bit lands where it belongs.
        u_all[s: s + _CHUNK].copy_(up * 65536 + low)
    if ties.numel():
        u_all[ties] -= 65536
    return out
