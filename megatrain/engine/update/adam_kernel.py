"""A layer's whole AdamW step in one loop over memory: gradient in, master out, nothing in between.

The fused pass (fused.py) composed torch ops per tile: widen/scale the gradient into a scratch, join the hi/lo
master into another, torch's fused AdamW on the scratch, split it back. Each of those is a full read and write
of a tile, and the tiles are too big to stay in cache between them (smaller ones cost more in per-call overhead
than they save, results/host_passes). Here one C loop reads each element's gradient (FP32 or bf16, times the
pending clip scales), its master (FP32, hi + lo, or bf16), m and v once, and writes the master (and the bf16
copy that streams), m and v once: the bytes bound of experiments/studies/host_passes.py, with 1024-element
blocks of FP32 temporaries that never leave L1. The fused pass uses it for hi/lo and bf16 masters; an FP32
master is torch's kernel's own input, and there this loop measured no faster (results/host_passes), so the
FP32 kind serves the self-check below.

Its AdamW is the arithmetic of torch's fused CPU kernel's vector loop, operation for operation (IEEE
add/mul/div/sqrt round the same everywhere; what can differ between torch builds is which `a*b + c` its compiler
contracted into one fused multiply-add). At first use a self-check runs this kernel and torch's
`_fused_adam(w)_` on the same probe (random values over many magnitudes, zeros of both signs, subnormals, each
optimizer option) with each contraction variant and keeps the one whose bits match torch's everywhere; if none
does, the kernel is not used and the fused pass runs torch's own kernel, as it does where there is no C compiler
(or with MEGATRAIN_ADAM_KERNEL=torch). Only torch's vector loop is reproduced: a parameter's last `numel % 64`
elements (where torch's scalar tail may run) are left to the caller's torch path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import threading
import warnings
from dataclasses import dataclass

import torch

from ...files import env
from ..runtime import ckernel

ALIGN = 64  # the kernel takes whole blocks of 64 elements from a parameter's start: torch's vector loop's
_TIE_CAP = 1 << 13  # tie positions per call before it hands back (it stops a block early, never mid-block)
_BLOCK = 1024  # the C source's BLOCK

# flags (the C source's): what the loop does besides AdamW
ADAMW, MAXIMIZE, DECAY, GRAD_BF16, WRITE_BACK, PLUS_ZERO, CONTRACT = 1, 2, 4, 8, 16, 32, 64
MASTER_FP32, MASTER_HILO, MASTER_BF16 = 0, 1, 2


log = logging.getLogger(__name__)
_local = threading.local()  # each thread's tie buffer
_NO_TIES = torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True)
class Hyper:
    """One parameter group's AdamW settings at one step, as the kernel's doubles and flags."""

    values: torch.Tensor  # float64[7], the C source's hp
    flags: int

    @staticmethod
    @functools.lru_cache(maxsize=64)  # a layer's parameters share their group's settings and (mostly) step
    def of(adamw: bool, lr: float, beta1: float, beta2: float, weight_decay: float, eps: float, maximize: bool,
           step: float) -> Hyper:
        # In double, as torch's kernel computes them before rounding each to float.
        bc1, bc2 = 1 - math.pow(beta1, step), 1 - math.pow(beta2, step)
        hp = [1 - lr * weight_decay if adamw else weight_decay, 1 - beta1, beta2, 1 - beta2, math.sqrt(bc2), eps,
              -(lr / bc1)]
        flags = (ADAMW if adamw else 0) | (MAXIMIZE if maximize else 0) | (DECAY if weight_decay != 0 else 0)
        return Hyper(torch.tensor(hp, dtype=torch.float64), flags)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.adam_pass.argtypes = [p, p, i64, p, p, p, i64, p, p, i64, p, i64, i64, p, i64, p, p, i64]
    lib.adam_pass.restype = i64
    lib.all_finite.argtypes = [p, i64, i64]
    lib.all_finite.restype = i64


def _accept(lib: ctypes.CDLL) -> tuple[ctypes.CDLL, int] | None:
    for variant in (CONTRACT, 0):
        if _matches_torch(lib, variant):
            return lib, variant
    log.warning("adam kernel: no variant gives torch's fused AdamW bits on this build; the fused pass uses torch's "
                "kernel")
    return None


_KERNEL = ckernel.LazyKernel("adam", _declare, env.ADAM_KERNEL, _accept)


def kernel() -> tuple[ctypes.CDLL, int] | None:
    """(the compiled kernel, the contraction flag that reproduces this torch's bits), or None: no compiler,
    MEGATRAIN_ADAM_KERNEL=torch, or no variant matched torch's kernel on the self-check."""
    return _KERNEL.get()


# What the torch fallback costs, measured (results/host_passes): the per-layer update with torch's AdamW per
# tile instead of the one-loop kernel, in the hi/lo mode where it matters most, per parameter per step.
FALLBACK_COST = "the per-layer update ~1.6-1.9x slower in the hi/lo modes (results/host_passes: 0.85 against 0.54 ns/param)"


def prepare() -> bool:
    """Build and self-check the kernel now (at engine construction, not inside the first step on the optimizer
    thread); warn, naming what it costs, where it cannot be used for a reason other than being turned off."""
    if kernel() is not None:
        return True
    if not env.kernel_off(env.ADAM_KERNEL):
        why = "no C compiler found ($CC, cc or gcc)" if ckernel.compiler() is None else "its build or self-check failed"
        warnings.warn(f"compiled AdamW kernel unavailable: {why}; the update takes torch's kernel instead, "
                      f"{FALLBACK_COST}. Install a C compiler (or set CC) to get it back", stacklevel=3)
    return False


def step(lib: ctypes.CDLL, variant: int, hyper: Hyper, grad: torch.Tensor, coefs: torch.Tensor | None,
         write_back: bool, plus_zero: bool, kind: int, master: torch.Tensor | None, hi: torch.Tensor | None,
         lo: torch.Tensor | None, m: torch.Tensor, v: torch.Tensor, old_ties: torch.Tensor, base: int) -> torch.Tensor:
    """One contiguous range of a parameter (a multiple of ALIGN elements from its start): AdamW on `master`
    (kind FP32, `hi` its bf16 copy or None), or on the halves `hi`/`lo` (hilo; `old_ties` the range's tie
    positions, relative), or on the bf16 master `hi`. `grad` FP32 or bf16, times each of `coefs` (float32);
    `write_back`: store the scaled FP32 gradients (what a clip in place leaves); `plus_zero`: read 0 + g.
    Returns the range's new tie positions plus `base` (hilo), ascending."""
    n = m.numel()
    flags = hyper.flags | variant | (GRAD_BF16 if grad.dtype == torch.bfloat16 else 0)
    flags |= (WRITE_BACK if write_back else 0) | (PLUS_ZERO if plus_zero else 0)
    ncoef = 0 if coefs is None else coefs.numel()

    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    out, done = [], 0
    buf = _tie_buffer()
    count = ctypes.c_int64(0)
    while True:
        rel = old_ties[old_ties >= done] - done if old_ties.numel() and done else old_ties
        stop = lib.adam_pass(grad.data_ptr() + grad.element_size() * done, ptr(coefs), ncoef,
                             None if master is None else master.data_ptr() + 4 * done,
                             None if hi is None else hi.data_ptr() + 2 * done,
                             None if lo is None else lo.data_ptr() + 2 * done, kind,
                             m.data_ptr() + 4 * done, v.data_ptr() + 4 * done, n - done,
                             rel.data_ptr() if rel.numel() else None, rel.numel(), base + done,
                             buf.data_ptr(), buf.numel(), ctypes.byref(count), hyper.values.data_ptr(), flags)
        if count.value:
            out.append(buf[: count.value].clone())
        done += stop
        if done >= n:
            break
        count.value = 0  # a block's worth of room was left: hand the found ties over, go on from `done`
    if not out:
        return _NO_TIES
    return torch.cat(out)


def all_finite(lib: ctypes.CDLL, x: torch.Tensor) -> bool:
    """Whether the contiguous FP32 or bf16 `x` holds no infinity or NaN: one read of it, no temporaries."""
    return bool(lib.all_finite(x.data_ptr(), x.numel(), 1 if x.dtype == torch.bfloat16 else 0))


def _tie_buffer() -> torch.Tensor:
    buf = getattr(_local, "ties", None)
    if buf is None:
        buf = _local.ties = torch.empty(_TIE_CAP, dtype=torch.int64)
    return buf


def _probe_values(n: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 6)
    x[::97], x[1::89], x[2::101], x[3::103] = 0.0, -0.0, 1e-40, -3e-39
    return x


def _matches_torch(lib: ctypes.CDLL, variant: int) -> bool:
    gen = torch.Generator().manual_seed(0)
    n = ALIGN * 48
    cases = [(adamw, beta1, wd, maximize, st) for adamw in (True, False) for beta1 in (0.9, 0.3)
             for wd in (0.0, 0.05) for maximize in (False, True) for st in (1.0, 11.0)]
    for adamw, beta1, wd, maximize, st in cases:
        p, g = _probe_values(n, gen), _probe_values(n, gen)
        m, v = _probe_values(n, gen) * 1e-2, torch.rand(n, generator=gen) * 1e-3
        ref = [p.clone(), m.clone(), v.clone()]
        op = torch._fused_adamw_ if adamw else torch._fused_adam_
        op([ref[0]], [g.clone()], [ref[1]], [ref[2]], [], [torch.tensor(st)], amsgrad=False, lr=1e-3, beta1=beta1,
           beta2=0.95, weight_decay=wd, eps=1e-8, maximize=maximize, grad_scale=None, found_inf=None)
        hyper = Hyper.of(adamw, 1e-3, beta1, 0.95, wd, 1e-8, maximize, st)
        step(lib, variant, hyper, g, None, False, False, MASTER_FP32, p, None, None, m, v,
             torch.empty(0, dtype=torch.int64), 0)
        if not all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip((p, m, v), ref)):
            return False
    return True
