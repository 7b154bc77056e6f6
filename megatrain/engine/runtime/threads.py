"""How many torch (OpenMP) threads one host thread's torch ops use, set for that thread alone.

`torch.set_num_threads(n)` sets the calling thread's OpenMP team, and also torch's process-wide count, which
every thread started later takes as its own at its first torch op. Called in a helper thread (a fused-pass
worker taking one core, the reducer taking a quarter), it would leave every thread started afterwards (the next
engine's optimizer thread, a data loader's workers) on that helper's share: measured, a second engine's fused
pass ran on one worker instead of two. `set_team` sets this thread's team only, through the OpenMP runtime torch
loaded; where none is found (a torch built without OpenMP) it falls back to torch's call.

How many threads the host work gets in all is `host_cores()`: the CPUs this process may run on (its affinity, what
taskset, a cgroup cpuset or a scheduler gave it), capped by the cgroup's CPU quota (cgroup v2 `cpu.max`, v1
`cpu.cfs_quota_us`: Docker's `--cpus`, a Kubernetes CPU limit), shared among the node's ranks (`LOCAL_WORLD_SIZE`,
as torchrun, accelerate and the deepspeed launcher set it) once: under Slurm with a per-task CPU binding the
affinity is already this task's share and is not divided again. MEGATRAIN_HOST_THREADS names it outright. Never
torch's own count: `accelerate launch` always sets OMP_NUM_THREADS=1 and torchrun does with more than one process,
which left every host pool one thread; and N ranks of a node that each took every core oversubscribed it N-fold.
Bound to its GPU's NUMA node (numa.py), a rank's affinity is its own team's share of that node's CPUs (not divided
again), or, where the shares cannot be told, that node's CPUs shared by the ranks whose GPUs sit there
(`bound_ranks`), not by all of the machine's.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ...files import env


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    try:  # torch loads its OpenMP runtime into the global namespace (libtorch_global_deps)
        return ctypes.CDLL(None).omp_set_num_threads
    except (AttributeError, OSError):
        return None


OVERRIDE_ENV = env.HOST_THREADS
_local = threading.local()  # .team: what set_team gave this thread


def _positive(raw: str, name: str, fix: str) -> int | None:
    """`raw` (the variable `name` as written, stripped) as a positive count, None where empty."""
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name}={raw!r} is not a positive integer: {fix}")
    return n


def affinity_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; the machine's count where the OS has no such call)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def local_ranks() -> int:
    """Processes of this job on this node (LOCAL_WORLD_SIZE as the launchers set it; 1 without one)."""
    return _positive(os.environ.get("LOCAL_WORLD_SIZE", "").strip(), "LOCAL_WORLD_SIZE",
                     "set it to the number of processes on this node, or unset it") or 1


def local_rank() -> int | None:
    """This process's index among its node's (LOCAL_RANK as the launchers set it; None without one)."""
    raw = os.environ.get("LOCAL_RANK", "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"LOCAL_RANK={raw!r} is not a non-negative integer: set it to this process's index on "
                         "its node, or unset it")
    return n


# Where the cgroup files are read (tests point these at a fake tree).
CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


def _v2_quota(path: Path) -> float | None:
    """cpu.max's "QUOTA PERIOD" as CPUs, None for "max" (no limit) or no readable file."""
    try:
        quota, period = path.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def cgroup_cpu_quota() -> float | None:
    """The CPU quota of this process's cgroup in CPUs (2.5 for `--cpus=2.5`), the smallest along its path up to the
    root (a parent's limit holds for its children), None without one. cgroup v2's `cpu.max`; v1's cfs quota under
    the `cpu` controller's hierarchy."""
    try:
        lines = SELF_CGROUP.read_text().splitlines()
    except OSError:
        return None
    found: list[float] = []
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = Path(path.strip().lstrip("/"))
        if hid == "0" and controllers == "":  # v2 (the unified hierarchy)
            base, read = CGROUP_ROOT, lambda d: _v2_quota(d / "cpu.max")
        elif "cpu" in controllers.split(","):  # v1, mounted as cpu or cpu,cpuacct
            base = next((CGROUP_ROOT / n for n in (controllers, "cpu", "cpu,cpuacct")
                         if (CGROUP_ROOT / n).is_dir()), None)
            if base is None:
                continue
            read = _v1_quota
        else:
            continue
        for folder in [base / rel, *[base / p for p in rel.parents]]:
            q = read(folder)
            if q is not None:
                found.append(q)
    return min(found) if found else None


_node_ranks: int | None = None  # set by numa.apply: the ranks sharing the CPUs this process is bound to


def bound_ranks(n: int | None) -> None:
    """This process's threads are bound to CPUs of a NUMA node that `n` ranks share (1: a team of its own; None: not
    bound by MegaTrain)."""
    global _node_ranks
    if n is not None and n < 1:
        raise ValueError(f"a bound node is shared by at least 1 rank, got {n}")
    _node_ranks = n


def slurm_task_bound(cpus: int, ranks: int) -> bool:
    """Whether Slurm bound this task to CPUs of its own (a per-task cpuset), so that its affinity already is its
    share: a binding named by the step (SLURM_CPU_BIND_TYPE other than none), or this task's CPUs times the node's
    tasks within the job's CPUs on this node (unbound tasks each see all of them)."""
    if "SLURM_JOB_ID" not in os.environ:
        return False
    bind = os.environ.get("SLURM_CPU_BIND_TYPE", "").strip().rstrip(",").lower()
    if bind and not bind.startswith("none"):
        return True
    node = os.environ.get("SLURM_JOB_CPUS_PER_NODE", "").split(",")[0].split("(")[0]
    return node.isdigit() and ranks > 1 and cpus * ranks <= int(node)


def host_cores() -> int:
    """Threads this process's host work may use in all (every pool is sized from it): MEGATRAIN_HOST_THREADS
    where set, else this process's CPUs (affinity, capped by the cgroup's CPU quota, rounded down) over the node's
    ranks, at least one, divided once: a Slurm task bound to CPUs of its own keeps them. Ranks bound to cores of
    their own by another launcher should name their share with MEGATRAIN_HOST_THREADS: the masks of the other
    ranks are not seen here."""
    override = _positive(env.host_threads(), OVERRIDE_ENV,
                         "name the host threads this process may use, e.g. 8, or unset it")
    if override is not None:
        return override
    cpus, ranks = affinity_cpus(), local_ranks()
    # the node's CPUs and its cgroup's quota are shared by its ranks; a Slurm task's own binding (and cgroup) is not
    shared = 1 if slurm_task_bound(cpus, ranks) else ranks
    # bound to a NUMA node (numa.py): its own team's CPUs, or the node's shared by its ranks only; the quota by all
    share = cpus // (_node_ranks if _node_ranks is not None and shared > 1 else shared)
    quota = cgroup_cpu_quota()
    if quota is not None:
        share = min(share, math.floor(quota / shared + 1e-9))
    return max(1, share)


def team() -> int:
    """The calling thread's share of the host threads: what set_team gave it (a pool worker's 1, the reducer's
    quarter), else the whole process's (host_cores)."""
    return getattr(_local, "team", None) or host_cores()


def set_team(n: int) -> None:
    """Run this thread's torch ops on `n` threads, leaving every other thread's count (and new threads') as is."""
    if n < 1:
        raise ValueError(f"a thread team needs at least 1 thread, got {n}")
    _local.team = n
    # torch sets a thread's team from its process-wide count at the thread's first parallel op (once per thread):
    # take that first, or it would overwrite the team set here.
    torch.get_num_threads()
    fn = _omp_set_num_threads()
    if fn is None:
        torch.set_num_threads(n)
    else:
        fn(n)


@contextlib.contextmanager
def share(n: int) -> Iterator[None]:
    """This thread's torch ops on `n` threads inside the block (host work the engine runs on its caller's thread,
    e.g. a whole-model optimizer step), its team as it was after it."""
    before, had = torch.get_num_threads(), getattr(_local, "team", None)
    set_team(n)
    try:
        yield
    finally:
        set_team(before)
        _local.team = had


# The launch thread (queueing compute and copies, or computing on a CPU device) and the copy threads (issuing each
# link's jobs) keep a core each while an update runs beside them.
RESERVED_CORES = 2


def update_threads(beside_compute: bool, cores: int | None = None) -> int:
    """Workers for the host update's pool: every core when it runs alone (a step that waits for it), else every core
    but the launch and copy threads' (RESERVED_CORES): an update overlapped with the next forward (or in backward)
    that takes all of them makes those threads wait for a core, and the device for them. At least one."""
    n = cores if cores is not None else host_cores()
    return max(1, n - RESERVED_CORES) if beside_compute else max(1, n)


class WorkerPool:
    """One process-wide pool of worker threads, made on first use: the one factory behind every host pool (the fused
    passes' tiles, the reducer's chunk helpers, the hi/lo ranges). Each worker is one core's worth of work, so its
    torch ops run on a team of one (an OpenMP team per worker would oversubscribe the cores it shares). `get(n)`
    remakes the pool when asked for a size it lacks: any other size with `exact`, else only a larger one; the old
    pool finishes what it was given."""

    def __init__(self, name: str, exact: bool = False) -> None:
        self.name, self.exact = name, exact
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0

    def get(self, n: int) -> ThreadPoolExecutor:
        if n < 1:
            raise ValueError(f"a worker pool needs at least 1 thread, got {n}")
        with self._lock:
            if self._pool is None or (self._size != n if self.exact else self._size < n):
                old = self._pool
                self._pool = ThreadPoolExecutor(n, thread_name_prefix=self.name, initializer=set_team, initargs=(1,))
                self._size = n
                if old is not None:
                    old.shutdown(wait=False)
            return self._pool

    def reset(self) -> None:
        """Forget the pool (the next `get` makes one, e.g. after the host's share changed)."""
        with self._lock:
            old, self._pool, self._size = self._pool, None, 0
        if old is not None:
            old.shutdown(wait=False)
