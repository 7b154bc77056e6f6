"""A sweep row's step time includes the host work the step causes (the optimizer's queued layer updates).

With optimizer overlap the layer updates run on a host thread after step() returns; a clock that stops there,
or stats that drain between steps, would leave them off the row. The control slows each layer's update by a
known sleep: every step's sleeps must be inside the row's step time.
"""

from __future__ import annotations

import time

import pytest

from experiments.point import per_step, run
from experiments.spec import Point
from megatrain.engine.update import update

SLEEP_S = 0.25  # well above a tiny model's whole step here, so the old clock could not reach it


def test_a_slowed_optimizer_lengthens_the_step(monkeypatch):
    from megatrain.planner.shapes import resolve_model

    pt = Point(backend="megatrain", model="tiny", seq_len=16, warmup=1, steps=2, threads=1,
               engine={"optimizer_overlap": True})
    run(pt)  # first, unslowed: the process's one-time costs (the compiled kernel's build) are paid here
    original = update.update_layer
    calls = []

    def slowed(*args, **kwargs):
        calls.append(1)
        time.sleep(SLEEP_S)
        return original(*args, **kwargs)

    monkeypatch.setattr(update, "update_layer", slowed)
    row = run(pt)
    layers = resolve_model("tiny").num_layers
    assert len(calls) == layers * (pt.warmup + pt.steps)  # the control did slow every layer's update
    assert row["step_time_s"] >= layers * SLEEP_S  # and every one of them is on the clock


def test_per_step_divides_only_what_adds_up():
    window = {"h2d_bytes": 300, "forward_s": 0.6, "peak_device_bytes": 1000, "tokens": 48}
    assert per_step(window, 3) == pytest.approx({"h2d_bytes": 100, "forward_s": 0.2, "peak_device_bytes": 1000,
                                                 "tokens": 16})
