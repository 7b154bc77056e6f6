"""A device out-of-memory error in a forward lowers residency once, says so, and redoes the forward in the same bits
(engine/runtime/oom.py). The device is emulated: a CPU device under a 6 MiB budget with an emulated link (kept layers
get buffers of their own, as on a GPU), whose training keeps every layer's weights and graphs; "the device" runs out
while a layer records its graph beyond the first `ROOM` ones (a patched allocation raising torch.OutOfMemoryError,
what the caching allocator raises)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from conftest import make_batches, tiny_model
from kit import bits, train_steps

from megatrain.config import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.pipeline import schedule
from megatrain.engine.runtime import oom

LAYERS, ROOM = 6, 2
EMULATED = {"compute_dtype": "float32", "device_budget_bytes": 6 << 20, "link_gbps": 100.0}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _engine(residency="auto") -> Engine:
    torch.manual_seed(0)
    model = tiny_model("llama", layers=LAYERS)
    return Engine(model, EngineConfig(residency=residency, **EMULATED),
                  optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))


def _device_holds_graphs(monkeypatch, room: int) -> list[int]:
    """The emulated device runs out recording a kept graph past the first `room`: the layers it failed at."""
    failed: list[int] = []
    keep = schedule.LayerPipeline._forward_keep

    def forward_keep(self, i, *args, **kwargs):
        if i >= room:
            failed.append(i)
            raise torch.OutOfMemoryError(f"emulated: CUDA out of memory recording layer {i}'s graph")
        return keep(self, i, *args, **kwargs)

    monkeypatch.setattr(schedule.LayerPipeline, "_forward_keep", forward_keep)
    return failed


def _train(eng: Engine, batches: list[dict]) -> tuple[list[float], list[torch.Tensor]]:
    losses, _ = train_steps(eng, batches, len(batches))
    eng.synchronize()
    return losses, [v.detach().clone() for v in eng.state_dict().values()]


def test_an_oom_in_a_forward_lowers_residency_once_and_redoes_it_in_the_same_bits(monkeypatch, caplog):
    batches = make_batches(3)
    want = _train(_engine("stream"), batches)
    whole = _engine()
    _train(whole, batches[:1])
    assert whole.pipeline.residency_stats()["kept_graph_layers"] == LAYERS  # what it keeps with room for it

    failed = _device_holds_graphs(monkeypatch, ROOM)
    eng = _engine()
    with caplog.at_level(logging.WARNING, logger="megatrain"):
        got = _train(eng, batches)
    assert failed == [ROOM]  # one error, at the first graph past the room; none after the lowering
    kept = eng.pipeline.residency_stats()["kept_graph_layers"]
    assert kept <= ROOM, kept
    said = oom.lowered(eng)
    assert said is not None and "residency lowered once" in said
    assert any("redoing the forward" in r.getMessage() for r in caplog.records)
    assert got[0] == want[0]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got[1], want[1]))


def _device_full(monkeypatch) -> list[str]:
    """Every layer's forward runs out of device memory, kept or streamed: the calls that failed."""
    failed: list[str] = []

    def full(what):
        def run(*a, **k):
            failed.append(what)
            raise torch.OutOfMemoryError(f"emulated: CUDA out of memory in a layer's {what}")
        return run

    monkeypatch.setattr(schedule.LayerPipeline, "_forward_keep", full("kept forward"))
    monkeypatch.setattr(schedule.LayerPipeline, "_call", full("forward"))
    return failed


def test_a_second_oom_is_raised_and_so_is_one_with_nothing_to_give_up(monkeypatch):
    b = make_batches(1)[0]
    eng = _engine()
    failed = _device_full(monkeypatch)
    with pytest.raises(torch.OutOfMemoryError):  # lowered, redone, out of memory again: raised
        eng(**b)
    assert failed == ["kept forward", "forward"]  # the retry kept no graph (5 layers' weights only), streamed
    budget = eng.pipeline.policy.budget
    with pytest.raises(torch.OutOfMemoryError):  # once per engine: never lowered again
        eng(**b)
    assert eng.pipeline.policy.budget == budget and len(failed) == 3
    streamed = _engine("stream")  # nothing kept: nothing to give up, the error as it is
    with pytest.raises(torch.OutOfMemoryError):
        streamed(**b)
    assert oom.lowered(streamed) is None and len(failed) == 4


def test_negative_control_without_the_lowering_the_error_ends_the_forward(monkeypatch):
    _device_holds_graphs(monkeypatch, ROOM)
    monkeypatch.setattr(oom, "lower_residency", lambda pipeline, tokens: None)
    with pytest.raises(torch.OutOfMemoryError):
        _engine()(**make_batches(1)[0])


def test_an_oom_in_backward_lowers_the_next_steps_residency_and_is_raised(monkeypatch):
    eng = _engine()
    b = make_batches(1)[0]
    out = eng(**b)
    before = eng.pipeline.policy.budget
    monkeypatch.setattr(schedule.LayerPipeline, "backward", lambda *a, **k: (_ for _ in ()).throw(
        torch.OutOfMemoryError("emulated")))
    with pytest.raises(torch.OutOfMemoryError):
        eng.backward(out.loss)
    assert eng.pipeline.policy.budget < before and oom.lowered(eng) is not None
