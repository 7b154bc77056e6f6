"""The host allocator's mmap threshold, held fixed so that freed host transients leave the resident set.

glibc serves a block of at least M_MMAP_THRESHOLD bytes with its own mmap, which free() returns to the
OS at once; smaller blocks come from the heap, where freed memory stays resident for reuse. By default
the threshold is dynamic: each freed mmapped block raises it to that block's size (up to 32 MiB). The
engine frees the model's own weights as it packs them into the host store, which raises the threshold
to the largest weight, and from then on every layer transient below that size (activations, recompute
graphs, weight gradients) is served from the heap and stays resident once freed: peak RSS then sits
above the live bytes (measured on this project's CPU machine: results/validation/host_memory.csv).
Fixing the threshold (mallopt, which also stops the adaptation, for the whole process) brings RSS down
to the live bytes, paid for by page faults on every large transient: an opt-in
(EngineConfig.host_mmap_threshold_bytes). Other C libraries (musl, macOS) are left alone."""

from __future__ import annotations

import ctypes
import platform

from ...config.schema import MAX_MMAP_THRESHOLD, MIN_MMAP_THRESHOLD

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at `nbytes` (and stop it adapting); False where there is no glibc."""
    if not MIN_MMAP_THRESHOLD <= nbytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap threshold {nbytes!r} must be from {MIN_MMAP_THRESHOLD} (a page) to "
                         f"{MAX_MMAP_THRESHOLD} bytes (glibc's limit)")
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(int(nbytes))) == 1


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim); False where there is no glibc.

    The model's own weights are freed as they are packed into the host store, but a weight allocated after
    the threshold rose sits in the heap, and its freed pages stay resident under later allocations: measured,
    a user's FP32 model held ~3.3 B/param of RSS on after placement (results/bytes_at_depth/)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    return bool(libc.malloc_trim(ctypes.c_size_t(0)))
