"""A small version of `python -m experiments.studies.timeline --validate`: the planner's step timeline (the step,
the GPU's busy time and idle fraction, each link's busy time, as `megatrain plan` prints them) against the engine's
own trace and phase clocks on this CPU, with the copy engine rate-limited to an emulated link slow enough that the
step is the link's (the compute, on a shared 2-core box, is only checked in the study's full table:
results/timeline/README.md)."""

from __future__ import annotations

import pytest

from experiments.studies.timeline import (
    QUANTITIES,
    TOL_PCT,
    measured_timeline,
    predicted_timeline_summary,
    traced_step,
)
from megatrain.models.presets import get_preset

PRESET = get_preset("tiny").with_(name="tiny-8l", num_layers=8)
CONTEXT = 64
GBPS = (0.005, 0.01)  # 185 kB fp32 layers: ~37 and ~18 ms a load, several times their compute here


@pytest.fixture(scope="module")
def measured():
    out = {}
    for rate in GBPS:
        runs = traced_step(PRESET, CONTEXT, rate, False, steps=3)["runs"]
        ms = [measured_timeline(r) for r in runs]
        out[rate] = {k: sorted(m[k] for m in ms)[len(ms) // 2] for k in QUANTITIES}
    return out


# The emulated link sets these; the GPU's busy time and idle fraction are this shared box's compute speed against
# the profile's (CI's machine measured 91% idle where the profile says 77%), checked only in the study's table.
LINK_SET = ("step_s", "h2d_busy_s", "d2h_busy_s")


def _errors(pred: dict, meas: dict) -> dict[str, float]:
    return {k: 100.0 * (pred[k] - meas[k]) / meas[k] for k in LINK_SET}


@pytest.mark.parametrize("rate", GBPS)
def test_the_timeline_is_within_the_target_of_the_engines(measured, rate):
    pred = predicted_timeline_summary(PRESET, CONTEXT, rate, False)
    errs = _errors(pred, measured[rate])
    assert all(abs(e) <= TOL_PCT for e in errs.values()), (errs, pred, measured[rate])
    assert pred["idle_cause"] == "compute waits on weight/activation copies"


def test_a_wrong_link_misses_the_target(measured):
    # control: the same comparison against the plan for a link twice as fast fails it
    pred = predicted_timeline_summary(PRESET, CONTEXT, 2 * GBPS[0], False)
    errs = _errors(pred, measured[GBPS[0]])
    assert abs(errs["step_s"]) > TOL_PCT and abs(errs["h2d_busy_s"]) > TOL_PCT
