"""The residency a run chose at its start, saved with its checkpoints and placed again on resume.

"auto" sizes how many layers update on the device from the free memory at the start (engine/update/resident.py);
on a GPU those layers update with torch's AdamW and the rest with the host's kernel, so the same run resumed on a
card with other free memory would train other bits. The checkpoint records the count (train_state.residency_record)
and an engine built with `CheckpointResidency(record)` places it again. Emulated here: a CPU device under two
device budgets, one that holds two layers' optimizer state and one that holds one. (On a CPU device the device's
update is the host's own function, so the bits agree whatever the count: what is checked is the count placed, and
that a resume trains on as the run would have.)
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_batches, tiny_model
from kit import bits, train_steps

from megatrain.config import EngineConfig
from megatrain.costs.residency import OPTIMIZER_BYTES_PER_PARAM
from megatrain.engine import Engine
from megatrain.run import checkpoint as ckpt
from megatrain.run import train_state as ts

LAYERS = 4


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a budget the emulation is tight in warns: not this test's subject
        yield


def _model():
    torch.manual_seed(0)
    return tiny_model("llama", layers=LAYERS)


def _engine(budget: int, advice=None) -> Engine:
    model = _model()
    return Engine(model, EngineConfig(parity_probe=False, compute_dtype="float32", device_budget_bytes=budget),
                  optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), placement_advice=advice)


def _budget_for(k: int) -> int:
    """A budget whose "auto" keeps exactly `k` layers' optimizer state (test_optimizer_residency's arithmetic)."""
    probe = _engine(2**40).pipeline.policy
    per_layer = probe.dims.numel * OPTIMIZER_BYTES_PER_PARAM
    base = probe.fixed_bytes - LAYERS * per_layer
    reserve = probe._plan(4096).predicted_peak_bytes - probe.fixed_bytes
    return int((base + reserve + probe._weights_bytes(LAYERS) + k * per_layer + per_layer // 2) / 0.9) + 1


def _steps(eng: Engine, batches: list[dict]) -> list[float]:
    losses, _ = train_steps(eng, batches, len(batches))
    eng.synchronize()
    return losses


def _save(eng: Engine, where) -> None:
    weights = {n: p.detach() for n, p in eng.named_parameters()}
    ts.save_engine_checkpoint(where, "step2", weights=weights, optimizer_state=eng.optimizer.state_dict(),
                              scheduler=None, counters={"global_steps": 2}, config={}, client_state=None, write=True,
                              residency=ts.residency_record(eng))


def _resume(where, budget: int, use_record: bool) -> Engine:
    weights, meta, _, tensors = ts.load_engine_checkpoint(where, None)
    record = ts.saved_residency(meta)
    eng = _engine(budget, ts.CheckpointResidency(record) if use_record else None)
    eng.load_state_dict(weights)  # read one at a time (each valid until the next is read)
    eng.optimizer.load_state_dict(ts.optimizer_from(meta, tensors, eng.optimizer))
    eng.zero_grad()
    return eng


def test_a_resume_on_a_smaller_device_places_the_runs_count_and_trains_its_bits(tmp_path):
    two, one = _budget_for(2), _budget_for(1)
    batches = make_batches(4)
    run = _engine(two)
    assert len(run.optimizer_layers) == 2
    _steps(run, batches[:2])
    _save(run, tmp_path)
    assert ts.saved_residency(ckpt.load(tmp_path)[1]) == {"optimizer_layers": 2, "globals_on_device": True,
                                                           "layers": LAYERS, "device": "cpu"}
    want = _steps(run, batches[2:])
    masters = [p.detach().clone() for p in run.state_dict().values()]

    resumed = _resume(tmp_path, one, use_record=True)
    assert len(resumed.optimizer_layers) == 2 and resumed.placement_advice.source == "from checkpoint"
    assert ts.resumed_residency(resumed, ts.saved_residency(ckpt.load(tmp_path)[1])) is None
    got = _steps(resumed, batches[2:])
    assert got == want
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(resumed.state_dict().values(), masters))

    # Control: without the record "auto" sizes it from this device's budget, and the resume says what differs.
    chosen = _resume(tmp_path, one, use_record=False)
    assert len(chosen.optimizer_layers) == 1
    why = ts.resumed_residency(chosen, ts.saved_residency(ckpt.load(tmp_path)[1]))
    assert why is not None and "updated 2 layers on its device, this engine 1" in why


def test_the_accelerate_folder_keeps_the_record_and_an_old_checkpoint_has_none(tmp_path):
    eng = _engine(_budget_for(1))
    record = ts.residency_record(eng)
    (tmp_path / "new").mkdir()
    ts.write_weights(tmp_path / "new", {}, {}, residency=record)
    assert ts.saved_residency(tmp_path / "new") == record
    (tmp_path / "old").mkdir()
    ts.write_weights(tmp_path / "old", {}, {})
    assert ts.saved_residency(tmp_path / "old") is None and ts.saved_residency({"kind": "x"}) is None
    assert ts.resumed_residency(eng, None) is None
    with pytest.raises(ValueError, match="optimizer_layers"):
        ts.CheckpointResidency({"optimizer_layers": -1})
