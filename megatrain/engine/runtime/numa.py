"""A rank's host threads on its GPU's socket, and so the pages they touch first.

On a machine with several NUMA nodes the host store's bandwidth is its socket's: a thread on the other socket reads
and writes the store, and a copy to the GPU crosses, over the inter-socket link (UPI, xGMI), at a fraction of local
DRAM's rate. Linux places a page on the node of the CPU that first touches it, so a process whose threads run on
the GPU's socket when the store is allocated and first written gets it there too. `bind_host` binds every thread of
the process (the ones started later inherit it) to the CPUs of the GPU's node within what its affinity already
allows (a cgroup cpuset, a Slurm binding): `numactl --cpunodebind` done by the engine. Nothing changes on one node,
off a CUDA device, where the GPU's node is unknown (sysfs says -1) or outside the affinity (a launcher bound the rank
elsewhere on purpose), or with MEGATRAIN_NUMA=0 (or `enabled=False`).

The CPUs it takes are the node's, shared by the node's ranks: `host_cores()` then divides the node's CPUs among the
ranks whose GPUs sit on that node (from the GPUs' own nodes when every one is visible, else in proportion to the
node's CPUs), not the machine's among all ranks (threads.py bound_ranks).

Read from sysfs: /sys/bus/pci/devices/<gpu>/numa_node, /sys/devices/system/node/node<N>/cpulist (tests point SYSFS
at a fake tree).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ...files import env
from . import threads

log = logging.getLogger("megatrain")
SYSFS = Path("/sys")
TASKS = Path("/proc/self/task")  # the process's threads, each bound by its id
OFF_ENV = env.NUMA  # "0", "off", "false", "no": leave the threads where they are


def parse_cpulist(text: str) -> frozenset[int]:
    """A sysfs cpulist ("0-3,8-11", "5", "") as the CPUs it names."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


def numa_nodes(sysfs: Path | None = None) -> dict[int, frozenset[int]]:
    """The machine's NUMA nodes that have CPUs: node id -> its CPUs (none readable: {})."""
    base = (sysfs or SYSFS) / "devices" / "system" / "node"
    out: dict[int, frozenset[int]] = {}
    for d in sorted(base.glob("node[0-9]*")):
        try:
            cpus = parse_cpulist((d / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            out[int(d.name[4:])] = cpus
    return out


def pci_node(bus_id: str, sysfs: Path | None = None) -> int | None:
    """The NUMA node of the PCI device `bus_id` ("0000:3b:00.0"), None where sysfs does not say (-1, no file)."""
    try:
        node = int(((sysfs or SYSFS) / "bus" / "pci" / "devices" / bus_id.lower() / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def cuda_bus_id(index: int) -> str | None:
    """The PCI address of CUDA device `index` as sysfs names it, None where torch does not say."""
    try:
        p = torch.cuda.get_device_properties(index)
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except (AttributeError, RuntimeError, AssertionError):
        return None


@dataclass(frozen=True)
class Binding:
    node: int
    cpus: frozenset[int]  # the node's CPUs within the affinity: where every thread runs
    ranks: int  # this node's share of the machine's ranks: they divide `cpus` (host_cores)


def plan(bus_id: str | None, all_bus_ids: Sequence[str | None], allowed: frozenset[int], ranks: int,
         sysfs: Path | None = None) -> Binding | None:
    """Where the rank whose GPU is `bus_id` binds (None: leave it): the CPUs of the GPU's node within `allowed`
    (its affinity) on a machine of several nodes. `all_bus_ids`: the GPUs this process sees (the node's share of
    the `ranks` ranks counts theirs on the node when it sees as many as there are ranks)."""
    nodes = numa_nodes(sysfs)
    if len(nodes) < 2 or bus_id is None:
        return None
    node = pci_node(bus_id, sysfs)
    if node is None or node not in nodes:
        return None
    cpus = nodes[node] & allowed
    if not cpus:  # bound elsewhere by its launcher: that was asked for
        return None
    known = [pci_node(b, sysfs) if b is not None else None for b in all_bus_ids]
    if len(known) >= ranks > 0 and None not in known:
        here = math.ceil(ranks * known.count(node) / len(known))
    else:  # the ranks spread over the sockets as their CPUs are
        here = round(ranks * len(cpus) / max(1, len(allowed)))
    return Binding(node, cpus, max(1, here))


def enabled_by_env() -> bool:
    return not env.numa_off()


def bind_host(device: torch.device, enabled: bool | None = None, sysfs: Path | None = None) -> Binding | None:
    """Bind this process's threads to the NUMA node of `device` (a CUDA device) before the host store is allocated,
    so its first touch puts the store's pages there; the binding made, or None (nothing changed: see the module's
    docstring). `enabled` None: on unless MEGATRAIN_NUMA turns it off."""
    if not (enabled_by_env() if enabled is None else enabled) or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    seen = [cuda_bus_id(i) for i in range(torch.cuda.device_count())]
    try:
        allowed = frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    b = plan(cuda_bus_id(index), seen, allowed, threads.local_ranks(), sysfs)
    if b is None or b.cpus == allowed:
        return None
    apply(b)
    log.info("numa: threads bound to node %d's %d CPUs (the GPU's socket: the store's pages are touched there), "
             "%d rank(s) of this machine share them; MEGATRAIN_NUMA=0 turns this off", b.node, len(b.cpus), b.ranks)
    return b


def apply(b: Binding) -> None:
    """Every thread of this process on `b.cpus` (a thread started later inherits its starter's), and host_cores'
    count from the node's CPUs and ranks from now on. A thread that ended meanwhile is skipped."""
    for tid in sorted(int(t.name) for t in TASKS.iterdir() if t.name.isdigit()):
        try:
            os.sched_setaffinity(tid, b.cpus)
        except (ProcessLookupError, OSError):
            continue
    threads.bound_ranks(b.ranks)
