"""host_cores() (engine/runtime/threads.py) takes the cgroup's CPU quota as well as the affinity (Docker `--cpus`,
Kubernetes limits write cgroup v2's cpu.max, v1's cfs quota), and divides among the node's ranks once: a Slurm task
with a per-task CPU binding already sees only its share. Fake cgroup trees and Slurm variables; a process that sees
32 CPUs is emulated by patching os.sched_getaffinity."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatrain.engine.runtime import threads

SLURM = ("SLURM_JOB_ID", "SLURM_CPU_BIND_TYPE", "SLURM_JOB_CPUS_PER_NODE")


@pytest.fixture
def node(monkeypatch, tmp_path):
    """32 CPUs in the affinity, no override, no ranks, no Slurm, a cgroup tree under tmp_path (empty: no quota)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    for name in (threads.OVERRIDE_ENV, "LOCAL_WORLD_SIZE", *SLURM):
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "cgroup"
    root.mkdir()
    monkeypatch.setattr(threads, "CGROUP_ROOT", root)
    monkeypatch.setattr(threads, "SELF_CGROUP", tmp_path / "self_cgroup")
    return monkeypatch, root, tmp_path / "self_cgroup"


def _v2(root: Path, self_cgroup: Path, path: str, cpu_max: dict[str, str]) -> None:
    self_cgroup.write_text(f"0::{path}\n")
    for rel, text in cpu_max.items():
        d = root / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.max").write_text(text + "\n")


def test_no_quota_leaves_the_affinity(node):
    mp, root, me = node
    _v2(root, me, "/job", {"": "max 100000", "job": "max 100000"})
    assert threads.cgroup_cpu_quota() is None and threads.host_cores() == 32


def test_a_docker_cpus_limit_caps_the_affinity(node):
    mp, root, me = node
    _v2(root, me, "/", {"": "400000 100000"})  # --cpus=4 on a 32-CPU host: the affinity still shows 32
    assert threads.cgroup_cpu_quota() == 4.0
    assert threads.host_cores() == 4


def test_a_parents_quota_holds_for_its_children_and_fractions_round_down(node):
    mp, root, me = node
    _v2(root, me, "/kubepods/pod1/ctr", {"kubepods/pod1": "250000 100000", "kubepods/pod1/ctr": "max 100000"})
    assert threads.cgroup_cpu_quota() == 2.5
    assert threads.host_cores() == 2


def test_the_quota_is_shared_by_the_nodes_ranks(node):
    mp, root, me = node
    _v2(root, me, "/", {"": "800000 100000"})
    mp.setenv("LOCAL_WORLD_SIZE", "4")
    assert threads.host_cores() == 2  # 8 CPUs of quota over 4 ranks (the affinity's 32 / 4 = 8 is more)
    mp.setenv("LOCAL_WORLD_SIZE", "16")
    assert threads.host_cores() == 1  # never none


def test_cgroup_v1_cfs_quota(node):
    mp, root, me = node
    me.write_text("4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    d = root / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("300000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_cpu_quota() == 3.0 and threads.host_cores() == 3
    (d / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert threads.cgroup_cpu_quota() is None and threads.host_cores() == 32


def test_slurm_per_task_binding_is_not_divided_twice(node):
    """4 tasks on a node, each bound by Slurm to 8 CPUs of its own: each keeps 8 (the old count, 8 // 4, gave 2)."""
    mp, root, me = node
    mp.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    mp.setenv("LOCAL_WORLD_SIZE", "4")
    mp.setenv("SLURM_JOB_ID", "123")
    mp.setenv("SLURM_JOB_CPUS_PER_NODE", "32(x2)")
    assert threads.host_cores() == 8
    mp.setenv("SLURM_CPU_BIND_TYPE", "cores,")  # the step names the binding: the same answer
    mp.setenv("SLURM_JOB_CPUS_PER_NODE", "")
    assert threads.host_cores() == 8


def test_slurm_tasks_sharing_the_nodes_cpus_are_divided(node):
    """Negative control: unbound Slurm tasks each see the job's 32 CPUs, and share them."""
    mp, root, me = node
    mp.setenv("LOCAL_WORLD_SIZE", "4")
    mp.setenv("SLURM_JOB_ID", "123")
    mp.setenv("SLURM_JOB_CPUS_PER_NODE", "32")
    mp.setenv("SLURM_CPU_BIND_TYPE", "none")
    assert threads.host_cores() == 8


def test_the_override_still_wins_over_a_quota(node):
    mp, root, me = node
    _v2(root, me, "/", {"": "200000 100000"})
    mp.setenv(threads.OVERRIDE_ENV, "6")
    assert threads.host_cores() == 6
