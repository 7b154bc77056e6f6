"""Phase ds_build: DeepSpeed's CPU Adam compiled in the background while the correctness phases run."""

from __future__ import annotations

import glob
import os
import shutil
import time
from pathlib import Path
from typing import Any

from .common import Ctx


def phase_ds_build(ctx: Ctx) -> None:
    """Compile DeepSpeed's CPU Adam (and, on the CPU accelerator, its shared-memory comm op) once, so the
    ZeRO-3 points neither pay for it nor time out on it."""

    def build() -> dict[str, Any]:
        t0 = time.perf_counter()
        from deepspeed.ops.op_builder import CPUAdamBuilder

        import_s = time.perf_counter() - t0
        CPUAdamBuilder().load(verbose=False)
        built = ["cpu_adam"]
        if not ctx.cuda:
            from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

            ShareMemCommBuilder().load(verbose=False)
            built.append("deepspeed_shm_comm")
        return {"ok": True, "built": built, "import_s": import_s, "build_s": time.perf_counter() - t0 - import_s}

    ctx.check("cpu_adam", build)


def ds_ops_built(cpu_accelerator: bool) -> bool:
    """Whether the DeepSpeed JIT ops a ZeRO-3 run needs are already in the extensions cache (the
    harness's default cache when TORCH_EXTENSIONS_DIR is unset)."""
    from baselines.zero3 import default_extensions_dir

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or default_extensions_dir()
    names = ["cpu_adam"] + (["deepspeed_shm_comm"] if cpu_accelerator else [])
    return all(glob.glob(os.path.join(root, "**", f"{n}*.so"), recursive=True) for n in names)


def cxx_compiler() -> str | None:
    """The C++ compiler torch's extension builder would use ($CXX, else c++ / g++ on PATH), or None."""
    cxx = os.environ.get("CXX")
    if cxx and shutil.which(cxx):
        return shutil.which(cxx)
    return shutil.which("c++") or shutil.which("g++")


def python_header() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["include"]) / "Python.h"


def compile_blockers() -> list[str]:
    """Why DeepSpeed cannot compile its CPU Adam here (empty: it can): a C++ compiler, Python's headers and ninja
    are what torch's extension builder needs. Only the ZeRO-3 points need them; every other phase runs without."""
    out = []
    if cxx_compiler() is None:
        out.append("no C++ compiler (neither $CXX, c++ nor g++ on PATH): DeepSpeed compiles its CPU Adam at first "
                   "use, so the ZeRO-3 points cannot run; install one (e.g. apt-get install g++) or run with --zero3 off")
    if not python_header().exists():
        out.append(f"no Python.h at {python_header()} (the python3-dev package): torch's extension builder needs it")
    if shutil.which("ninja") is None:
        out.append("no ninja on PATH (its wheel is in wheels/: scripts/fetch_wheels.sh): torch's extension builder "
                   "needs it")
    return out


def cuda_compiler() -> str | None:
    """nvcc as DeepSpeed's op builder finds it (torch's CUDA_HOME rule: $CUDA_HOME or $CUDA_PATH, nvcc on PATH,
    /usr/local/cuda), or None. On a CUDA machine DeepSpeed builds its CPU Adam with CUDA sources, so without
    nvcc the ZeRO-3 points cannot run there (the engine's own check needs no compiler)."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.access(default, os.X_OK) else None
