"""The planner's residency on the node path (docs/DISTRIBUTED.md sections 4 and 11): layers kept sharded, 1/G of
their bytes per GPU, loaded by the NVLink all-gather alone and refreshed over the host link once per step."""

from __future__ import annotations

import pytest

from megatrain.costs import residency as kept
from megatrain.planner.multi import collective_device_bytes, plan_multi
from megatrain.planner.node_path import NODE
from megatrain.planner.summary import first_screen_multi

G = 8
POINT = {"context": 4096, "batch": 1, "hardware": "h100-sxm", "gpus_per_node": G}


@pytest.fixture(scope="module")
def plans() -> dict:
    out = {}
    for model in ("llama3.1-70b", "qwen2.5-32b"):
        out[model, "auto"] = plan_multi(model, residency="auto", **POINT)
        out[model, "stream"] = plan_multi(model, residency="stream", **POINT)
    # a budget where the one-GPU fill keeps a few whole layers, so G times as many sharded stay below L
    out["small", "auto"] = plan_multi("llama3.1-70b", residency="auto", device_memory_gib=36, **POINT)
    return out


def test_first_screen_says_the_sharded_layers_and_link_bytes(plans: dict) -> None:
    mp = plans["llama3.1-70b", "auto"]
    assert mp.path == NODE
    lines = first_screen_multi(mp)
    r = mp.rank.long_context.residency
    line = next(s for s in lines if s.strip().startswith("residency (node):"))
    assert f"{r.weights - r.activations} of 80 layers kept sharded" in line and "host->device" in line
    assert len(lines) <= 25


def test_sharded_fill_holds_about_g_times_the_one_gpu_whole_layers(plans: dict) -> None:
    mp = plans["small", "auto"]
    lc = mp.single.long_context
    S = mp.rank.point.model.layer_params() * mp.rank.point.c  # one layer's compute-dtype bytes, from the preset
    assert lc.layer_bytes == S
    # what one GPU's "auto" keeps whole in the same room (costs/residency.py, graphs aside)
    whole = kept.plan(lc.n_layers, S, lc.graph_bytes, lc.residency_room, lc.ring_bytes, False).weights
    engine = mp.rank.placement.engine  # the engine's fill on the node: shards first
    sharded = engine.weights - engine.activations
    assert 1 <= whole and G * whole < lc.n_layers
    room = lc.residency_room - collective_device_bytes(mp.rank.point, G)  # the node path's buffers come out of it
    assert sharded == room // -(-S // G)
    assert G * (whole - 1) < sharded <= G * (whole + 1)


def test_h2d_falls_by_one_shard_per_kept_layer(plans: dict) -> None:
    stream = plans["llama3.1-70b", "stream"]
    S = stream.rank.point.model.layer_params() * stream.rank.point.c
    for K in (5, 30, 77):
        held = plan_multi("llama3.1-70b", residency={"weights": K}, **POINT)
        r = held.rank.long_context.residency
        assert (r.weights, r.activations) == (K, 0)
        # a streamed layer crosses the link twice a step (forward, recompute), a sharded one once (its refresh)
        assert stream.rank.time.h2d_bytes - held.rank.time.h2d_bytes == K * (2 - 1) * S // G
        assert held.rank.memory.device["kept layers' shards (node path)"] == K * -(-S // G)
        assert held.step_s <= stream.step_s  # a sharded layer's pass loads by its gather alone, never more


@pytest.mark.parametrize("model", ["llama3.1-70b", "qwen2.5-32b", "small"])
def test_auto_never_slower_than_streaming_every_layer(plans: dict, model: str) -> None:
    auto = plans[model, "auto"]
    stream = plans.get((model, "stream")) or plan_multi("llama3.1-70b", residency="stream", device_memory_gib=36,
                                                          **POINT)
    assert auto.rank.long_context.residency.weights > 0
    assert auto.step_s <= stream.step_s
    assert auto.fits and auto.rank.memory.device_total <= auto.rank.hardware.device_bytes
