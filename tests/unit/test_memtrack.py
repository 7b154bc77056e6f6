"""Measured device memory on a CPU "device" is installed on the engine's class, not on the instance.

The engine's forward and backward run under its tracker through `memtrack.tracked` (a decorator on
`Engine`), entering the tracker's context manager per call: no bound method is rebound on the engine.
"""

from __future__ import annotations

import torch
from conftest import make_batches, tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.runtime.memtrack import DeviceMemoryTracker, tracked


def test_forward_and_backward_are_measured_without_rebinding_them_on_the_engine():
    eng = Engine(tiny_model("llama", layers=2), EngineConfig(measure_device_memory=True))
    assert "forward" not in vars(eng) and "backward" not in vars(eng)
    b = make_batches(1)[0]
    eng.backward(eng.module(**b).loss)
    assert eng.memory.peak > 0  # the step's storages were counted
    eng.synchronize()
    eng.memory = None  # untracked from the next call on
    eng.backward(eng.module(**b).loss)
    eng.synchronize()
    eng.memory = fresh = DeviceMemoryTracker(eng.device)  # and a tracker set later counts the next call
    eng.backward(eng.module(**b).loss)
    assert fresh.peak > 0


def test_tracked_enters_the_objects_tracker_per_call():
    class Holder:
        memory: DeviceMemoryTracker | None = None

        @tracked
        def make(self) -> torch.Tensor:
            return torch.ones(1000)

    h = Holder()
    h.make()  # no tracker: runs untracked
    h.memory = DeviceMemoryTracker(torch.device("cpu"))
    kept = h.make()
    assert h.memory.peak == h.memory.live == kept.untyped_storage().nbytes()
    h.memory = None  # a tracker cleared later stops tracking at the next call
    h.make()
