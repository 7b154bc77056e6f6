"""The resident parameters' gradients (head, final norm, embedding rows) are reduced on a worker of their own
(engine/pipeline/global_grads.py), not on the layers' reducer: the head's vocab x hidden add, ready first in each
backward, no longer holds the layers' reductions behind it. Run on the CPU with the sink's threaded path
(`asynchronous=True`, as on CUDA); on the old code the head's add ran on the layers' worker first and the first
layer's reduction waited for it."""

from __future__ import annotations

import threading
import time

import torch
from conftest import make_batches, tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.host.slab_state import SlabState
from megatrain.engine.pipeline import global_grads
from megatrain.engine.pipeline.global_grads import GlobalGradSink

SLOW_S = 2.0  # the head's add, held: far longer than a tiny layer's reduction, even on a loaded 2-core machine


def test_the_first_layers_reduction_is_not_queued_behind_the_heads(monkeypatch):
    eng = Engine(tiny_model("llama", layers=2, hidden=32), EngineConfig(parity_probe=False))
    eng._global_grads = GlobalGradSink(eng.store, eng.streams, eng.pipeline, eng.compute_dtype, asynchronous=True)
    head: dict[str, float] = {}
    layers: list[tuple[int, float, str]] = []
    accumulate, reduce = global_grads.accumulate, SlabState.reduce

    # Only this engine's work is recorded: an engine an earlier test left with jobs still queued (a negative
    # control without its waits) may run them meanwhile through the same patched functions.
    ours = eng.store.globals.grad.untyped_storage().data_ptr()

    def slow_head_add(dst, *a, **k) -> None:
        if dst.untyped_storage().data_ptr() != ours:
            return accumulate(dst, *a, **k)
        head.setdefault("start", time.perf_counter())
        time.sleep(SLOW_S)
        accumulate(dst, *a, **k)
        head["end"] = time.perf_counter()

    def timed_reduce(self, i, *a) -> None:
        if self is eng.events.slabs:
            layers.append((i, time.perf_counter(), threading.current_thread().name))
        reduce(self, i, *a)

    monkeypatch.setattr(global_grads, "accumulate", slow_head_add)
    monkeypatch.setattr(SlabState, "reduce", timed_reduce)
    eng.backward(eng(**make_batches(1, seq=12)[0]).loss)
    eng.synchronize()
    assert head and len(layers) == len(eng.store.layers)
    first_layer = min(t for _, t, _ in layers)
    assert first_layer < head["end"] - SLOW_S / 2, "a layer's reduction waited for the head's add"
    assert all("globals" not in name for _, _, name in layers)  # the layers' worker, not the sink's
    assert eng.store.globals.grad.abs().sum() > 0  # and the head's gradient landed (the step waits for it)


def test_the_resident_gradients_land_before_a_reader_on_their_own_worker():
    """The sink's worker is ordered for readers as the shared one was: synchronize() sees the head's gradient."""
    engines = []
    for asynchronous in (False, True):
        eng = Engine(tiny_model("llama", layers=2, hidden=32), EngineConfig(parity_probe=False))
        eng._global_grads = GlobalGradSink(eng.store, eng.streams, eng.pipeline, eng.compute_dtype,
                                           asynchronous=asynchronous)
        if asynchronous:
            eng._global_grads._reducer.stall_s = 0.05  # every add late: a missing wait would read a partial slab
        for b in make_batches(2, seq=12):
            eng.backward(eng(**b).loss / 2)
        eng.synchronize()
        engines.append(eng.store.globals.grad.clone())
    assert torch.equal(*engines)
