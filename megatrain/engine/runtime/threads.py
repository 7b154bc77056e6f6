"""How many torch (OpenMP) threads one host thread's torch ops use, set for that thread alone.

`torch.set_num_threads(n)` sets the calling thread's OpenMP team, and also torch's process-wide count, which
every thread started later takes as its own at its first torch op. Called in a helper thread (a fused-pass
worker taking one core, the reducer taking a quarter), it would leave every thread started afterwards (the next
engine's optimizer thread, a data loader's workers) on that helper's share: measured, a second engine's fused
pass ran on one worker instead of two. `set_team` sets this thread's team only, through the OpenMP runtime torch
loaded; where none is found (a torch built without OpenMP) it falls back to torch's call.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    try:  # torch loads its OpenMP runtime into the global namespace (libtorch_global_deps)
        return ctypes.CDLL(None).omp_set_num_threads
    except (AttributeError, OSError):
        return None


def set_team(n: int) -> None:
    """Run this thread's torch ops on `n` threads, leaving every other thread's count (and new threads') as is."""
    if n < 1:
        raise ValueError(f"a thread team needs at least 1 thread, got {n}")
    # torch sets a thread's team from its process-wide count at the thread's first parallel op (once per thread):
    # take that first, or it would overwrite the team set here.
    torch.get_num_threads()
    fn = _omp_set_num_threads()
    if fn is None:
        torch.set_num_threads(n)
    else:
        fn(n)


# The launch thread (queueing compute and copies, or computing on a CPU device) and the copy threads (issuing each
# link's jobs) keep a core each while an update runs beside them.
RESERVED_CORES = 2


def update_threads(beside_compute: bool, cores: int | None = None) -> int:
    """Workers for the host update's pool: every core when it runs alone (a step that waits for it), else every core
    but the launch and copy threads' (RESERVED_CORES): an update overlapped with the next forward (or in backward)
    that takes all of them makes those threads wait for a core, and the device for them. At least one."""
    n = cores if cores is not None else torch.get_num_threads()
    return max(1, n - RESERVED_CORES) if beside_compute else max(1, n)
