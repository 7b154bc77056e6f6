"""The process's environment, read in one place: every `MEGATRAIN_*` variable the package reads, and the cache root.

None of them is needed for training; docs/SETTINGS.md's "Environment variables" table says what each does
(tests/unit/test_env_once.py keeps that table and `VARIABLES` the same, and os.environ reads of `MEGATRAIN_*` in
this module only). Each is read when asked, not at import: a test or a launcher that sets one later is seen.

It imports `os` alone (pathlib where a path is asked for): megatrain/_startup.py loads this file by path at every
interpreter start-up, before the package can be imported, and must cost next to nothing.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["ADAM_KERNEL", "CACHE", "DEEPSPEED_GUARD", "GIT_COMMIT", "HILO_KERNEL", "HOST_THREADS", "LAUNCHED",
           "LAUNCH_GLOO_GROUP", "NUMA", "REDUCE_KERNEL", "VARIABLES", "cache_dir", "cache_root", "deepspeed_left_alone",
           "git_commit", "host_threads", "kernel_off", "launch_gloo_group", "launched", "numa_off", "value"]

DEEPSPEED_GUARD = "MEGATRAIN_DEEPSPEED_GUARD"
LAUNCHED = "MEGATRAIN_LAUNCHED"
LAUNCH_GLOO_GROUP = "MEGATRAIN_LAUNCH_GLOO_GROUP"
HOST_THREADS = "MEGATRAIN_HOST_THREADS"
NUMA = "MEGATRAIN_NUMA"
CACHE = "MEGATRAIN_CACHE"
ADAM_KERNEL = "MEGATRAIN_ADAM_KERNEL"
HILO_KERNEL = "MEGATRAIN_HILO_KERNEL"
REDUCE_KERNEL = "MEGATRAIN_REDUCE_KERNEL"
GIT_COMMIT = "MEGATRAIN_GIT_COMMIT"
# The variables the package reads, in docs/SETTINGS.md's order.
VARIABLES = (DEEPSPEED_GUARD, LAUNCHED, LAUNCH_GLOO_GROUP, HOST_THREADS, NUMA, CACHE, ADAM_KERNEL, HILO_KERNEL,
             REDUCE_KERNEL, GIT_COMMIT)
KERNELS = (ADAM_KERNEL, HILO_KERNEL, REDUCE_KERNEL)


def value(name: str) -> str | None:
    """One of VARIABLES as set (None: unset), for a caller that restores it afterwards (`megatrain launch`)."""
    if name not in VARIABLES:
        raise ValueError(f"{name!r} is not one of the variables MegaTrain reads: {VARIABLES}")
    return os.environ.get(name)


def deepspeed_left_alone() -> bool:
    """MEGATRAIN_DEEPSPEED_GUARD=0: the user left DeepSpeed untouched in this process (the one opt-out)."""
    return os.environ.get(DEEPSPEED_GUARD, "1") == "0"


def launched() -> bool:
    """MEGATRAIN_LAUNCHED=1: started by `megatrain launch` (every DeepSpeed config trains on MegaTrain)."""
    return os.environ.get(LAUNCHED) == "1"


def launch_gloo_group() -> bool:
    """MEGATRAIN_LAUNCH_GLOO_GROUP=1: `megatrain launch` asks for a gloo process group first."""
    return os.environ.get(LAUNCH_GLOO_GROUP) == "1"


def host_threads() -> str:
    """MEGATRAIN_HOST_THREADS as written, stripped ("" when unset); engine/runtime/threads.py checks it."""
    return os.environ.get(HOST_THREADS, "").strip()


def numa_off() -> bool:
    """MEGATRAIN_NUMA=0 (or off, false, no, any case): leave the host threads where the launcher put them
    (engine/runtime/numa.py)."""
    return os.environ.get(NUMA, "").strip().lower() in ("0", "off", "false", "no")


def kernel_off(name: str) -> bool:
    """`name`=torch (KERNELS, or a test's own kernel's switch): torch's ops instead of that compiled host kernel."""
    return os.environ.get(name, "auto") == "torch"


def git_commit() -> str | None:
    """MEGATRAIN_GIT_COMMIT: the commit a measurement records where git cannot tell it (None: unset or empty)."""
    return os.environ.get(GIT_COMMIT) or None


def cache_root() -> Path:
    """Where MegaTrain caches what it measured or built: $MEGATRAIN_CACHE, else ~/.cache/megatrain."""
    from pathlib import Path

    return Path(os.environ.get(CACHE) or Path.home() / ".cache" / "megatrain")


def cache_dir(*parts: str) -> Path:
    """A place under the cache root (not created here): ("probe",), ("kernels",), ..."""
    return cache_root().joinpath(*parts)
