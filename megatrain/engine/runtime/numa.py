"""A rank's host threads on its GPU's socket, and so the pages they touch first.

On a machine with several NUMA nodes the host store's bandwidth is its socket's: a thread on the other socket reads
and writes the store, and a copy to the GPU crosses, over the inter-socket link (UPI, xGMI), at a fraction of local
DRAM's rate. Linux places a page on the node of the CPU that first touches it, so a process whose threads run on
the GPU's socket when the store is allocated and first written gets it there too. `bind_host` binds every thread of
the process (the ones started later inherit it) to the CPUs of the GPU's node within what its affinity already
allows (a cgroup cpuset, a Slurm binding): `numactl --cpunodebind` done by the engine. Nothing changes on one node,
off a CUDA device, where the GPU's node is unknown (sysfs says -1) or outside the affinity (a launcher bound the rank
elsewhere on purpose), or with MEGATRAIN_NUMA=0 (or `enabled=False`).

Each local rank takes a team of its own: its share of the node's CPUs (whole cores, disjoint from the shares of the
other ranks whose GPUs sit on that node, cores/G of the node's when the GPUs are spread evenly), found from
LOCAL_RANK and every rank's GPU's node (`plan`), so `host_cores()` is that share's CPUs. Where the other ranks' GPUs
are not seen (CUDA_VISIBLE_DEVICES per rank) the rank binds to the node's CPUs whole and `host_cores()` divides them
among the node's ranks (threads.py bound_ranks), as it does where a node has fewer cores than ranks. A Slurm task
bound to CPUs of its own keeps them (their part on the GPU's node) as its team, not divided again.

Read from sysfs: /sys/bus/pci/devices/<gpu>/numa_node, /sys/devices/system/node/node<N>/cpulist,
/sys/devices/system/cpu/cpu<C>/topology/thread_siblings_list (tests point SYSFS at a fake tree).
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
# (the affinity before, the binding) of this process's last bind_host: a later engine of the process plans from the
# affinity before it, or it would split its own team again into the node's shares
_made: tuple[frozenset[int], Binding] | None = None


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


def core_groups(cpus: frozenset[int], sysfs: Path | None = None) -> list[frozenset[int]]:
    """`cpus` by physical core (a core's hyperthreads together, from sysfs's thread_siblings_list), in order of each
    core's first CPU; a CPU whose siblings sysfs does not list is a core of its own."""
    base = (sysfs or SYSFS) / "devices" / "system" / "cpu"
    seen: set[int] = set()
    out: list[frozenset[int]] = []
    for c in sorted(cpus):
        if c in seen:
            continue
        try:
            core = parse_cpulist((base / f"cpu{c}" / "topology" / "thread_siblings_list").read_text()) & cpus
        except (OSError, ValueError):
            core = frozenset()
        core = core | {c}
        seen |= core
        out.append(core)
    return out


def team_cpus(cpus: frozenset[int], k: int, n: int, sysfs: Path | None = None) -> frozenset[int]:
    """The k-th of `n` disjoint shares of `cpus`, whole cores each (two ranks on one core's two hyperthreads would
    share its execution units), the shares' core counts differing by at most one; empty with fewer cores than n."""
    cores = core_groups(cpus, sysfs)
    q, r = divmod(len(cores), n)
    if q == 0:
        return frozenset()
    lo = k * q + min(k, r)
    return frozenset().union(*cores[lo: lo + q + (k < r)])


@dataclass(frozen=True)
class Binding:
    node: int
    cpus: frozenset[int]  # where every thread of this rank runs: its team's own share of the node's CPUs, or the
    # node's CPUs whole where the shares cannot be told (`ranks` then share them)
    ranks: int  # the ranks sharing `cpus` (host_cores divides them): 1 for a team of its own


def plan(index: int, all_bus_ids: Sequence[str | None], allowed: frozenset[int], ranks: int,
         local_rank: int | None = None, sysfs: Path | None = None, own: bool = False) -> tuple[Binding | None, str]:
    """Where the rank on GPU `index` of `all_bus_ids` (the GPUs this process sees, by PCI address) binds, and why
    not where it does not (None: leave it): on a machine of several NUMA nodes, its share of the CPUs of its GPU's
    node within `allowed` (its affinity). Each of the `ranks` local ranks whose GPUs sit on that node takes a
    disjoint share (whole cores, team_cpus), the ranks in LOCAL_RANK order, rank i on GPU i (the launchers' device
    and the engine's: distributed.py); that needs every rank's GPU seen and `local_rank` the device's index. Else
    (CUDA_VISIBLE_DEVICES per rank, or another mapping) the rank binds to the node's CPUs whole and shares them
    with the node's ranks (host_cores divides their count). `own`: `allowed` is this rank's own already (a Slurm
    task's binding, threads.slurm_task_bound): its part on the GPU's node is the team, not divided again."""
    nodes = numa_nodes(sysfs)
    if len(nodes) < 2:
        return None, "one NUMA node"
    bus_id = all_bus_ids[index] if 0 <= index < len(all_bus_ids) else None
    if bus_id is None:
        return None, f"the PCI address of GPU {index} is unknown"
    node = pci_node(bus_id, sysfs)
    if node is None or node not in nodes:
        return None, f"sysfs gives GPU {index} ({bus_id}) no NUMA node with CPUs"
    cpus = nodes[node] & allowed
    if not cpus:  # bound elsewhere by its launcher: that was asked for
        return None, f"the affinity holds none of node {node}'s CPUs (the launcher bound this rank elsewhere)"
    if ranks <= 1 or own:
        return Binding(node, cpus, 1), ""
    known = [pci_node(b, sysfs) if b is not None else None for b in all_bus_ids]
    if local_rank == index and local_rank < ranks <= len(known) and None not in known[:ranks]:
        here = [i for i in range(ranks) if known[i] == node]
        team = team_cpus(cpus, here.index(local_rank), len(here), sysfs)
        if team:
            return Binding(node, team, 1), ""
        return Binding(node, cpus, len(here)), (f"node {node} has fewer cores ({len(core_groups(cpus, sysfs))}) "
                                                 f"than ranks ({len(here)}): they share its CPUs")
    if len(known) >= ranks and None not in known:
        share = math.ceil(ranks * known.count(node) / len(known))
    else:  # the ranks spread over the sockets as their CPUs are
        share = round(ranks * len(cpus) / max(1, len(allowed)))
    return Binding(node, cpus, max(1, share)), (
        f"LOCAL_RANK={local_rank} with {len(known)} GPU(s) seen by {ranks} ranks: the other ranks' GPUs are not "
        f"all known, so this rank shares node {node}'s CPUs rather than taking a team of its own")


def enabled_by_env() -> bool:
    return not env.numa_off()


def bind_host(device: torch.device, enabled: bool | None = None, sysfs: Path | None = None) -> Binding | None:
    """Bind this process's threads to its team's CPUs on the NUMA node of `device` (a CUDA device) before the host
    store is allocated, so its first touch puts the store's pages there; the binding made, or None (nothing
    changed: see the module's docstring; the reason is logged in one line). `enabled` None: on unless
    MEGATRAIN_NUMA turns it off."""
    if not (enabled_by_env() if enabled is None else enabled) or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    seen = [cuda_bus_id(i) for i in range(torch.cuda.device_count())]
    try:
        allowed = frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        log.info("numa: threads left unbound: this OS gives no CPU affinity")
        return None
    global _made
    if _made is not None and allowed == _made[1].cpus:
        allowed = _made[0]
    ranks = threads.local_ranks()
    own = threads.slurm_task_bound(len(allowed), ranks)
    b, why = plan(index, seen, allowed, ranks, threads.local_rank(), sysfs, own)
    if b is None:
        log.info("numa: threads left unbound: %s", why)
        return None
    now = frozenset(os.sched_getaffinity(0))
    apply(b, b.cpus != now)  # already there (a launcher's binding, an earlier engine's): only host_cores' count
    _made = (allowed, b)
    log.info("numa: threads bound to %d of node %d's CPUs (the GPU's socket: the store's pages are touched there), "
             "shared by %d rank(s)%s; MEGATRAIN_NUMA=0 turns this off", len(b.cpus), b.node, b.ranks,
             f" ({why})" if why else "")
    return b


def apply(b: Binding, set_affinity: bool = True) -> None:
    """Every thread of this process on `b.cpus` (a thread started later inherits its starter's), and host_cores'
    count from those CPUs and the ranks sharing them from now on. A thread that ended meanwhile is skipped."""
    tids = sorted(int(t.name) for t in TASKS.iterdir() if t.name.isdigit()) if set_affinity else []
    for tid in tids:
        try:
            os.sched_setaffinity(tid, b.cpus)
        except (ProcessLookupError, OSError):
            continue
    threads.bound_ranks(b.ranks)
