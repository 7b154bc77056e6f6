"""speculative_step "auto" backs off where speculation keeps losing (engine/update/speculative.py BACK_OFF_AFTER): after
3 steps in a row with a rollback it pauses, retries after a quiet window (doubled while retries lose), and resumes
where a step's speculation holds; the same bits as speculative_step=False throughout (losses, pre-clip norms,
weights, Adam state). True is as set: it speculates every step (the control). The window is shortened here to keep
the run small.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
from conftest import make_batches, tiny_model
from gpu_defaults import CONFIGS
from kit import assert_same_training_state, settle_speculation, train_steps

from megatrain.config.schema import IF_FITS, EngineConfig
from megatrain.engine import Engine
from megatrain.engine.update import speculative
from megatrain.engine.update.speculative import Speculative

LINK_GBPS = 0.05  # a link emulated: the layers stream (a plain CPU device holds their optimizer on it)


@pytest.fixture(params=CONFIGS)
def engines(monkeypatch, request):
    """A serial engine, one with "auto" settled as on CUDA, one with True (in FP32 and in the GPU's defaults); the
    quiet window 2 steps."""
    monkeypatch.setattr(speculative, "QUIET_STEPS", 2)
    mode = {**request.param, "link_gbps": LINK_GBPS}
    base = tiny_model("llama", layers=3)
    serial = Engine(copy.deepcopy(base), EngineConfig(**{**mode, "optimizer_overlap": False,
                                                         "speculative_step": False}))
    forced = Engine(copy.deepcopy(base), EngineConfig(**mode, speculative_step=True))
    resolve = speculative.resolve
    monkeypatch.setattr(speculative, "resolve", lambda config, *a, **k: resolve(
        dataclasses.replace(config, speculative_step=IF_FITS), *a, **k))
    auto = Engine(copy.deepcopy(base), EngineConfig(**mode))
    for eng in (auto, forced):
        assert isinstance(eng.update, Speculative)
        eng.update.pass_over = False  # every layer speculates, however far behind the host is
    return serial, auto, forced


def _run(eng: Engine, batches, steps: int, clip: float, start: int = 0):
    return train_steps(eng, batches, steps, clip=clip, start=start, after_backward=settle_speculation)


def test_auto_backs_off_when_every_step_clips_same_bits(engines):
    serial, auto, forced = engines
    steps, batches = 12, make_batches(12)
    a = train_steps(serial, batches, steps, clip=0.05)
    assert a == _run(auto, batches, steps, 0.05) == _run(forced, batches, steps, 0.05)
    assert_same_training_state(serial, auto)
    assert_same_training_state(serial, forced)
    # rolled back at steps 1-3, paused 2 (4-5); the retry at 6 lost: paused 4 (7-10); the retry at 11 lost: paused
    stats = auto.collect_stats()
    assert (stats["speculative_rollbacks"], stats["speculative_backoffs"], auto.update.quiet_steps) == (5, 3, 7)
    assert forced.collect_stats()["speculative_rollbacks"] == steps and forced.update.backoffs == 0


def test_auto_resumes_where_a_retry_holds(engines):
    serial, auto, _ = engines
    batches = make_batches(8)
    a = train_steps(serial, batches, 5, clip=0.05) + train_steps(serial, batches, 3, clip=1e6, start=5)
    b = _run(auto, batches, 5, 0.05) + _run(auto, batches, 3, 1e6, start=5)
    assert a == b
    assert_same_training_state(serial, auto)
    layers = auto.update.speculative_layers
    # steps 1-3 rolled back, 4-5 paused; the retry at 6 held, and so did 7 and 8: every layer's update kept
    assert auto.update.backoffs == 1 and auto.update.rollbacks == 3 and auto.update.kept_layers == 3 * layers > 0
