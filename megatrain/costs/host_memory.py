"""What this machine's host memory has free right now: the cgroup's headroom when a limit is set (its reclaimable
page cache not counted as used), capped by MemAvailable. One reading for the planner and the engine's preflight."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostMemory:
    available_bytes: int  # what a new allocation can still get
    limit_bytes: int  # the cgroup limit, or MemTotal when no limit is set
    source: str  # where available_bytes came from


def _read_int(path: str | Path) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _meminfo(meminfo: str | Path) -> dict[str, int]:
    out = {}
    try:
        for line in Path(meminfo).read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    return out


def _reclaimable(stat_file: Path, keys: tuple[str, ...]) -> int:
    """Page cache the kernel drops before it refuses an allocation: the cgroup's inactive file pages."""
    try:
        fields = dict(line.split()[:2] for line in stat_file.read_text().splitlines() if len(line.split()) >= 2)
    except (OSError, ValueError):
        return 0
    for key in keys:  # v1's hierarchical total first: it counts the child groups, as usage does
        if key in fields and fields[key].isdigit():
            return int(fields[key])
    return 0


def _cgroup_limit_usage(cgroup_root: Path, proc_cgroup: Path) -> tuple[int | None, int | None, str]:
    """(limit, usage, where) of this process's memory cgroup, v2 or v1; None where unset. The usage leaves
    out the reclaimable page cache (memory.stat's inactive_file): the kernel counts cached file pages in
    memory.current, and a container that has read a checkpoint once would otherwise look full."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    v2_path = v1_path = None
    for line in lines:
        hid, ctrls, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and ctrls == "":
            v2_path = path
        elif "memory" in ctrls.split(","):
            v1_path = path
    # A container often mounts its own cgroup at the root, so the path from /proc may not exist
    # under the mount: try it, then the root.
    candidates: list[tuple[Path, str, str, tuple[str, ...]]] = []
    if v2_path is not None:
        for base in (cgroup_root / v2_path.lstrip("/"), cgroup_root):
            candidates.append((base, "memory.max", "memory.current", ("inactive_file",)))
    if v1_path is not None:
        for base in (cgroup_root / "memory" / v1_path.lstrip("/"), cgroup_root / "memory"):
            candidates.append((base, "memory.limit_in_bytes", "memory.usage_in_bytes",
                               ("total_inactive_file", "inactive_file")))
    for base, limit_file, usage_file, cache_keys in candidates:
        if not (base / limit_file).exists():
            continue
        limit = _read_int(base / limit_file)
        # cgroup v1 writes "no limit" as a huge page-aligned number
        if limit is not None and limit >= 1 << 60:
            limit = None
        usage = _read_int(base / usage_file)
        if usage is not None:
            usage = max(0, usage - _reclaimable(base / "memory.stat", cache_keys))
        return limit, usage, str(base / limit_file)
    return None, None, ""


def host_memory_available(meminfo: str | Path = "/proc/meminfo", cgroup_root: str | Path = "/sys/fs/cgroup",
                          proc_cgroup: str | Path = "/proc/self/cgroup") -> HostMemory:
    """Host memory a new allocation can still get: the cgroup's headroom when a limit is set
    (capped by MemAvailable), else MemAvailable from /proc/meminfo."""
    info = _meminfo(meminfo)
    mem_avail = info.get("MemAvailable", info.get("MemFree"))
    mem_total = info.get("MemTotal")
    limit, usage, where = _cgroup_limit_usage(Path(cgroup_root), Path(proc_cgroup))
    if limit is not None:
        headroom = max(0, limit - (usage or 0))
        if mem_avail is not None and mem_avail < headroom:
            return HostMemory(mem_avail, limit, "MemAvailable (/proc/meminfo), below the cgroup headroom")
        return HostMemory(headroom, limit, f"cgroup limit {where} minus usage (reclaimable page cache not counted)")
    if mem_avail is None:
        raise RuntimeError(f"cannot tell available host memory: no cgroup limit and no MemAvailable in {meminfo}")
    return HostMemory(mem_avail, mem_total or mem_avail, "MemAvailable (/proc/meminfo)")
