"""Backward's reduction of a layer's gradients into its FP32 slab and the slab's norm, in one pass, on as many
threads as the reducer has.

The reducer used to add (or write, the first time after zero_grad) the gradients into the slab, then read the
whole slab again for its norm: ~14 B/param from bf16 gradients. Here one loop reads the gradient, writes the
slab and squares the value it wrote into eight lanes, ~10 B/param.

The norm is taken over a fixed decomposition of the slab into CHUNK-element chunks, whatever the thread count:
each chunk's norm is torch's 2-norm of that chunk (on the CPU one sequential loop over 8-float vectors, products
rounded, then added: no fused multiply-add; the lanes then summed in order, and a float square root: measured,
the same bits on every one of 2,000 probes up to 4M elements), and the chunks' norms are combined by torch's
norm of them (`combine`). Chunks are independent, so they split over threads, each chunk whole on one of them:
the bits do not depend on how many there are. slab_state.slab_norm is the same decomposition read from a
written slab (torch's row norms), so a norm measured as the slab lands equals the one read later, bit for bit.
A slab of at most one chunk has exactly torch's norm of the whole slab.

What got no gradient costs no add: a part without one (None: a weight no gradient reached, as an expert no token
was routed to) and every slab-aligned ZERO_BLOCK of zeros in a gradient (an unrouted expert's rows of a fused
experts tensor; a dense gradient's first block is not zero, so checking costs next to nothing) are set to zero
on a slab's first write and otherwise left as they are, read for the norm only when it is measured: the bits of
adding the zeros (a slab holds no -0: its zeros are written as 0 + g, and x + 0 is x), a -0 written into a
`.grad` by hand excepted, which an add of zeros would turn into +0.

A first write into a large slab (STREAM_MIN) streams past the caches where the build has AVX (`streams`): a plain
store reads each line before writing part of it, a third of the pass's traffic for a slab overwritten whole, and a
slab that large is read from memory at the step anyway. Same values, same lanes: the self-check runs first writes
both ways.

A chunk's last numel % 8 elements take a path of torch's not reproduced here (most probes matched, not all), so
a slab whose size is not a multiple of 8 keeps the two passes (every layer of a real model is one); CHUNK is a
multiple of 8, so only a slab's last chunk could have such a tail. The self-check at build compares the chunks'
norms with torch's on probe data, and a kernel that does not match is not used.
"""

from __future__ import annotations

import ctypes
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ...files import env
from ..runtime import ckernel
from ..runtime.threads import WorkerPool, host_cores, team

LANES = 8
# Elements per chunk of the norm's decomposition (a multiple of LANES; 4 MiB of FP32). Fixed, so the norm's bits
# do not depend on the thread count; large enough that a chunk's work dwarfs handing it to a thread (a 14B model's
# layer is ~330 chunks), and that a small model's slab is one chunk (torch's norm of the whole slab).
CHUNK = 1 << 20
ZERO_BLOCK = 2048  # elements: the slab-aligned blocks whose gradient is checked for all zeros (a #define of the C source)
# Elements (16 MiB of FP32) from which a slab's first write after zero_grad streams past the caches (non-temporal
# stores, where the build has them: `streams`): a slab this large is not in cache when the step reads it, and a
# plain store first reads each line it writes. Measured on this project's CPU machine, a 12.6M-element slab
# (a ~100M model's layer) written from FP32 gradients: 5.0 ms plain, 2.7 ms streamed (min of 10, one thread).
STREAM_MIN = 1 << 22


log = logging.getLogger(__name__)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.reduce_range.argtypes = [p, i64, p, i64, i64, i64, i64, p, i64, p]
    lib.reduce_range.restype = i64
    lib.finish_norm.argtypes = [p]
    lib.finish_norm.restype = ctypes.c_float
    lib.streamed.argtypes = []
    lib.streamed.restype = i64


def _accept(lib: ctypes.CDLL) -> ctypes.CDLL | None:
    if _matches_torch(lib):
        return lib
    log.warning("reduce kernel: its chunks' norms do not give torch.linalg.vector_norm's bits on this build; "
                "backward reduces and measures in two torch passes")
    return None


_KERNEL = ckernel.LazyKernel("reduce", _declare, env.REDUCE_KERNEL, _accept, {"ZERO_BLOCK": ZERO_BLOCK})


def kernel() -> ctypes.CDLL | None:
    """The compiled reduction, or None: no compiler, MEGATRAIN_REDUCE_KERNEL=torch, or its self-check failed."""
    return _KERNEL.get()


def streams(lib: ctypes.CDLL, slab: torch.Tensor, first: bool) -> bool:
    """Whether a reduction into `slab` writes it with streaming stores: a first write (nothing of the slab read),
    a slab of at least STREAM_MIN elements, a build that has them."""
    return bool(first and slab.numel() >= STREAM_MIN and lib.streamed())


def pays(threads: int | None) -> bool:
    """Whether the one pass beats the two it replaces on `threads` reducer threads (None: the calling thread's
    share): on any count, since its chunks split over as many threads as the two passes would run on (10 B/param
    against 14)."""
    return threads is None or threads >= 1


Parts = list[tuple[int, "torch.Tensor | None"]]  # (slab offset, gradient); None: that range got no gradient


def extents(parts: Parts, n: int) -> list[tuple[int, int, torch.Tensor | None]]:
    """(start, end, gradient) per part of a slab of `n` elements: a gradient's own length, a None part up to the
    next part's offset (or the slab's end)."""
    out = []
    for j, (off, g) in enumerate(parts):
        end = off + g.numel() if g is not None else (parts[j + 1][0] if j + 1 < len(parts) else n)
        out.append((off, end, g))
    return out


def usable(slab: torch.Tensor, parts: Parts) -> bool:
    """Whether `parts` ((offset, gradient or None) pairs) cover the FP32 `slab` (a multiple of 8 elements) in order
    with contiguous FP32/bf16 host tensors."""
    if slab.dtype != torch.float32 or not slab.is_contiguous() or slab.numel() % LANES:
        return False
    at = 0
    for off, end, g in extents(parts, slab.numel()):
        if off != at or end < off or g is not None and (g.dtype not in (torch.float32, torch.bfloat16)
                                                        or not g.is_contiguous() or g.device.type != "cpu"):
            return False
        at = end
    return at == slab.numel()


def chunks(n: int, chunk: int | None = None) -> int:
    """How many chunks of the norm's decomposition a slab of `n` elements has."""
    c = CHUNK if chunk is None else chunk
    return -(-n // c)


def combine(norms: torch.Tensor) -> torch.Tensor:
    """A slab's norm from its chunks' norms (in slab order): torch's norm of them, a 0-dim FP32 tensor; one chunk's
    norm as it is (torch's norm of the whole slab)."""
    if norms.numel() == 1:
        return norms.reshape(())
    return torch.linalg.vector_norm(norms)


_HELPERS = WorkerPool("megatrain-reduce-chunks")


def _helpers() -> ThreadPoolExecutor:
    """Threads that run chunk ranges beside the caller's own (ctypes releases the GIL for the call): at most this
    process's share of the cores (each call uses its caller's team of them)."""
    return _HELPERS.get(max(1, host_cores() - 1))


@dataclass
class Tally:
    """Gradient elements a reducer's passes took (`reduced`: read and written into the slab) and skipped (`skipped`:
    absent, or in zero blocks: an expert no token was routed to), summed over the reductions it is given to."""

    reduced: int = 0
    skipped: int = 0
    absent: int = 0  # of the skipped: parts with no gradient at all (None)


FLT_MAX = float(torch.finfo(torch.float32).max)


class Reduced(NamedTuple):
    norms: torch.Tensor  # each chunk's norm, in slab order (meaningful only where measured)
    finite: bool  # every value written finite
    skipped: int  # gradient elements skipped (absent, or in all-zero blocks)
    sumsq: float = 0.0  # the chunks' squared norms summed in double: whether their FP32 combination overflows


def reduce_chunks(lib: ctypes.CDLL, slab: torch.Tensor, parts: Parts, first: bool, threads: int | None = None,
                  chunk: int | None = None, measure: bool = True, stream: bool | None = None) -> Reduced:
    """Add (or, `first`, write 0 + g) every part into `slab`, on `threads` threads (None: the calling thread's share,
    threads.team: the reducer's share of the cores), each chunk's norm measured if `measure`. A part without a gradient
    (None) or a ZERO_BLOCK of zeros costs no add: set to zero on a first write, else left as it is (read for the
    norm only if `measure`); the slab's bits and the norms are those of adding the zeros. `chunk`: the
    decomposition's chunk (CHUNK; a multiple of 8). `stream`: a first write with streaming stores (the same bits;
    None: as `streams` decides). Call only where usable() said so."""
    n = slab.numel()
    mode = int(first) + int(first and (streams(lib, slab, first) if stream is None else bool(stream)))
    c = CHUNK if chunk is None else chunk
    if c <= 0 or c % LANES:
        raise ValueError(f"a chunk must be a positive multiple of {LANES} elements, got {c}")
    k = chunks(n, c)
    norms = torch.zeros(k, dtype=torch.float32)
    lanes = torch.zeros(k, LANES, dtype=torch.float32)  # each chunk's own
    live = [(lo, hi, g) for lo, hi, g in extents(parts, n) if hi > lo]
    dst, lanes_at = slab.data_ptr(), lanes.data_ptr()

    def run(c0: int, c1: int) -> tuple[int, int, float]:
        """Chunks [c0, c1): each written through reduce_range, part by part, into its own lanes, then finished."""
        bad, p, skipped, sumsq = 0, 0, ctypes.c_int64(0), 0.0
        for ci in range(c0, c1):
            a, b = ci * c, min(ci * c + c, n)
            while p < len(live) and live[p][1] <= a:
                p += 1
            q = p
            while q < len(live) and live[q][0] < b:
                start, end, g = live[q]
                lo, hi = max(a, start), min(b, end)
                if hi > lo:
                    src = 0 if g is None else g.data_ptr() + (lo - start) * g.element_size()
                    bad |= lib.reduce_range(src, int(g is not None and g.dtype == torch.bfloat16), dst + 4 * lo, lo,
                                            hi - lo, mode, n, lanes_at + 4 * LANES * ci, int(measure),
                                            ctypes.byref(skipped))
                q += 1
            if measure:
                v = lib.finish_norm(lanes_at + 4 * LANES * ci)
                norms[ci] = v
                sumsq += v * v
        return bad, skipped.value, sumsq

    t = max(1, min(team() if threads is None else threads, k))
    bounds = [k * j // t for j in range(t + 1)]
    helpers = [_helpers().submit(run, a, b) for a, b in zip(bounds[1:-1], bounds[2:])] if t > 1 else []
    bad, skipped, sumsq = run(bounds[0], bounds[1])
    for job in helpers:
        more_bad, more_skipped, more_sumsq = job.result()
        bad, skipped, sumsq = bad | more_bad, skipped + more_skipped, sumsq + more_sumsq
    torch.autograd.graph.increment_version(slab)  # written through a pointer: what an in-place add would show
    return Reduced(norms, not bad, skipped, sumsq)


def reduce_and_norm(lib: ctypes.CDLL, slab: torch.Tensor, parts: Parts, first: bool, threads: int | None = None,
                    measure: bool = True, tally: Tally | None = None) -> tuple[torch.Tensor, bool]:
    """reduce_chunks, then (the slab's 2-norm as slab_state.slab_norm gives it, whether it is finite: every value
    written finite and their norm within float's range); without `measure` the norm is not taken (NaN returned).
    `tally`: where the elements reduced and skipped are counted."""
    r = reduce_chunks(lib, slab, parts, first, threads, measure=measure)
    if tally is not None:
        tally.skipped += r.skipped
        tally.absent += _absent(parts, slab.numel())
        tally.reduced += sum(g.numel() for _, g in parts if g is not None) - r.skipped + _absent(parts, slab.numel())
    if not measure:
        return torch.tensor(float("nan")), r.finite
    norm = combine(r.norms)
    # A non-finite value written makes the norm inf or NaN; a norm past float's range reads as non-finite too, as
    # the step's own check of the norm takes it. Read off the chunks' Python floats: a tensor's float() here
    # would be one more host read of a tensor per layer inside the backward (the GPU check counts them).
    return norm, r.finite and math.isfinite(r.sumsq) and math.sqrt(r.sumsq) <= FLT_MAX


def _absent(parts: Parts, n: int) -> int:
    """Elements of the parts without a gradient (counted in reduce_range's skipped count too)."""
    return sum(hi - lo for lo, hi, g in extents(parts, n) if g is None)


def _probe(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)


def _matches_torch(lib: ctypes.CDLL) -> bool:
    """Whether each chunk's norm has the bits of torch's norm of that chunk (the written values those of torch's
    add), on one chunk and on several (a short last one among them), in both dtypes, first (plain and streamed
    stores) and adding, with zero blocks and a part without a gradient among them (their skipped add must leave the
    bits of adding zeros)."""
    gen = torch.Generator().manual_seed(0)
    for n, cuts, first, dtype, chunk, sparse in [
            (4096, [0, 13, 1000], True, torch.bfloat16, None, False),
            (4104, [0, 7, 4096], False, torch.float32, None, False),
            (64, [0], False, torch.bfloat16, None, False), (8, [0, 3], True, torch.float32, None, False),
            (100008, [0, 50001], False, torch.bfloat16, None, False),
            (100008, [0, 4093, 50001], True, torch.bfloat16, 8000, False),
            (20000, [0, 17], False, torch.float32, 4096, False),
            (40000, [0, 5000, 9001, 30000], False, torch.bfloat16, 8192, True),
            (40000, [0, 5000, 9001, 30000], True, torch.float32, 8192, True)]:
        base = _probe(n, gen)
        g = _probe(n, gen).to(dtype)
        bounds = [*cuts, n]
        if sparse:  # an expert's rows of zeros (signed, too), and the second part absent
            g[2 * ZERO_BLOCK: 9 * ZERO_BLOCK // 2] = 0
            g[3 * ZERO_BLOCK: 3 * ZERO_BLOCK + 7] = -0.0
            g[bounds[1]: bounds[2]] = 0
        want = base.clone()
        if first:
            torch.add(g, 0.0, out=want)
        else:
            want.add_(g.float())
        parts = [(a, None if sparse and j == 1 else g[a:b]) for j, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        c = chunk or CHUNK
        ref = torch.stack([torch.linalg.vector_norm(want[a: a + c]) for a in range(0, n, c)])
        for stream in (False, True) if first else (False,):  # a first write both ways: streamed stores too
            got = base.clone()
            norms = reduce_chunks(lib, got, parts, first, threads=2, chunk=chunk, stream=stream).norms
            if not (torch.equal(got.view(torch.int32), want.view(torch.int32))
                    and torch.equal(norms.view(torch.int32), ref.view(torch.int32))):
                return False
    return True
