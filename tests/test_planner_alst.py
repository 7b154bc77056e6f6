"""The planner's device-memory terms for the zero3-alst configuration (megatrain/planner/alst.py)."""

from __future__ import annotations

import pytest

from megatrain.models.presets import get_preset
from megatrain.planner.alst import LOSS_TILE_LOGIT_BYTES, default_loss_tile, zero3_alst_device_terms


def test_terms_follow_the_tiles_and_the_sequence():
    m = get_preset("smollm-135m")
    small, big = (zero3_alst_device_terms(m, 1024, loss_tile=t)["working set (layer or loss)"] for t in (256, 320))
    # At 1024 tokens the loss tile dominates: 64 more tokens of 49k FP32 logits x 12 B.
    assert big - small == 64 * m.vocab * 12
    # Past the loss tile the layer recompute grows linearly in tokens; no term holds all layers' activations.
    long = [zero3_alst_device_terms(m, t)["working set (layer or loss)"] for t in (32768, 65536)]
    per_token = (m.hidden * (1 + 9.3) + 2 * m.kv_heads * m.head_dim) * 4
    assert long[1] - long[0] == pytest.approx(32768 * per_token, rel=1e-3)
    assert zero3_alst_device_terms(m, 65536)["fetched embedding/head"] == m.vocab * m.hidden * 4


def test_default_loss_tile_matches_the_backend():
    from baselines import alst
    assert alst._LOSS_TILE_LOGIT_BYTES == LOSS_TILE_LOGIT_BYTES
    assert default_loss_tile(49152) == 341


def test_bad_input():
    with pytest.raises(ValueError, match="tokens"):
        zero3_alst_device_terms(get_preset("smollm-135m"), 0)
