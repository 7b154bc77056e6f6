"""The resident parameters' gradients (head, final norm, embedding rows) reduced off the compute thread
(engine/pipeline/global_grads.py), as on CUDA: the threaded path run on the CPU with a slow link, against the
synchronous one, and a negative control without the wait."""

from __future__ import annotations

import pytest
import torch
from conftest import make_batches, tiny_model
from kit import train_steps

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.pipeline.global_grads import GlobalGradSink


def _engine(asynchronous: bool, **cfg) -> Engine:
    eng = Engine(tiny_model("llama", layers=2, hidden=32), EngineConfig(compute_dtype="bfloat16", **cfg))
    eng._global_grads = GlobalGradSink(eng.store, eng.streams, eng.pipeline, eng.compute_dtype,
                                       asynchronous=asynchronous)
    if asynchronous:
        eng.streams.d2h.stall_s = 0.03  # every job on the worker late: a missing wait reads a stale slab
    return eng


def _train(eng: Engine, steps: int = 3, accum: int = 2, clip: float | None = 0.5) -> list[torch.Tensor]:
    train_steps(eng, make_batches(steps * accum, seq=12), steps, accum=accum, clip=clip)
    eng.synchronize()
    return [p.detach().clone() for _, p in eng.named_parameters()]


@pytest.mark.parametrize("master", ["fp32", "hilo"])  # hilo with overlap: the GPU's defaults
@pytest.mark.parametrize("overlap", [False, True])
def test_threaded_resident_gradients_train_exactly_as_synchronous_ones(overlap, master):
    want = _train(_engine(False, optimizer_overlap=overlap, host_master=master))
    got = _train(_engine(True, optimizer_overlap=overlap, host_master=master))
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_first_gradients_read_after_backward_are_whole():
    engines = [_engine(False), _engine(True)]
    b = make_batches(1, seq=12)[0]
    for eng in engines:
        eng.backward(eng(**b).loss)
        eng.synchronize()
    g0, g1 = (eng.store.globals.grad.clone() for eng in engines)
    assert g0.abs().sum() > 0 and torch.equal(g0, g1)


def test_a_missing_wait_is_caught(monkeypatch):
    want = _train(_engine(False), steps=2, clip=None)
    eng = _engine(True)
    monkeypatch.setattr(eng.events, "wait_global_grads", lambda: None)
    eng.events.globals_landed.clear()
    got = _train(eng, steps=2, clip=None)
    eng.synchronize()
    assert any(not torch.equal(a, b) for a, b in zip(want, got))
