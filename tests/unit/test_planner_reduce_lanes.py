"""The planner's replay puts the resident parameters' gradient reduction (head, final norm, embedding rows) on a
lane of its own, as the engine adds them on a host worker of their own (engine/pipeline/global_grads.py), beside
the layers' reducer: the head's add, queued first in each backward, no longer holds up the layers' adds."""

from __future__ import annotations

import pytest

from megatrain.models.presets import get_preset
from megatrain.planner.pipeline_sim import REDUCE, REDUCE_GLOBALS, LayerCosts, simulate_step
from megatrain.planner.point import make_point
from megatrain.planner.step_time import IDLE_DRAIN_LINK, IDLE_DRAIN_REDUCE, IDLE_LAYERS, _megatrain_idle

MODEL = get_preset("tiny").with_(name="tiny-4l", num_layers=4)
# A CUDA step whose layers' reductions keep up with backward (0.1 s against 2 s of compute) and whose head
# gradient's add is long (3 s: a large vocabulary on a slow host).
COSTS = LayerCosts(fwd=1.0, bwd=2.0, load=0.5, act=0.0, grad=0.1, reduce=0.1, cuda=True, recompute=0.75)
HEAD_ADD = 3.0


def _spans(sim, lane: str | None, kind: str) -> list[tuple[int, float, float]]:
    """(layer, start, end) of the spans of `kind` on `lane` (None: any lane)."""
    return [(layer, a, b) for ln, k, layer, a, b in sim.spans if lane in (None, ln) and k == kind]


def test_the_heads_reduction_does_not_delay_the_first_layers():
    p = make_point(MODEL, 64, 1, 1, "float32")
    sim = simulate_step(p, COSTS, head=0.3, globals_grads=(0.1, HEAD_ADD))[0]
    (_, head_start, head_end), = _spans(sim, None, "reduce-head-grad")
    assert head_end - head_start == pytest.approx(HEAD_ADD)
    first_layer, copy_start, copied = _spans(sim, "d2h", "grad")[0]
    assert first_layer == MODEL.num_layers - 1  # backward's first layer is the last one
    layer, start, end = _spans(sim, REDUCE, "reduce")[0]
    assert layer == first_layer
    # It starts the moment its gradients reach the host, while the head's add is still running (on a shared
    # lane it would start only at head_end).
    assert start == pytest.approx(copied) and start < head_end
    assert _spans(sim, REDUCE_GLOBALS, "reduce-head-grad") and not _spans(sim, REDUCE, "reduce-head-grad")
    assert sim.staging_wait == 0.0  # the layers' staging slots never fill behind the head


def test_the_heads_add_still_waits_for_its_copy_and_the_step_drains_it():
    p = make_point(MODEL, 64, 1, 1, "float32")
    sim, _, _, drain = simulate_step(p, COSTS, head=0.3, globals_grads=(0.1, 100.0))
    (_, head_copy_start, head_copied), = _spans(sim, "d2h", "head-grad")
    (_, head_start, head_end), = _spans(sim, REDUCE_GLOBALS, "reduce-head-grad")
    assert head_start == pytest.approx(head_copied)
    # The optimizer waits for every gradient: the resident ones' add is the last to end here.
    assert sim.drained_by == REDUCE_GLOBALS and sim.t == pytest.approx(head_end) and drain > 0
    idle = _megatrain_idle(sim, drain, 0.0, 0.0, IDLE_LAYERS, 0.0, 0.0)
    assert idle[IDLE_DRAIN_REDUCE] == pytest.approx(drain) and IDLE_DRAIN_LINK not in idle


def test_each_micro_batch_waits_for_the_resident_staging_the_last_one_used():
    """The resident gradients' staging is one buffer (global_grads.py): the next micro-batch's copy into it waits
    for the previous add, on the compute timeline (the launch thread blocks), not on the layers' reducer."""
    p = make_point(MODEL, 64, 1, 2, "float32")
    sim = simulate_step(p, COSTS, head=0.3, globals_grads=(0.1, 100.0))[0]
    first_end = _spans(sim, REDUCE_GLOBALS, "reduce-head-grad")[0][2]
    second_copy = _spans(sim, "d2h", "head-grad")[1][1]
    assert second_copy >= first_end
    assert sim.staging_wait > 0
