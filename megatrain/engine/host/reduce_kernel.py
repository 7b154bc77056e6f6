"""Backward's reduction of a layer's gradients into its FP32 slab and the slab's norm, in one pass.

The reducer used to add (or write, the first time after zero_grad) the gradients into the slab, then read the
whole slab again for `torch.linalg.vector_norm` (slab_state.py): ~14 B/param from bf16 gradients. Here one loop
reads the gradient, writes the slab and squares the value it wrote into eight lanes, ~10 B/param, with the bits
of both passes: torch's 2-norm of a contiguous FP32 tensor on the CPU is one sequential loop over 8-float
vectors (products rounded, then added: no fused multiply-add), the lanes then summed in order, and a float
square root (measured: the same bits on every one of 2,000 probes up to 4M elements). Its last numel % 8
elements take a path not reproduced here (most probes matched, not all), so a slab whose size is not a
multiple of 8 keeps the two passes (every layer of a real model is one). The order is what makes it exact; it
is also why it runs on one core (a split into ranges would add the lanes in another order), so it is taken only
where the two passes it replaces had at most two threads between them (`pays`). The self-check at build
compares the result with torch's on probe data, and a kernel that does not match is not used.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading

import torch

from ..runtime import ckernel

LANES = 8
FUSED_MAX_THREADS = 2  # the two passes on k threads: 10/k + 4 B/param on the slowest thread, against 10 here

_C_SOURCE = r"""
#include <string.h>
#include <math.h>

static inline float widen(const void *src, int64_t bf16, int64_t i) {
    float g;
    if (bf16) { uint32_t u = ((uint32_t)((const uint16_t *)src)[i]) << 16; memcpy(&g, &u, 4); }
    else g = ((const float *)src)[i];
    return g;
}

static inline float widen16(uint16_t h) { uint32_t u = ((uint32_t)h) << 16; float g; memcpy(&g, &u, 4); return g; }

/* Whole 8-blocks: the values written, their squares into the 8 lanes. One function per case, on restrict
   pointers, with nothing but the arithmetic in the loop: each vectorizes (measured: with an exponent-bit test in
   the loop it stayed scalar, and the add ran at a third of the bandwidth). A non-finite value written makes its
   lane, and so the norm, inf or NaN: the finite flag is read off the norm. */
#define BODY_FN(NAME, T, OLD, G) \
__attribute__((noinline)) static uint32_t NAME(const T *__restrict s, float *__restrict d, int64_t n, float *__restrict lanes) { \
    float acc[8]; \
    memcpy(acc, lanes, sizeof acc); \
    for (int64_t i = 0; i + 8 <= n; i += 8) { \
        for (int j = 0; j < 8; j++) { \
            float v = (OLD) + (G); \
            d[i + j] = v; \
            acc[j] = acc[j] + v * v; \
        } \
    } \
    memcpy(lanes, acc, sizeof acc); \
    return 0; \
}
BODY_FN(first_bf16, uint16_t, 0.0f, widen16(s[i + j]))
BODY_FN(add_bf16, uint16_t, d[i + j], widen16(s[i + j]))
BODY_FN(first_fp32, float, 0.0f, s[i + j])
BODY_FN(add_fp32, float, d[i + j], s[i + j])

/* dst[0..n) = (first ? 0 + g : dst + g), g from src (FP32, or bf16 widened); the squares of the values written
   go to lanes[(off + i) % 8] for off + i < body_end (the slab's whole 8-blocks). Returns 1 if a written value is
   not finite. */
int64_t reduce_range(const void *src, int64_t bf16, float *dst, int64_t off, int64_t n, int64_t first,
                     int64_t body_end, float *lanes) {
    uint32_t bad = 0;
    int64_t i = 0;
    while (i < n && ((off + i) & 7)) {
        float v = first ? 0.0f + widen(src, bf16, i) : dst[i] + widen(src, bf16, i);
        dst[i] = v;
        if (off + i < body_end) lanes[(off + i) & 7] = lanes[(off + i) & 7] + v * v;
        uint32_t b; memcpy(&b, &v, 4); bad |= (b & 0x7F800000u) == 0x7F800000u;
        i++;
    }
    int64_t stop = body_end - off < n ? body_end - off : n;
    int64_t m = stop > i ? (stop - i) / 8 * 8 : 0;
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src + i;
        bad |= first ? first_bf16(s, dst + i, m, lanes) : add_bf16(s, dst + i, m, lanes);
    } else {
        const float *s = (const float *)src + i;
        bad |= first ? first_fp32(s, dst + i, m, lanes) : add_fp32(s, dst + i, m, lanes);
    }
    i += m;
    for (; i < n; i++) {
        float v = first ? 0.0f + widen(src, bf16, i) : dst[i] + widen(src, bf16, i);
        dst[i] = v;
        if (off + i < body_end) lanes[(off + i) & 7] = lanes[(off + i) & 7] + v * v;
        uint32_t b; memcpy(&b, &v, 4); bad |= (b & 0x7F800000u) == 0x7F800000u;
    }
    return bad != 0;
}

/* The norm: the lanes added in order, its square root. */
float finish_norm(const float *lanes) {
    float b = lanes[0];
    for (int j = 1; j < 8; j++) b = b + lanes[j];
    return sqrtf(b);
}
"""

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: ctypes.CDLL | None | bool = False  # False: not tried; None: not used


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.reduce_range.argtypes = [p, i64, p, i64, i64, i64, i64, p]
    lib.reduce_range.restype = i64
    lib.finish_norm.argtypes = [p]
    lib.finish_norm.restype = ctypes.c_float


def kernel() -> ctypes.CDLL | None:
    """The compiled reduction, or None: no compiler, MEGATRAIN_REDUCE_KERNEL=torch, or its self-check failed."""
    global _state
    if _state is False:
        with _lock:
            if _state is False:
                lib = ckernel.build("reduce", _C_SOURCE, _declare, "MEGATRAIN_REDUCE_KERNEL")
                _state = lib if lib is not None and _matches_torch(lib) else None
                if lib is not None and _state is None:
                    log.warning("reduce kernel: its norm does not give torch.linalg.vector_norm's bits on this "
                                "build; backward reduces and measures in two torch passes")
    return _state  # type: ignore[return-value]


def pays(threads: int | None) -> bool:
    """Whether the one-core pass beats the two passes it replaces on `threads` (None: torch's count)."""
    return (threads if threads is not None else torch.get_num_threads()) <= FUSED_MAX_THREADS


def usable(slab: torch.Tensor, parts: list[tuple[int, torch.Tensor]]) -> bool:
    """Whether `parts` ((offset, gradient) pairs) cover the FP32 `slab` (a multiple of 8 elements) in order with
    contiguous FP32/bf16 host tensors."""
    if slab.dtype != torch.float32 or not slab.is_contiguous() or slab.numel() % LANES:
        return False
    at = 0
    for off, g in parts:
        if off != at or g.dtype not in (torch.float32, torch.bfloat16) or not g.is_contiguous() or g.device.type != "cpu":
            return False
        at += g.numel()
    return at == slab.numel()


def reduce_and_norm(lib: ctypes.CDLL, slab: torch.Tensor, parts: list[tuple[int, torch.Tensor]],
                    first: bool) -> tuple[torch.Tensor, bool]:
    """Add (or, `first`, write 0 + g) every part into `slab` and return (the slab's 2-norm as torch's
    vector_norm gives it, whether it is finite: every value written finite and their norm within float's range).
    Call only where usable() said so."""
    n = slab.numel()
    body_end = n - n % LANES
    lanes = torch.zeros(LANES, dtype=torch.float32)
    bad = 0
    for off, g in parts:
        if g.numel():
            bad |= lib.reduce_range(g.data_ptr(), int(g.dtype == torch.bfloat16), slab.data_ptr() + 4 * off, off,
                                    g.numel(), int(first), body_end, lanes.data_ptr())
    norm = lib.finish_norm(lanes.data_ptr())
    torch.autograd.graph.increment_version(slab)  # written through a pointer: what an in-place add would show
    # A non-finite value written makes the norm inf or NaN; a norm past float's range reads as non-finite too, as
    # the step's own check of the norm takes it.
    return torch.tensor(norm, dtype=torch.float32), not bad and math.isfinite(norm)


def _probe(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)


def _matches_torch(lib: ctypes.CDLL) -> bool:
    gen = torch.Generator().manual_seed(0)
    for n, cuts, first, dtype in [(4096, [0, 13, 1000], True, torch.bfloat16), (4104, [0, 7, 4096], False, torch.float32),
                                  (64, [0], False, torch.bfloat16), (8, [0, 3], True, torch.float32),
                                  (100008, [0, 50001], False, torch.bfloat16)]:
        base = _probe(n, gen)
        g = _probe(n, gen).to(dtype)
        want = base.clone()
        if first:
            torch.add(g, 0.0, out=want)
        else:
            want.add_(g.float())
        got = base.clone()
        bounds = [*cuts, n]
        parts = [(a, g[a:b]) for a, b in zip(bounds, bounds[1:])]
        norm, _ = reduce_and_norm(lib, got, parts, first)
        if not (torch.equal(got.view(torch.int32), want.view(torch.int32))
                and torch.equal(norm.view(torch.int32), torch.linalg.vector_norm(want).view(torch.int32))):
            return False
    return True
