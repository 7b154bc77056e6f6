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

Speed: split and join run on every layer of every step, so they are one pass each over memory. A few lines
of C (below) are compiled on first use with the system's C compiler, cached under `$MEGATRAIN_CACHE`, and
called through ctypes (which releases the GIL); large tensors are cut into one range per torch thread.
Without a compiler (or with MEGATRAIN_HILO_KERNEL=torch) the same bits come from torch ops over
cache-sized tiles: torch's own bf16 conversion for tiles that hold no NaN (it is RNE on the bits; a
self-check at first use proves it on the cases that could differ, else the integer formula runs), and
the integer formula for tiles that do.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator

import torch

from ...files import env
from ..runtime import ckernel
from ..runtime.threads import WorkerPool, team

_CHUNK = 1 << 18  # elements per torch tile: its int32/FP32 temporaries stay in the core's cache
TILE = _CHUNK  # the same for other element-wise passes over a layer (the store's gradient widening)
_NAN_HI = 0x7FC0
_EXP_MASK = 0x7F800000
_NAN_BITS = int(torch.tensor(float("nan")).view(torch.int32))  # what fill_(nan) writes: the poison pattern
_TIE_CAP = 1024  # tie positions per kernel call before it hands back for a bigger buffer (rarely reached)
_PARALLEL_MIN = 1 << 21  # elements: below this one range (threads cost more than they save)

# One pass per element; a block's tie positions are written only when it has any (rare). The formulas are
# the ones of _split_tile / _join_tile below, on unsigned words (the same bits modulo 2^16 / 2^32).

_RANGES = WorkerPool("hilo")  # the ranges of one large split/join run side by side here
_torch_convert_ok: bool | None = None
_poisoning = threading.local()


@contextlib.contextmanager
def poisoning(x: torch.Tensor) -> Iterator[list[bool]]:
    """Within it, this thread's split of exactly `x` (the same tensor object) poisons it as
    split(..., poison=True) does; the yielded list is non-empty once that happened, else the caller still
    fills (whatever stands in for split then, e.g. a wrapper that calls it, the result is the same)."""
    done: list[bool] = []
    _poisoning.target = (x, done)
    try:
        yield done
    finally:
        _poisoning.target = None


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32
    lib.hilo_split.argtypes = [p, p, p, i64, i64, p, i64, p, p, u32]
    lib.hilo_split.restype = i64
    lib.hilo_join.argtypes = [p, p, p, i64]
    lib.hilo_join.restype = None


_KERNEL = ckernel.LazyKernel("hilo", _declare, env.HILO_KERNEL)


def kernel() -> ctypes.CDLL | None:
    """The compiled split/join, or None where there is no C compiler (or MEGATRAIN_HILO_KERNEL=torch)."""
    return _KERNEL.get()


def _ranges(n: int) -> list[tuple[int, int]]:
    parts = max(1, min(team(), n // _PARALLEL_MIN))
    step = -(-n // parts)
    return [(s, min(n, s + step)) for s in range(0, n, step)]


def _run(fn, ranges: list[tuple[int, int]]) -> list:
    if len(ranges) == 1:
        return [fn(*ranges[0])]
    return list(_RANGES.get(len(ranges)).map(lambda r: fn(*r), ranges))


def _check(x: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, what: str) -> None:
    if x.dtype != torch.float32 or hi.dtype != torch.bfloat16 or lo.dtype != torch.int16:
        if what == "split":
            raise TypeError(f"split takes float32 -> (bfloat16, int16), got {x.dtype} -> ({hi.dtype}, {lo.dtype})")
        raise TypeError(f"join takes (bfloat16, int16) -> float32, got ({hi.dtype}, {lo.dtype}) -> {x.dtype}")
    if not (x.numel() == hi.numel() == lo.numel()):
        raise ValueError(f"{what}: sizes differ ({x.numel()}, {hi.numel()}, {lo.numel()})")


def split(x: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, poison: bool = False) -> torch.Tensor:
    """Write hi (bf16) and lo (int16) for the FP32 values `x` (1-D, contiguous); return the positions
    (int64, ascending) whose RNE rounded up at an exact tie. `poison`: overwrite `x` with NaN as it is read
    (the store's shared scratch, in the same pass rather than a fill after it)."""
    _check(x, hi, lo, "split")
    target = getattr(_poisoning, "target", None)
    if target is not None and target[0] is x and x.is_contiguous():  # (a reshape below would copy it)
        poison = True
        target[1].append(True)
    u_all = x.reshape(-1).view(torch.int32)
    hi_all, lo_all = hi.reshape(-1).view(torch.int16), lo.reshape(-1)
    lib = kernel()
    if lib is not None and u_all.is_contiguous() and hi_all.is_contiguous() and lo_all.is_contiguous():
        def part(a: int, b: int) -> torch.Tensor:
            return _split_c(lib, u_all[a:b], hi_all[a:b], lo_all[a:b], a, poison)
        ties = [t for t in _run(part, _ranges(u_all.numel())) if t.numel()]
    else:
        ties = []
        for s in range(0, u_all.numel(), _CHUNK):
            t = _split_tile(u_all[s: s + _CHUNK], hi_all[s: s + _CHUNK], lo_all[s: s + _CHUNK])
            if t is not None:
                ties.append(t + s)
            if poison:
                u_all[s: s + _CHUNK].fill_(_NAN_BITS)
    return torch.cat(ties) if ties else torch.empty(0, dtype=torch.int64)


def _split_c(lib: ctypes.CDLL, u: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, base: int,
             poison: bool) -> torch.Tensor:
    n, done, out = u.numel(), 0, []
    buf = torch.empty(_TIE_CAP, dtype=torch.int64)
    count = ctypes.c_int64(0)
    while True:
        stop = lib.hilo_split(u.data_ptr() + 4 * done, hi.data_ptr() + 2 * done, lo.data_ptr() + 2 * done,
                              n - done, base + done, buf.data_ptr(), buf.numel(), ctypes.byref(count),
                              u.data_ptr() + 4 * done if poison else None, _NAN_BITS & 0xFFFFFFFF)
        out.append(buf[: count.value].clone())
        done += stop
        if done >= n:
            break
        buf = torch.empty(2 * buf.numel(), dtype=torch.int64)  # a block's ties did not fit: more room, go on
        count.value = 0
    return torch.cat(out)


def _torch_converts_exactly() -> bool:
    """Whether torch's FP32 -> bf16 conversion is RNE on the bits for every non-NaN input class where a
    conversion could differ (subnormals, ties of both parities, carries into the exponent and to infinity),
    through its vectorized loop as well as its tail. NaN is not asked: tiles holding one take the formula."""
    global _torch_convert_ok
    if _torch_convert_ok is None:
        uppers = torch.tensor([0x0000, 0x0001, 0x007F, 0x0080, 0x3F7F, 0x3F80, 0x7F7E, 0x7F7F, 0x7F80,
                               0x8000, 0x8001, 0x807F, 0x8080, 0xBF80, 0xFF7F, 0xFF80], dtype=torch.int64)
        lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
        w = ((uppers[:, None] << 16) | lows[None, :]).flatten().repeat(8)
        u = torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)
        hi, ref = torch.empty(u.numel(), dtype=torch.int16), torch.empty(u.numel(), dtype=torch.int16)
        hi.view(torch.bfloat16).copy_(u.view(torch.float32))
        _split_bits(u, ref, torch.empty_like(ref))
        finite = ~torch.isnan(u.view(torch.float32))  # NaN tiles never take this path
        _torch_convert_ok = torch.equal(hi[finite], ref[finite])
    return _torch_convert_ok


def _split_bits(u: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The integer formula on one tile (hi viewed as int16); returns the tile's tie-up mask."""
    low = u & 0xFFFF
    up = u >> 16  # arithmetic shift: the upper half, sign-extended (its low 16 bits are the pattern)
    nan = (u & 0x7FFFFFFF) > _EXP_MASK
    # RNE on the bits: add half an ulp of bf16, plus one when the kept half is odd (ties to even).
    rne = (up + ((low + 0x7FFF + (up & 1)) >> 16))
    hi.copy_(torch.where(nan, _NAN_HI, rne))  # int32 -> int16 keeps the low 16 bits
    low.masked_fill_(nan, 0)
    lo.copy_(low)
    return ((u & 0x1FFFF) == 0x18000) & ~nan  # lo exactly 0x8000, upper half odd: rounded up


def _split_tile(u: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor | None:
    """One tile with torch ops; its tie-up positions (tile-relative), or None."""
    x = u.view(torch.float32)
    if not torch.isnan(x.sum()) and _torch_converts_exactly():
        # No NaN here (a NaN makes the sum NaN; inf - inf also lands here, harmlessly): the conversion
        # is the RNE, and lo is the word's low half (int32 -> int16 keeps the low 16 bits).
        hi.view(torch.bfloat16).copy_(x)
        lo.copy_(u)
        if int(lo.min()) != -0x8000:  # no lo of 0x8000 in the tile: no tie
            return None
        cand = _positions(lo == -0x8000)
        t = cand[((u[cand] >> 16) & 1) == 1]
        return t if t.numel() else None
    t = _positions(_split_bits(u, hi, lo))
    return t if t.numel() else None


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """mask.nonzero() of a sparse 1-D bool mask, ascending: the search runs over its bytes eight at a time
    (as int64 words), several times cheaper than nonzero over every element."""
    n = mask.numel()
    k = n - n % 8
    words = mask[:k].view(torch.int64).nonzero().flatten()
    idx = mask[:k].view(-1, 8)[words].nonzero()
    pos = words[idx[:, 0]] * 8 + idx[:, 1]
    return torch.cat([pos, mask[k:].nonzero().flatten() + k]) if k < n else pos


def join(hi: torch.Tensor, lo: torch.Tensor, ties: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The FP32 values whose split gave (hi, lo, ties), written into `out` (1-D FP32) and returned."""
    _check(out, hi, lo, "join")
    u_all = out.reshape(-1).view(torch.int32)
    hi_all, lo_all = hi.reshape(-1).view(torch.int16), lo.reshape(-1)
    lib = kernel()
    if lib is not None and u_all.is_contiguous() and hi_all.is_contiguous() and lo_all.is_contiguous():
        def part(a: int, b: int) -> None:
            lib.hilo_join(hi_all[a:b].data_ptr(), lo_all[a:b].data_ptr(), u_all[a:b].data_ptr(), b - a)
        _run(part, _ranges(u_all.numel()))
    else:
        for s in range(0, u_all.numel(), _CHUNK):
            _join_tile(hi_all[s: s + _CHUNK], lo_all[s: s + _CHUNK], u_all[s: s + _CHUNK])
    if ties.numel():
        u_all[ties] -= 65536
    return out


def _join_tile(hi: torch.Tensor, lo: torch.Tensor, u: torch.Tensor) -> None:
    # bf16 -> FP32 is exact (hi's bits shifted up), then + lo sign-extended: a lo above 0x8000 is lo - 65536,
    # i.e. hi - 1 in the upper half, as the rule says. A lo of exactly 0x8000 reads as -0x8000 that way: put
    # back the 65536 (the ties that rounded up take it off again, after).
    u.view(torch.float32).copy_(hi.view(torch.bfloat16))
    u.add_(lo)
    if int(lo.min()) == -0x8000:
        u[_positions(lo == -0x8000)] += 65536
