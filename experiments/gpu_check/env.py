"""Phase env: what ran where (GPU, driver, PCIe link, torch/CUDA, packages, host memory, pinning, compilers)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

from .common import REPO_ROOT, Ctx


# == env ==============================================================================================
def phase_env(ctx: Ctx) -> None:
    import importlib.metadata as md
    import platform
    import resource

    import torch

    def packages() -> dict[str, Any]:
        vers = {}
        for name in ("torch", "transformers", "accelerate", "safetensors", "numpy", "huggingface-hub", "tokenizers",
                     "pyyaml", "psutil", "nvidia-ml-py"):
            try:
                vers[name] = md.version(name)
            except md.PackageNotFoundError:
                vers[name] = None
        # What the check imports (the engine, the planner, a Llama from transformers): no pandas, no DeepSpeed
        missing = [n for n in ("transformers", "safetensors", "pyyaml") if _missing(n)]
        return {"ok": not missing, "python": platform.python_version(), "executable": sys.executable,
                "versions": vers, "missing": missing}

    def device() -> dict[str, Any]:
        res: dict[str, Any] = {"ok": True, "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                               "torch_cuda": torch.version.cuda, "device": str(ctx.device)}
        if ctx.cuda:
            props = torch.cuda.get_device_properties(0)
            free, total = torch.cuda.mem_get_info()
            res.update(name=props.name, capability=f"{props.major}.{props.minor}",
                       multiprocessors=props.multi_processor_count, memory_total_bytes=total,
                       memory_free_bytes=free)
            res["nvidia_smi"] = _run_text(["nvidia-smi", "--query-gpu=name,driver_version,pcie.link.gen.current,"
                                           "pcie.link.gen.max,pcie.link.width.current,clocks.sm,clocks.mem",
                                           "--format=csv"])
        elif not ctx.dry:
            res.update(ok=False, error="no CUDA device: run with --dry-run on a CPU machine")
        return res

    def host() -> dict[str, Any]:
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        res: dict[str, Any] = {"ok": True, "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                               "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                               "memlock_soft": soft, "memlock_hard": hard}
        try:
            from megatrain.engine import host_cores

            res["host_cores"] = host_cores()
        except Exception as exc:  # noqa: BLE001
            res["host_cores"] = f"error: {exc}"
        try:
            from megatrain.engine.parts import available_host_bytes

            res["engine_sees_available_bytes"] = available_host_bytes()
        except Exception as exc:  # noqa: BLE001
            res["engine_sees_available_bytes"] = f"error: {exc}"
        if ctx.cuda:
            t0 = time.perf_counter()
            buf = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
            res["pin_1gib_s"] = round(time.perf_counter() - t0, 3)
            res["pinned"] = bool(buf.is_pinned())
            res["ok"] = res["pinned"]
            del buf
        return res

    def code() -> dict[str, Any]:
        from megatrain.metrics.provenance import git_commit

        commit, dirty = git_commit(REPO_ROOT)
        from_git = (REPO_ROOT / ".git").exists()
        return {"ok": True, "git_commit": commit, "git_dirty": dirty,
                "commit_from": "git" if from_git else "MEGATRAIN_GIT_COMMIT"}

    for name, fn in (("packages", packages), ("device", device), ("host", host), ("code", code)):
        ctx.check(name, fn)


def _missing(dist: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(dist)
        return False
    except md.PackageNotFoundError:
        return True


def _run_text(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {exc}"


# == bandwidth ==========================================================================================
