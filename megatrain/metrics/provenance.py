"""Where a measurement came from: code version, packages, machine. Recorded on every results row."""

from __future__ import annotations

import datetime as _dt
import functools
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import psutil

from ..files import env

_PACKAGES = ("megatrain", "torch", "transformers", "accelerate", "deepspeed")


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def git_commit(repo: str | Path | None = None) -> tuple[str, bool]:
    """(commit, dirty). Outside a git checkout (a copy of the tree sent to a GPU box has no .git) the
    commit is $MEGATRAIN_GIT_COMMIT when the caller named it, else 'unknown'."""
    cwd = str(repo or Path(__file__).resolve().parents[2])
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha, dirty = "", ""
    if not sha:
        return env.git_commit() or "unknown", False
    return sha, bool(dirty)


def package_versions() -> str:
    out = [f"python={platform.python_version()}"]
    for name in _PACKAGES:
        try:
            out.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{name}=absent")
    return " ".join(out)


def _default_device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - provenance must never fail a run
        pass
    return f"cpu: {cpu_model()}"


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def provenance(device: str | None = None) -> dict[str, object]:
    """The provenance columns of a results row. `device` is the point's device name when known."""
    commit, dirty = git_commit()
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        "versions": package_versions(),
        "device_name": device or _default_device_name(),
        "host_mem_bytes": psutil.virtual_memory().total,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count() or 0,
        "hostname": platform.node(),
        "timestamp": utc_now(),
    }
