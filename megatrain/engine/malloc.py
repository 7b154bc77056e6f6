"""The host allocator's mmap threshold, held fixed so that freed host transients leave the resident set.

glibc serves a block of at least M_MMAP_THRESHOLD bytes with its own mmap, which free() returns to the
OS at once; smaller blocks come from the heap, where freed memory stays resident until it happens to sit
at the top. By default the threshold is dynamic: each freed mmapped block raises it to that block's size
(up to 32 MiB). The engine frees the model's own weights as it packs them into the host store, which
raises the threshold to the largest weight, and from then on every layer transient below that size
(activations, recompute graphs, weight gradients) lands on the heap and its memory stays resident after
it is freed: measured on this project's CPU machine, peak RSS growth 8-10% above the live bytes
(tests/test_malloc.py, results/validation/host_memory.csv). Setting the threshold with mallopt also
turns the dynamic adjustment off, for the whole process; torch's pinned (CUDA) host memory is not
affected. Other C libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import platform

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MAX_MMAP_THRESHOLD = 32 * 2**20  # glibc's HEAP_MAX_SIZE / 2 on 64-bit: mallopt refuses more
MIN_MMAP_THRESHOLD = 4096  # a page: below it every small allocation would be a system call


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
