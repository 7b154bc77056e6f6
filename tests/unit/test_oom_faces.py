"""An out-of-memory error in a backward and one in a step's update, through both faces (megatrain.initialize's engine
and the Accelerate face): each lowers residency once (an engine lowers once: the second error here would raise, so
each run injects one), the face's own counters see one step, and the run trains the bits of the run with no error
(engine/runtime/oom.py; the engine-level tests, tests/unit/test_oom_backward_step.py, compare with a run started at
the lowered residency). The emulated device and the injections are that file's."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from conftest import make_batches, tiny_model
from kit import bits, fresh_accelerate_state
from test_oom_backward_step import EMULATED, LAYERS, _fail_device_update, _fail_grads_once, _sends

import megatrain
from megatrain.engine import engines_holding
from megatrain.engine.runtime import oom

STEPS = 3


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_model("llama", layers=LAYERS)


def _deepspeed(monkeypatch, fail: str | None) -> tuple[list[float], list[torch.Tensor], object]:
    model = _model()
    cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
           "steps_per_print": 10**6, "megatrain": EMULATED}
    ds, *_ = megatrain.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg)
    eng = engines_holding(list(model.parameters()))[0]
    _inject(monkeypatch, eng, fail)
    losses = []
    for b in make_batches(STEPS):
        loss = ds(**b).loss
        ds.backward(loss)
        ds.step()
        losses.append(loss.item())
    monkeypatch.undo()
    assert ds.global_steps == STEPS and ds.skipped_steps == 0 and ds.was_step_applied()
    return losses, [v.clone() for v in eng.state_dict().values()], eng


def _accelerate(monkeypatch, fail: str | None) -> tuple[list[float], list[torch.Tensor], object]:
    fresh_accelerate_state()
    model = _model()
    acc = megatrain.Accelerator(backend="megatrain", config={"megatrain": EMULATED})
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    eng = engines_holding(list(model.parameters()))[0]
    _inject(monkeypatch, eng, fail)
    losses = []
    for b in make_batches(STEPS):
        loss = model(**b).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    monkeypatch.undo()
    assert not acc.optimizer_step_was_skipped
    return losses, [v.clone() for v in eng.state_dict().values()], eng


def _inject(monkeypatch, eng, fail: str | None) -> None:
    if fail == "backward":
        _sends(monkeypatch)
        _fail_grads_once(monkeypatch, call=2)  # layer 3 of the first backward
    elif fail == "update":
        _fail_device_update(monkeypatch, eng, layer=2, step=1)


@pytest.mark.parametrize("face", [_deepspeed, _accelerate], ids=["deepspeed", "accelerate"])
@pytest.mark.parametrize("fail", ["backward", "update"])
def test_an_oom_through_a_face_goes_on_in_the_same_bits(monkeypatch, caplog, face, fail):
    want = face(monkeypatch, None)
    assert oom.lowered(want[2]) is None
    with caplog.at_level(logging.WARNING, logger="megatrain"):
        got = face(monkeypatch, fail)
    said = [r.getMessage() for r in caplog.records if "residency lowered once" in r.getMessage()]
    assert len(said) == 1 and ("goes on from layer 3" if fail == "backward" else "redoing the step's update") in \
        said[0], said
    assert oom.lowered(got[2]) is not None
    assert got[0] == want[0]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got[1], want[1]))
