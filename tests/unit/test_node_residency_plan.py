"""costs/residency.py plan's `share` (docs/DISTRIBUTED.md section 4): on the node path a kept layer is kept sharded,
1/G of its bytes on each of the node's devices, so "auto" fills the same room with G times as many kept layers; a
kept graph's layer stays whole (engine/pipeline/kept_shards.py), so each graph also costs the rest of its layer."""

from __future__ import annotations

import pytest

from megatrain.costs.residency import Residency, plan

LAYER, GRAPH, RING = 1000, 600, 2000


@pytest.mark.parametrize("share", [2, 4, 8])
def test_a_room_holds_share_times_as_many_sharded_layers(share):
    n = 64
    for whole in range(0, 6):
        room = whole * LAYER
        alone = plan(n, LAYER, GRAPH, room, RING, graphs_allowed=False)
        node = plan(n, LAYER, GRAPH, room, RING, graphs_allowed=False, share=share)
        assert alone == Residency(whole, 0)
        assert node == Residency(share * whole, 0), (share, whole, node)
    # capped at the model's layers, and the ring is not given back (the sharded layers load through it)
    assert plan(4, LAYER, GRAPH, 10 * LAYER, RING, graphs_allowed=False, share=2) == Residency(4, 0)


def test_a_graph_costs_its_graph_and_the_rest_of_its_layer():
    # 4 layers kept sharded (500 B each) and room for one graph with its layer made whole (600 + the other 500)
    room = 4 * LAYER // 2 + GRAPH + LAYER // 2
    assert plan(4, LAYER, GRAPH, room, RING, graphs_allowed=True, share=2) == Residency(4, 1)
    assert plan(4, LAYER, GRAPH, room - 1, RING, graphs_allowed=True, share=2) == Residency(4, 0)
    # no limit: every layer kept with its graph, as on one device
    assert plan(4, LAYER, GRAPH, None, RING, graphs_allowed=True, share=2) == Residency(4, 4)


def test_share_one_is_the_one_device_rule():
    for room in (0, 999, 3500, 5000, 9000):
        assert plan(4, LAYER, GRAPH, room, RING, True, share=1) == plan(4, LAYER, GRAPH, room, RING, True)


def test_the_policy_plans_share_times_the_kept_layers():
    from megatrain.costs import memory as M
    dims = M.LayerDims(hidden=64, kv=32, intermediate=176, numel=50_000)
    base = dict(dims=dims, n_layers=64, itemsize=2, vocab=256, loss_chunk=256, tile_setting=None,
                offload_setting=True, budget=3 << 20, fixed_bytes=0, residency="auto")
    one, two = (M.LongContextPolicy(**base, kept_share=s).plan(64).residency.weights for s in (1, 2))
    assert one > 0 and two == 2 * one
