"""A rank's threads bound to its GPU's NUMA node (engine/runtime/numa.py), read from a fake sysfs tree: two sockets of
8 CPUs each (0-3,8-11 and 4-7,12-15, interleaved as many BIOSes number them), GPUs on either. The binding is
recorded, not made: os.sched_setaffinity is patched (and the affinity it sets is what the process then sees)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from megatrain.engine.runtime import numa, threads

GPUS = {"0000:17:00.0": 0, "0000:3b:00.0": 0, "0000:86:00.0": 1, "0000:af:00.0": 1}
NODE0, NODE1 = frozenset([0, 1, 2, 3, 8, 9, 10, 11]), frozenset([4, 5, 6, 7, 12, 13, 14, 15])


def _sysfs(root: Path, nodes: dict[int, str], gpus: dict[str, int]) -> Path:
    for n, cpulist in nodes.items():
        d = root / "devices" / "system" / "node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    for bus, node in gpus.items():
        d = root / "bus" / "pci" / "devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    return root


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """16 CPUs in the affinity, three threads in the process, the two-socket tree, no ranks, no override."""
    sysfs = _sysfs(tmp_path / "sys", {0: "0-3,8-11", 1: "4-7,12-15", 2: ""}, GPUS)  # node 2: memory only
    tasks = tmp_path / "task"
    for tid in (100, 101, 102):
        (tasks / str(tid)).mkdir(parents=True)
    state = {"affinity": frozenset(range(16)), "bound": {}}

    def setaffinity(tid: int, cpus) -> None:
        state["bound"][tid] = frozenset(cpus)
        state["affinity"] = frozenset(cpus)

    monkeypatch.setattr(numa, "SYSFS", sysfs)
    monkeypatch.setattr(numa, "TASKS", tasks)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(state["affinity"]))
    monkeypatch.setattr(os, "sched_setaffinity", setaffinity)
    for name in (threads.OVERRIDE_ENV, "LOCAL_WORLD_SIZE", numa.OFF_ENV, "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "_node_ranks", None)
    monkeypatch.setattr(numa, "_made", None)
    buses = list(GPUS)
    monkeypatch.setattr(numa, "cuda_bus_id", lambda i: buses[i])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(buses))
    return monkeypatch, state


def test_the_cpulist_and_the_nodes_are_read_from_sysfs(machine):
    assert numa.parse_cpulist("0-3,8-11\n") == NODE0 and numa.parse_cpulist("5") == {5}
    assert numa.numa_nodes() == {0: NODE0, 1: NODE1}  # a node without CPUs is no place for threads
    assert numa.pci_node("0000:86:00.0") == 1 and numa.pci_node("0000:00:00.0") is None


def test_a_rank_binds_every_thread_to_its_gpus_socket_and_shares_it_with_that_sockets_ranks(machine):
    mp, state = machine
    mp.setenv("LOCAL_WORLD_SIZE", "4")
    assert threads.host_cores() == 4  # before: the machine's 16 CPUs over its 4 ranks
    b = numa.bind_host(torch.device("cuda", 2))
    assert b == numa.Binding(1, NODE1, 2)
    assert state["bound"] == {100: NODE1, 101: NODE1, 102: NODE1}  # every thread of the process
    assert threads.host_cores() == 4  # the node's 8 CPUs over the 2 ranks whose GPUs are on it


def test_an_uneven_machine_divides_each_socket_by_its_own_ranks(machine):
    mp, state = machine
    mp.setenv("LOCAL_WORLD_SIZE", "4")
    buses = ["0000:17:00.0", "0000:3b:00.0", "0000:86:00.0", "0000:99:00.0"]
    _sysfs(numa.SYSFS, {}, {"0000:99:00.0": 0})  # three GPUs on socket 0, one on socket 1
    mp.setattr(numa, "cuda_bus_id", lambda i: buses[i])
    b = numa.bind_host(torch.device("cuda", 0))
    assert b.node == 0 and b.ranks == 3
    assert threads.host_cores() == 2  # 8 CPUs over 3 ranks (the machine's share, 4, would oversubscribe it 1.5x)


def test_one_visible_gpu_per_rank_divides_in_proportion_to_the_cpus(machine):
    mp, state = machine
    mp.setenv("LOCAL_WORLD_SIZE", "4")
    mp.setattr(torch.cuda, "device_count", lambda: 1)  # CUDA_VISIBLE_DEVICES set per rank: the others unseen
    mp.setattr(numa, "cuda_bus_id", lambda i: "0000:86:00.0")
    assert numa.bind_host(torch.device("cuda", 0)) == numa.Binding(1, NODE1, 2)


@pytest.mark.parametrize("why", ["setting", "env", "cpu", "one node", "unknown node", "bound elsewhere"])
def test_nothing_is_bound(machine, tmp_path, caplog, why):
    mp, state = machine
    mp.setenv("LOCAL_WORLD_SIZE", "4")
    mp.setenv("LOCAL_RANK", "0")
    dev, enabled = torch.device("cuda", 0), None
    if why == "setting":
        enabled = False
    elif why == "env":
        mp.setenv(numa.OFF_ENV, "0")
    elif why == "cpu":
        dev = torch.device("cpu")
    elif why == "one node":
        mp.setattr(numa, "SYSFS", _sysfs(tmp_path / "one", {0: "0-15"}, GPUS))
    elif why == "unknown node":
        mp.setattr(numa, "SYSFS", _sysfs(tmp_path / "unknown", {0: "0-7", 1: "8-15"}, {b: -1 for b in GPUS}))
    else:  # a launcher bound this rank to socket 1's CPUs; its GPU is on socket 0
        state["affinity"] = NODE1
    with caplog.at_level(logging.INFO, logger="megatrain"):
        assert numa.bind_host(dev, enabled) is None
    assert state["bound"] == {} and threads._node_ranks is None
    if why in ("one node", "unknown node", "bound elsewhere"):  # a CUDA device left unbound says why, in one line
        said = [r.getMessage() for r in caplog.records if "numa" in r.getMessage()]
        assert len(said) == 1 and "unbound" in said[0] and "\n" not in said[0], said


def test_control_the_same_machine_with_the_setting_on_binds(machine):
    """The negative cases above differ from this one in their one condition only."""
    mp, state = machine
    mp.setenv("LOCAL_WORLD_SIZE", "4")
    mp.setenv("LOCAL_RANK", "0")
    assert numa.bind_host(torch.device("cuda", 0), True) == numa.Binding(0, frozenset([0, 1, 2, 3]), 1)
    assert set(state["bound"]) == {100, 101, 102}


def _bind_each_rank(machine, ranks: int) -> list[numa.Binding]:
    """bind_host in each of `ranks` local ranks in turn (rank r on GPU r), each starting from the unbound process."""
    mp, state = machine
    mp.setenv("LOCAL_WORLD_SIZE", str(ranks))
    out = []
    for r in range(ranks):
        mp.setenv("LOCAL_RANK", str(r))
        state["affinity"], state["bound"] = frozenset(range(16)), {}
        threads.bound_ranks(None)
        mp.setattr(numa, "_made", None)  # another process
        b = numa.bind_host(torch.device("cuda", r))
        assert b is not None and state["bound"] == {t: b.cpus for t in (100, 101, 102)}
        assert threads.host_cores() == len(b.cpus)  # its team's CPUs, not divided again
        out.append(b)
    return out


def test_four_ranks_each_take_a_disjoint_team_of_cores_over_g_on_their_gpus_node(machine):
    """2 sockets, 4 GPUs on sockets 0, 0, 1, 1, 4 local ranks: rank r's team is on GPU r's socket, a quarter of the
    machine's 16 CPUs, and no two teams share a CPU (before: each rank took its socket's 8 CPUs, shared)."""
    teams = _bind_each_rank(machine, 4)
    assert [b.node for b in teams] == [0, 0, 1, 1]
    assert all(b.cpus <= (NODE0, NODE0, NODE1, NODE1)[r] for r, b in enumerate(teams))
    assert [len(b.cpus) for b in teams] == [4, 4, 4, 4] and all(b.ranks == 1 for b in teams)
    assert frozenset().union(*(b.cpus for b in teams)) == frozenset(range(16))  # disjoint: 4 x 4 distinct CPUs
    assert teams[0].cpus == {0, 1, 2, 3} and teams[1].cpus == {8, 9, 10, 11}


def test_a_team_takes_whole_cores_not_one_hyperthread_of_a_core_another_rank_uses(machine, tmp_path):
    mp, state = machine
    sysfs = _sysfs(tmp_path / "smt", {0: "0-3,8-11", 1: "4-7,12-15"}, GPUS)
    for c in range(16):  # cpu c and cpu c+8 are one core's two hyperthreads
        d = sysfs / "devices" / "system" / "cpu" / f"cpu{c}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(f"{c % 8},{c % 8 + 8}\n")
    mp.setattr(numa, "SYSFS", sysfs)
    teams = _bind_each_rank(machine, 4)
    assert [b.cpus for b in teams] == [{0, 8, 1, 9}, {2, 10, 3, 11}, {4, 12, 5, 13}, {6, 14, 7, 15}]


def test_an_uneven_machine_gives_each_socket_s_ranks_disjoint_teams_of_its_cores(machine):
    mp, state = machine
    buses = ["0000:17:00.0", "0000:3b:00.0", "0000:86:00.0", "0000:99:00.0"]
    _sysfs(numa.SYSFS, {}, {"0000:99:00.0": 0})  # three GPUs on socket 0, one on socket 1
    mp.setattr(numa, "cuda_bus_id", lambda i: buses[i])
    teams = _bind_each_rank(machine, 4)
    assert [b.node for b in teams] == [0, 0, 1, 0]
    assert [len(b.cpus) for b in teams] == [3, 3, 8, 2]  # socket 0's 8 CPUs as 3 + 3 + 2, socket 1's for one rank
    assert frozenset().union(*(b.cpus for b in teams)) == frozenset(range(16))


def test_a_socket_with_fewer_cores_than_ranks_is_shared_never_an_empty_team(machine, tmp_path):
    mp, state = machine
    mp.setattr(numa, "SYSFS", _sysfs(tmp_path / "small", {0: "0", 1: "1-15"}, GPUS))
    mp.setenv("LOCAL_WORLD_SIZE", "4")
    mp.setenv("LOCAL_RANK", "1")
    b = numa.bind_host(torch.device("cuda", 1))
    assert b == numa.Binding(0, frozenset([0]), 2) and threads.host_cores() == 1


def test_one_visible_gpu_per_rank_shares_the_node_and_says_why(machine, caplog):
    """CUDA_VISIBLE_DEVICES per rank: the other ranks' GPUs are unseen, so no share of the node can be told apart."""
    mp, state = machine
    mp.setenv("LOCAL_WORLD_SIZE", "4")
    mp.setenv("LOCAL_RANK", "2")
    mp.setattr(torch.cuda, "device_count", lambda: 1)
    mp.setattr(numa, "cuda_bus_id", lambda i: "0000:86:00.0")
    with caplog.at_level(logging.INFO, logger="megatrain"):
        assert numa.bind_host(torch.device("cuda", 0)) == numa.Binding(1, NODE1, 2)
    assert any("not all known" in r.getMessage() for r in caplog.records)


def test_a_second_engine_of_the_process_keeps_the_team_the_first_bound(machine):
    """bind_host runs in every Engine's construction: a second engine plans from the affinity the process had
    before the first bound it, so the team stays whole (planned from the team itself it would split it again)."""
    mp, state = machine
    mp.setenv("LOCAL_WORLD_SIZE", "4")
    mp.setenv("LOCAL_RANK", "1")
    first = numa.bind_host(torch.device("cuda", 1))
    state["bound"] = {}
    assert numa.bind_host(torch.device("cuda", 1)) == first and first.cpus == {8, 9, 10, 11}
    assert state["affinity"] == first.cpus and threads.host_cores() == 4


def test_a_slurm_tasks_own_cpus_are_its_team_not_divided_again(machine):
    """Slurm bound each task to CPUs of its own (rank 1 to 8-11 of socket 0): that is its team already."""
    mp, state = machine
    mp.setenv("LOCAL_WORLD_SIZE", "4")
    mp.setenv("LOCAL_RANK", "1")
    mp.setenv("SLURM_JOB_ID", "7")
    mp.setenv("SLURM_CPU_BIND_TYPE", "mask_cpu:")
    state["affinity"] = frozenset([8, 9, 10, 11])
    assert numa.bind_host(torch.device("cuda", 1)) == numa.Binding(0, frozenset([8, 9, 10, 11]), 1)
    assert state["bound"] == {} and threads.host_cores() == 4
