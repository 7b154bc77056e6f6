"""A device out-of-memory error in a backward or in a step's update lowers residency once, says so (one warning, the
resident-layer count before and after), leaves nothing applied twice or half, and goes on: the parameters and Adam
state after three steps are bit-identical to a run that started at the lowered residency (engine/runtime/oom.py).
A second error raises StillOutOfMemory naming what to set.

The device is emulated as in test_oom.py: a CPU device under a 24 MiB budget with an emulated link, where "auto"
keeps every layer's weights and graphs and puts layers 0-3 and the resident parameters' optimizer on the device
(updated on the caller's thread at step(), after the host layers are queued: optimizer_overlap, a GPU's default).
An error is injected by a patched call raising torch.OutOfMemoryError, what the caching allocator raises."""

from __future__ import annotations

import logging
import threading
import warnings

import pytest
import torch
import torch.optim.adam as torch_adam
from conftest import make_batches, tiny_model
from kit import adam_state, bits, train_steps

from megatrain.config import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.pipeline import schedule
from megatrain.engine.runtime import oom
from megatrain.engine.update import update as update_path

LAYERS, STEPS = 6, 3
EMULATED = {"compute_dtype": "float32", "device_budget_bytes": 24 << 20, "link_gbps": 100.0,
            "optimizer_overlap": True, "parity_probe": False}  # (the probe would meet the injected errors)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _engine(budget: int | None = None) -> Engine:
    """The emulated engine; `budget`: the device budget its plans start from (the optimizer's placement is made at
    the configured one either way, as for the run an error lowered)."""
    torch.manual_seed(0)
    model = tiny_model("llama", layers=LAYERS)
    eng = Engine(model, EngineConfig(**EMULATED), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    if budget is not None:
        eng.pipeline.policy.budget = budget
    return eng


def _train(eng: Engine, batches: list[dict], clip: float | None = None,
           accum: int = 1) -> tuple[list[float], list[torch.Tensor], list[torch.Tensor]]:
    losses, norms = train_steps(eng, batches, len(batches) // accum, accum=accum, clip=clip)
    assert not clip or all(n > clip for n in norms)  # every step's clip scales: its coefficient pending on the slabs
    eng.synchronize()
    return losses, [v.detach().clone() for v in eng.state_dict().values()], adam_state(eng)


def _same(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(bits(x), bits(y)) for x, y in zip(a[1] + a[2], b[1] + b[2]))


def _sends(monkeypatch) -> list[int]:
    """The layers whose gradients the pipeline sends to the host, in order."""
    sent: list[int] = []
    send = schedule.LayerPipeline._send_grad

    def counted(self, layer, *args, **kwargs):
        sent.append(layer)
        return send(self, layer, *args, **kwargs)

    monkeypatch.setattr(schedule.LayerPipeline, "_send_grad", counted)
    return sent


def _fail_grads_once(monkeypatch, call: int, times: int = 1) -> list[int]:
    """The `call`-th layer backward (counted from the first backward, last layer first) runs out of memory inside
    autograd (a kept graph's backward half done: its graph cannot be used again), `times` times in a row."""
    calls: list[int] = []
    grads = schedule.LayerPipeline._grads

    def failing(self, *args, **kwargs):
        calls.append(len(calls))
        if call <= len(calls) - 1 < call + times:
            raise torch.OutOfMemoryError("emulated: CUDA out of memory in a layer's backward")
        return grads(self, *args, **kwargs)

    monkeypatch.setattr(schedule.LayerPipeline, "_grads", failing)
    return calls


def test_the_emulated_engine_keeps_graphs_and_updates_layers_on_the_device():
    eng = _engine()
    _train(eng, make_batches(1))
    assert eng.pipeline.residency_stats()["kept_graph_layers"] == LAYERS
    assert eng.optimizer_layers == frozenset({0, 1, 2, 3}) and eng.globals_on_device
    assert type(eng.update) is update_path.Layered


# accum 2: the error in the second micro-batch's backward, whose slabs hold the first's gradients already.
@pytest.mark.parametrize("accum", [1, 2])
def test_an_oom_in_a_backward_goes_on_below_the_layers_it_sent_in_the_same_bits(monkeypatch, caplog, accum):
    batches = make_batches(STEPS * accum)
    sent = _sends(monkeypatch)
    at = (accum - 1) * LAYERS  # the failing backward's first layer call
    calls = _fail_grads_once(monkeypatch, call=at + 2)  # its layer 3 (layers 5 and 4 sent theirs)
    eng = _engine()
    with caplog.at_level(logging.WARNING, logger="megatrain"):
        got = _train(eng, batches, accum=accum)
    said = [r.getMessage() for r in caplog.records if "residency lowered once" in r.getMessage()]
    assert len(said) == 1 and "goes on from layer 3" in said[0], said
    assert f"{LAYERS} -> " in said[0] and "resident layers" in said[0]
    # Every layer's gradients sent once per backward: 5, 4 before the error, 3..0 after it, none twice.
    assert sent[at: at + LAYERS] == list(range(LAYERS - 1, -1, -1)), sent[at: at + LAYERS]
    assert len(sent) == LAYERS * STEPS * accum and len(calls) == LAYERS * STEPS * accum + 1
    assert eng.pipeline.policy.budget < EMULATED["device_budget_bytes"]
    assert eng.pipeline.residency_stats()["kept_graph_layers"] < LAYERS  # the later steps keep less
    monkeypatch.undo()
    want = _train(_engine(eng.pipeline.policy.budget), batches, accum=accum)  # started at the lowered residency
    assert _same(got, want)
    assert _same(got, _train(_engine(), batches, accum=accum))  # and what the run with no error trains


def test_a_second_oom_in_a_backward_says_what_to_set(monkeypatch):
    _fail_grads_once(monkeypatch, call=2, times=2)
    eng = _engine()
    b = make_batches(1)[0]
    out = eng(**b)
    with pytest.raises(oom.StillOutOfMemory, match=r'residency to "stream".*device_budget_bytes.*zero_grad'):
        eng.backward(out.loss)


def _fail_device_update(monkeypatch, eng: Engine, layer: int, step: int,
                        counted: bool = False) -> list[tuple[int, int]]:
    """`eng`'s device-resident layer `layer`'s update at the `step`-th step() runs out of memory, once: on the first
    step inside torch's AdamW, with its state made as torch makes it before the update (later steps of this
    emulation take the engine's fused host pass, update/fused.py, where the layer's update fails as it starts);
    `counted`: after torch's AdamW added one to the step counters (it counts before it writes the moments). The
    (step, layer) of every device-resident layer update that ran to its end."""
    done: list[tuple[int, int]] = []
    device = eng.optimizer_layers
    at = {"step": 0, "armed": False, "failed": False}
    update_layer, queue, adam = update_path.update_layer, update_path.Layered._queue, torch_adam._fused_adam

    def counting(self, *args, **kwargs):
        at["step"] += 1
        return queue(self, *args, **kwargs)

    def fail(state_steps=()):
        at["armed"], at["failed"] = False, True
        if counted:
            for t in state_steps:
                t.add_(1)
        raise torch.OutOfMemoryError("emulated: CUDA out of memory in a device-resident layer's AdamW")

    # Armed on the thread that updates `layer` (the caller's): the host layers update beside it on the optimizer's.
    def failing_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *args, **kwargs):
        if at["armed"] == threading.get_ident():
            fail(state_steps)
        return adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *args, **kwargs)

    def watched(layered, group, i, coefs, threads=None):
        if i == layer and at["step"] == step and not at["failed"]:
            at["armed"] = threading.get_ident()
            if step > 1:
                fail()
        try:
            update_layer(layered, group, i, coefs, threads)
        finally:
            if i == layer:
                at["armed"] = False
        if i in device:
            done.append((at["step"], i))

    monkeypatch.setattr(update_path.Layered, "_queue", counting)
    monkeypatch.setattr(update_path, "update_layer", watched)
    monkeypatch.setattr(torch_adam, "_fused_adam", failing_adam)
    return done


# The first step: the Adam state made by the attempt that failed; with a clip: the failed layer's FP32 slab already
# scaled in place by the clip its update applies (update.py: folded), not to be scaled again.
@pytest.mark.parametrize(("step", "clip"), [(1, None), (2, None), (1, 0.05)])
def test_an_oom_in_a_device_layers_update_redoes_what_was_not_done_in_the_same_bits(monkeypatch, caplog, step, clip):
    batches = make_batches(STEPS)
    eng = _engine()
    done = _fail_device_update(monkeypatch, eng, layer=2, step=step)
    with caplog.at_level(logging.WARNING, logger="megatrain"):
        got = _train(eng, batches, clip)
    said = [r.getMessage() for r in caplog.records if "residency lowered once" in r.getMessage()]
    # the parts updated on the caller's thread: the resident parameters, layers 0-3; layer 2's and 3's redone
    assert len(said) == 1 and "redoing the step's update (2 of its 5 device parts)" in said[0], said
    assert f"{LAYERS} -> " in said[0]
    # Every device-resident layer updated once a step: 0, 1 before the error, 2, 3 after it.
    assert done == [(s, i) for s in range(1, STEPS + 1) for i in range(4)], done
    monkeypatch.undo()
    want = _train(_engine(eng.pipeline.policy.budget), batches, clip)
    assert _same(got, want)
    assert _same(got, _train(_engine(), batches, clip))


def test_an_update_that_counted_its_step_is_refused_not_applied_twice(monkeypatch):
    eng = _engine()
    _fail_device_update(monkeypatch, eng, layer=2, step=1, counted=True)
    eng.backward(eng(**make_batches(1)[0]).loss)
    with pytest.raises(oom.StillOutOfMemory, match="counted the step.*cannot be taken back.*last checkpoint"):
        eng.step()


def test_negative_control_without_the_redo_the_step_ends(monkeypatch):
    eng = _engine()
    _fail_device_update(monkeypatch, eng, layer=2, step=1)
    monkeypatch.setattr(oom, "lower_residency", lambda pipeline, tokens: None)
    b = make_batches(1)[0]
    eng.backward(eng(**b).loss)
    with pytest.raises(torch.OutOfMemoryError):
        eng.step()
