"""The NVMe tier (engine/host/spill.py, costs/nvme.py): spilled training is the in-memory training bit for bit, with
less host memory, files that exist only while it trains, and clear refusals before any work.

- half the store's host bytes as the budget: bit-identical weights and optimizer state (hi/lo masters, clipping,
  accumulation 2, AdamW), peak RSS growth <= 0.7x the in-memory run's, the state file under nvme_path while it
  trains and nothing after, also when an exception ends the process (a forked child per run:
  tests/workers/nvme_rss_worker.py);
- a plan with some layers resident and some spilled, the updates overlapped with the next forward: bit-identical;
  negative control: a write-behind that writes nothing must change the result;
- a budget below one layer's working set is refused naming the minimum, and that minimum trains;
- an unwritable nvme_path and a full disk are refused naming the path and the bytes, before training starts.
"""

from __future__ import annotations

import copy
import errno
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import make_batches, tiny_model
from kit import bf16_engine, run_python
from test_host_modes import _differences, _train

from megatrain.config.schema import EngineConfig
from megatrain.costs.nvme import BudgetTooSmall, plan_spill, record_bytes
from megatrain.engine.host.spill import NvmeSpaceError, SpillFile, record_sizes, store_fixed_bytes

WORKER = Path(__file__).resolve().parents[1] / "workers" / "nvme_rss_worker.py"


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=4)


@pytest.mark.slow
def test_half_budget_is_bit_identical_with_less_rss_and_files_only_while_training(tmp_path):
    proc = run_python([WORKER, tmp_path / "nvme"], timeout=600)
    assert proc.returncode == 1 and "a deliberate failure mid-training" in proc.stderr, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "files 1"  # the failing run's spill directory existed ...
    assert list((tmp_path / "nvme").iterdir()) == []  # ... and went with the exception that ended the process
    res = json.loads(lines[-2])
    mem, sp = res["memory"], res["spilled"]
    assert "error" not in sp, sp
    assert sp["digest"] == mem["digest"]  # every weight and optimizer tensor, bit for bit
    assert sp["plan"]["spilled"] > 0 and sp["plan"]["host"] <= mem["need"] // 2
    ratio = sp["peak_growth"] / mem["peak_growth"]
    assert ratio <= 0.7, f"peak RSS growth {sp['peak_growth']} vs {mem['peak_growth']} in memory: {ratio:.2f}x"
    files = sp["files"]
    assert len(files) == 1 and next(iter(files.values())) > 0, files  # the state file, while it trained
    assert sp["left"] == []  # removed with the engine


def test_mixed_plan_overlapped_is_bit_identical_and_a_lost_write_is_seen(model, tmp_path, monkeypatch):
    batches = make_batches(8)
    probe = bf16_engine(model, nvme_path=str(tmp_path / "a"))  # every layer spilled: its records tell the budget
    records = record_sizes(probe.optimizer, probe.store)
    fixed = store_fixed_bytes(probe.store, probe.optimizer)
    probe.spill.close()
    del probe
    budget = fixed + 2 * max(records) + records[0]  # two ring buffers and one layer resident, three spilled
    ref = bf16_engine(model, optimizer_overlap=True)
    sp = bf16_engine(model, optimizer_overlap=True, nvme_path=str(tmp_path / "b"), host_budget_bytes=budget)
    assert len(sp.spill.order) == 3 and sp.spill.plan.slots == 2
    assert _train(ref, batches, 3, accum=2, clip=0.5) == _train(sp, batches, 3, accum=2, clip=0.5)
    assert _differences(ref, sp) == []
    assert sp.spill.stats()["nvme_bytes_written"] > 0

    # Negative control: the write behind each update lost: the next read brings back stale state.
    monkeypatch.setattr(SpillFile, "write", lambda self, buf, offset: None)
    bad = bf16_engine(model, nvme_path=str(tmp_path / "c"))
    _train(bad, batches, 3, accum=2, clip=0.5)
    ref2 = bf16_engine(model)
    _train(ref2, batches, 3, accum=2, clip=0.5)
    assert _differences(ref2, bad), "a spill that loses its writes went unnoticed"


def test_a_budget_below_one_layers_working_set_is_refused_naming_the_minimum(model, tmp_path):
    with pytest.raises(BudgetTooSmall, match=r"the minimum is (\d+) bytes") as err:
        bf16_engine(model, host_master="hilo", nvme_path=str(tmp_path), host_budget_bytes=1000)
    minimum = int(err.value.args[0].split("the minimum is ")[1].split()[0])
    with pytest.raises(BudgetTooSmall):
        bf16_engine(model, host_master="hilo", nvme_path=str(tmp_path), host_budget_bytes=minimum - 1)
    eng = bf16_engine(model, host_master="hilo", nvme_path=str(tmp_path), host_budget_bytes=minimum)
    assert eng.spill.plan.slots == 1 and len(eng.spill.order) == 4  # every layer spilled, one ring buffer
    ref = bf16_engine(model, host_master="hilo")
    batches = make_batches(4)
    assert _train(eng, batches, 2, clip=0.5) == _train(ref, batches, 2, clip=0.5)
    assert _differences(ref, eng) == []


def test_plan_keeps_layers_resident_while_they_fit():
    recs = [record_bytes([4096 * 3])] * 4
    assert plan_spill(100, recs, None).spilled == (0, 1, 2, 3)
    assert plan_spill(100, recs, 100 + 4 * recs[0]).spilled == ()  # everything fits: nothing spills
    p = plan_spill(100, recs, 100 + 3 * recs[0])
    assert len(p.spilled) == 3 and p.slots == 2 and p.resident_bytes <= 100 + 3 * recs[0]
    p = plan_spill(100, [recs[0]] * 96, 100 + 2 * recs[0] + 85 * recs[0])  # 11 of 96 spill, spread out
    assert len(p.spilled) == 11 and min(b - a for a, b in zip(p.spilled, p.spilled[1:])) >= 8


def test_unwritable_path_and_full_disk_are_refused_before_training(model, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(NvmeSpaceError, match=rf"nvme_path='{blocker}/sub'.*\d+ bytes"):
        bf16_engine(model, nvme_path=str(blocker / "sub"))

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(NvmeSpaceError, match=r"(\d+) bytes .* could not be allocated .*No space left") as err:
        bf16_engine(model, nvme_path=str(tmp_path / "full"))
    assert str(tmp_path / "full") in str(err.value)
    assert list((tmp_path / "full").iterdir()) == []  # nothing left behind


@pytest.mark.parametrize("cfg, message", [
    ({"nvme_path": "/tmp/x", "optimizer_in_backward": True}, "optimizer_in_backward"),
    ({"nvme_path": "/tmp/x", "data_parallel_host": "shared"}, "replicated"),
    ({"nvme_path": "/tmp/x", "host_budget_bytes": -1}, "host_budget_bytes=-1"),
    ({"nvme_path": ""}, "nvme_path=''"),
    ({"nvme_gbps": 1.0}, "set nvme_path too"),
])
def test_settings_are_checked(cfg, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**cfg)


def test_a_misspelled_key_gets_a_suggestion():
    with pytest.raises(ValueError, match="did you mean 'nvme_path'"):
        EngineConfig.from_dict({"nvme_pth": "/tmp"})


def test_a_zero_infinity_config_spills_the_optimizer_state_to_its_nvme_path(model, tmp_path):
    """DeepSpeed's `offload_optimizer: {device: nvme, nvme_path}` is the NVMe tier at that path, on the face."""
    from megatrain.deepspeed import initialize

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    engine, *_ = initialize(model=copy.deepcopy(model), config=cfg)
    batch = make_batches(1)[0]
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    spill = engine.engine.spill
    assert spill is not None and spill.plan.spilled == tuple(range(len(engine.engine.store.layers)))  # no budget: every layer
    assert [p.name for p in tmp_path.iterdir()] and all(p.name.startswith("megatrain-spill-") for p in tmp_path.iterdir())
    state = engine.engine.update.optimizer.state
    assert all(torch.isfinite(s["exp_avg"]).all() and s["exp_avg"].abs().sum() > 0
               for s in state.values() if "exp_avg" in s)  # the spilled moments were written and read back
