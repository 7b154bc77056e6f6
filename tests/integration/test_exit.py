"""A process that trains with a process group tears it down at exit, before Python finalizes
(engine/parallel/distributed.py destroy_at_exit): left to finalization, a gloo worker releasing its last work aborted
such a process now and then ("terminate called without an active exception")."""

import subprocess
from pathlib import Path

import pytest
from kit import start_python

ROOT = Path(__file__).resolve().parents[2]
CODE = """
import atexit, sys, torch, torch.distributed as dist
atexit.register(lambda: print("initialized at exit:", dist.is_initialized()))  # runs after hooks made later
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
if sys.argv[1] == "engine":
    from megatrain.engine.parallel.distributed import join_ranks
    join_ranks(torch.device("cpu"), 30.0)  # what every engine does as it is built
"""


@pytest.fixture(scope="module")
def exits() -> dict[str, str]:
    """Each mode's output; the two processes run side by side (each is mostly torch's single-threaded import)."""
    procs = {mode: start_python(["-c", CODE, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for mode in ("engine", "plain")}
    out = {}
    try:
        for mode, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0, (mode, stderr[-2000:])
            out[mode] = stdout
    finally:
        for proc in procs.values():
            proc.kill()
    return out


@pytest.mark.slow
def test_an_engine_tears_down_the_group_it_trained_with_at_exit(exits):
    assert "initialized at exit: False" in exits["engine"]


@pytest.mark.slow
def test_control_without_an_engine_the_group_is_left_to_finalization(exits):
    assert "initialized at exit: True" in exits["plain"]


def test_an_nccl_group_is_left_to_torch(monkeypatch):
    """An NCCL group's teardown can block on a collective a dead peer never joins: the exit hook leaves it be."""
    import torch.distributed as dist

    from megatrain.engine.parallel import distributed

    destroyed = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: destroyed.append(1))
    monkeypatch.setattr(distributed.time, "sleep", lambda s: None)
    for backend, want in (("nccl", []), ("cpu:gloo,cuda:nccl", []), ("gloo", [1])):
        destroyed.clear()
        monkeypatch.setattr(dist, "get_backend", lambda *a, b=backend: b)
        distributed._destroy()
        assert destroyed == want, backend
