"""A small version of experiments/validate_planner.py: the planner's step time against the engine's,
at one emulated link slow enough to be link-bound and one unthrottled (compute-bound) link."""

from __future__ import annotations

import pytest

from experiments.validate_planner import validate
from megatrain.models.presets import get_preset

# 35%: the box is shared (2 cores, other jobs) and the steps are short; and the planner, built for
# deep models, charges a fill and a drain per micro-batch plus an embedding upload/download that the
# CPU FP32 engine does not do (it aliases the globals) -- fixed costs worth ~2/(2L) of a link-bound
# step. Eight layers keep those at ~15% so the check is about the per-layer streaming model; on the
# 2-layer `tiny` preset they alone put the prediction ~45% over (see results/validation/).
LINK_BOUND_TOL_PCT = 35.0
# 0.005 GB/s streams one 185 kB fp32 layer in ~37 ms, several times its compute on this CPU.
SLOW_GBPS = 0.005


@pytest.fixture(scope="module")
def rows():
    preset = get_preset("tiny").with_(name="tiny-8l", num_layers=8)
    return validate(preset, context=64, gbps=[SLOW_GBPS, None], warmup=1, steps=3, quick_bench=True,
                    log=lambda *_: None)


def test_link_bound_prediction_tracks_measurement(rows):
    slow = rows[0]
    assert slow["predicted_bottleneck"].startswith("link"), slow["predicted_bottleneck"]
    assert abs(slow["error_pct"]) <= LINK_BOUND_TOL_PCT, (
        f"predicted {slow['predicted_step_s']:.3f} s vs measured {slow['measured_step_s']:.3f} s "
        f"({slow['error_pct']:+.0f}%)")


def test_link_bound_is_slower_measured_and_predicted(rows):
    slow, fast = rows
    assert slow["measured_step_s"] > fast["measured_step_s"]
    assert slow["predicted_step_s"] > fast["predicted_step_s"]


def test_streamed_bytes_match_engine(rows):
    # The weight stream itself: device-resident bytes are the same count on both sides; the planner's
    # h2d total may only exceed the engine's by the embedding/head it charges (see the tolerance note).
    slow = rows[0]
    assert slow["predicted_device_weight_bytes"] == slow["measured_device_weight_bytes"]
    assert slow["predicted_h2d_bytes"] >= slow["measured_h2d_bytes"]
