"""Host pools are sized from this process's CPUs (its affinity) shared among the node's ranks (LOCAL_WORLD_SIZE),
never from OMP_NUM_THREADS / torch's own count (engine/runtime/threads.py host_cores): `accelerate launch` sets
OMP_NUM_THREADS=1 and torchrun does with several processes, which left every pool one thread. A process that sees
32 CPUs is emulated by patching os.sched_getaffinity."""

from __future__ import annotations

import logging
import os
import re
import threading

import pytest
import torch
from conftest import tiny_model

from megatrain.engine.host import hilo, reduce_kernel
from megatrain.engine.runtime import stream, threads
from megatrain.engine.update import fused
from megatrain.run import start_line


@pytest.fixture
def launched(monkeypatch):
    """A launcher's process: OMP_NUM_THREADS=1 (torch's count 1) on a machine whose affinity shows 32 CPUs."""
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv(threads.OVERRIDE_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    monkeypatch.setattr(threads, "SELF_CGROUP", threads.Path("/nonexistent"))  # no CPU quota, whatever runs this
    for name in ("SLURM_JOB_ID", "SLURM_CPU_BIND_TYPE", "SLURM_JOB_CPUS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    torch.set_num_threads(1)
    yield monkeypatch
    torch.set_num_threads(before)


def _start_line(caplog) -> str:
    import megatrain

    caplog.set_level(logging.INFO, logger="megatrain")
    model = tiny_model(layers=2, hidden=32, vocab=128)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "megatrain": {"device": "cpu", "compute_dtype": "float32", "parity_probe": False}}
    megatrain.initialize(model=model, config=config)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith(start_line.PREFIX)]
    return line


def _said(line: str) -> int:
    found = re.search(r"host threads: (\d+) optimizer", line)
    assert found, line
    return int(found.group(1))


def test_one_local_process_takes_its_cpus_not_omp_num_threads(launched, caplog):
    line = _said(_start_line(caplog))
    assert line >= 8
    assert line == threads.update_threads(False) == 32  # a CPU device: the update runs alone, every core


def test_four_local_ranks_share_the_cpus(launched, caplog):
    launched.setenv("LOCAL_WORLD_SIZE", "4")
    line = _start_line(caplog)
    assert 1 <= _said(line) <= 8
    assert "of 8 cores" in line


def test_negative_control_torchs_count_gave_one_thread(launched, caplog):
    # The old sizing (torch.get_num_threads()) under the same launcher: one thread, which the start line shows.
    launched.setattr(threads, "host_cores", lambda: torch.get_num_threads())
    assert _said(_start_line(caplog)) == 1


def test_every_pool_takes_the_process_share(launched):
    launched.setenv("LOCAL_WORLD_SIZE", "4")
    assert threads.host_cores() == 8
    assert threads.update_threads(False) == 8
    assert threads.update_threads(True) == 8 - threads.RESERVED_CORES  # the launch and copy threads keep theirs
    assert stream.side_threads() == 2  # the reducer: a quarter
    assert threads.team() == 8  # a thread with no team of its own: the process's share, not torch's 1
    assert len(hilo._ranges(1 << 30)) == 8
    assert fused._compiled_tile(8 * 4096, None, fused.TILE) == 4096  # one tile per worker of 8
    reduce_kernel._HELPERS.reset()
    try:
        assert reduce_kernel._helpers()._max_workers == 7  # beside the caller's own thread
    finally:
        reduce_kernel._HELPERS.reset()


def test_a_thread_with_a_team_keeps_it():
    out = []

    def body() -> None:
        threads.set_team(1)  # a fused-pass worker's
        out.append((threads.team(), len(hilo._ranges(1 << 30))))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert out == [(1, 1)]  # no nested pool of its own inside a worker


def test_share_sets_this_threads_team_and_restores_it(launched):
    with threads.share(3):
        assert torch.get_num_threads() == 3 and threads.team() == 3
    assert torch.get_num_threads() == 1 and threads.team() == 32


def test_the_user_override_wins(launched, caplog):
    launched.setenv("LOCAL_WORLD_SIZE", "4")
    launched.setenv(threads.OVERRIDE_ENV, "5")
    assert threads.host_cores() == 5
    assert _said(_start_line(caplog)) == 5


@pytest.mark.parametrize("name", [threads.OVERRIDE_ENV, "LOCAL_WORLD_SIZE"])
@pytest.mark.parametrize("value", ["0", "four", "-2"])
def test_a_bad_count_is_refused_naming_it(launched, name, value):
    launched.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}' is not a positive integer"):
        threads.host_cores()


def test_without_an_affinity_call_the_machines_count(launched):
    launched.delattr(os, "sched_getaffinity")
    launched.setattr(os, "cpu_count", lambda: 12)
    assert threads.host_cores() == 12


@pytest.mark.parametrize("overlap", [True, False])
def test_the_optimizer_thread_runs_its_torch_ops_on_the_update_share(launched, overlap):
    """The layered update's own thread (an unfused update's whole-layer passes) gets the pool's share as its team,
    not torch's process-wide count (a launcher's 1)."""
    from megatrain.config import EngineConfig
    from megatrain.engine import Engine

    eng = Engine(tiny_model(layers=1, hidden=32, vocab=128),
                 EngineConfig(device="cpu", compute_dtype="float32", optimizer_overlap=overlap, parity_probe=False))
    want = threads.update_threads(overlap)
    assert eng.update.threads == want == (32 - threads.RESERVED_CORES if overlap else 32)
    if eng.update.layered is not None:
        assert eng.update.layered.stream.threads == want
        seen = []
        eng.update.layered.stream.submit(lambda: (seen.append(torch.get_num_threads()), 0)[1], (), "probe", 0)
        eng.update.layered.stream.synchronize()
        assert seen == [want]


@pytest.mark.parametrize("residency", [{"weights": 1, "optimizer": 1}, "stream"])
def test_updates_on_the_callers_thread_take_the_update_share(launched, residency):
    """The resident parameters' update and an optimizer-resident layer's run on the caller's thread at step(): an
    unfused AdamW's whole-group passes there take the update's share, not the launcher's 1."""
    from conftest import make_batches

    from megatrain.config import EngineConfig
    from megatrain.engine import Engine
    from megatrain.engine.update import update as update_module

    model = tiny_model(layers=1, hidden=32, vocab=128)
    eng = Engine(model, EngineConfig(device="cpu", compute_dtype="float32", optimizer_overlap=True,
                                     residency=residency, parity_probe=False),
                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, fused=False))
    seen, inner = [], update_module.update_group
    launched.setattr(update_module, "update_group", lambda *a, **k: (seen.append(torch.get_num_threads()), inner(*a, **k))[1])
    (batch,) = make_batches(1, vocab=128)
    eng.backward(eng(**batch).loss)
    eng.step()
    eng.synchronize()
    assert seen and torch.get_num_threads() == 1  # the caller's count is back after the step
    assert all(n == eng.update.threads for n in seen), seen
