"""A process's proportional set size (PSS) and resident set size from /proc/<pid>/smaps_rollup.

RSS counts every page a process maps, so processes that share pages (libraries, a shared host store)
each count them in full and a sum over ranks double-counts them. PSS charges a shared page 1/n to each
of the n processes that map it, so the sum over processes is the memory they hold together.
"""

from __future__ import annotations

from pathlib import Path


def memory_rollup(pid: int | str = "self", proc: str | Path = "/proc") -> dict[str, int]:
    """{field: bytes} of /proc/<pid>/smaps_rollup (Rss, Pss, Shared_Clean, ...); summed over
    /proc/<pid>/smaps on a kernel without the rollup (< 4.14). Raises OSError where neither exists."""
    base = Path(proc) / str(pid)
    rollup = base / "smaps_rollup"
    try:
        text = rollup.read_text()
    except FileNotFoundError:
        text = (base / "smaps").read_text()
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        # mapping headers ("7f..-7f.. r-xp ...") have no "kB" field; only the "Name:  N kB" lines count
        if not sep or len(parts) != 2 or parts[1] != "kB" or not parts[0].isdigit():
            continue
        out[key] = out.get(key, 0) + int(parts[0]) * 1024
    return out


def pss_bytes(pid: int | str = "self") -> int:
    """Proportional set size of a process, bytes."""
    return memory_rollup(pid)["Pss"]


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process, bytes (shared pages counted in full)."""
    return memory_rollup(pid)["Rss"]
