"""Residency for the node (docs/DISTRIBUTED.md section 4) on gloo ranks standing in for a node's GPUs: with the first
K of L layers kept (residency weights K) on the node path, each rank keeps only its shard of each of them on its
device, refreshed from its own ranges of the host masters once per step, and every load of such a layer is the
all-gather from the ranks' shards. They train as one process on the concatenated batch and as the same ranks with
every layer streamed, bit for bit; each rank's host-to-device bytes per step are what the load counts predict (its
owned bytes once per kept layer, instead of once per pass that copies a streamed layer), and its kept shards hold
1/G of a layer each. Skipping the refresh (the negative control) trains on stale weights.
"""

from __future__ import annotations

import pytest
import torch
from kit import NodeLaunches, bits, layer_numel, parity_gaps

from megatrain.costs.shards import ShardMap

TOL = 1e-5  # the project's data-parallel parity tolerance (test_data_parallel.py)
ACCUM, RING = 2, 2  # node_path_worker.train's accumulation; EngineConfig.num_buffers' default
ARGS = NodeLaunches.ARGS  # one launch serves test_node_path.py and test_node_residency.py (kit.NodeLaunches)
RUNS = ["node", "node:k2", "node:k4", "node:k2:g1", "node:k2:g1:eval", "node:k2:stale", "node:bf16",
        "node:k2:bf16"]


def _same_bits(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and a["norms"] == b["norms"] and all(
        torch.equal(bits(a["state"][k]), bits(b["state"][k])) for k in a["state"])


def streamed_loads(layer: int, layers: int, accum: int = ACCUM, ring: int = RING) -> int:
    """How many times per step the ring copies a streamed layer: in each forward and each backward, but for the
    passes where the ring still holds it from the pass before (the top `ring` layers in a backward, right after the
    forward; the bottom `ring` in every micro-batch's forward after the first, right after a backward; the step's
    update changes the masters, so the first forward copies every layer). A layer kept sharded takes its ring slot
    in the same passes (the schedule is the same), loaded by the gather alone."""
    backward = 0 if layer >= layers - ring else 1
    forward_after_first = 0 if layer < ring else 1
    return 1 + backward + (accum - 1) * (forward_after_first + backward)


def predicted_h2d(kept: int, layers: int, owned_bytes: int) -> int:
    """A rank's host-to-device bytes per step with the first `kept` layers kept sharded: its owned bytes of every
    streamed layer per copy, and of every kept one once (the refresh after the step's update)."""
    return owned_bytes * (kept + sum(streamed_loads(i, layers) for i in range(kept, layers)))


def _check_kept(ref: dict, res: dict, run: str, kept: int, rank: int, world: int, numel: int, itemsize: int,
                baseline: str = "node") -> None:
    """Run `run` (the first `kept` layers kept sharded) against the same ranks' all-streamed `baseline`: the same
    bits; this rank's h2d bytes per step what the counts predict and below the baseline's; its kept shards' device
    bytes 1/G of a layer's (padded to the shard map's equal pieces)."""
    got, stream = res[run], res[baseline]
    assert got["data_path"].startswith("node:"), got["data_path"]
    assert _same_bits(got, stream), (rank, run, parity_gaps(stream, got))
    smap = ShardMap.of(numel, world)
    owned = sum(b - a for a, b in smap.owned(rank)) * itemsize
    layers = ARGS["layers"]
    for step, (st, base) in enumerate(zip(got["stats"], stream["stats"], strict=True)):
        assert base["h2d_bytes"] == predicted_h2d(0, layers, owned), (rank, step, base["h2d_bytes"])  # the model
        assert st["h2d_bytes"] == predicted_h2d(kept, layers, owned), (rank, run, step, st["h2d_bytes"])
        assert st["h2d_bytes"] < base["h2d_bytes"], (rank, run, step)
        assert st["gathered_bytes"] == base["gathered_bytes"], (rank, run, step)  # every load still gathers
        assert st["sharded_weight_layers"] == kept, (rank, run, step)
        # measured on the device tensors: this rank's packed shard of each kept layer, 1/G of the padded layer
        assert st["kept_shard_bytes"] == kept * smap.shard_numel * itemsize, (rank, run, step)
        assert st["kept_shard_bytes"] * world <= kept * smap.padded * itemsize, (rank, run, step)


@pytest.mark.slow
def test_two_ranks_keep_layers_sharded_exactly_for_half_a_refresh_each(node_launches):
    ref, ranks = node_launches.two()
    assert min(ref["norms"]) > 2 * 0.05  # clipping (to 0.05, the worker's CLIP) acts at every step
    numel = layer_numel(ref["state"])
    for r, res in enumerate(ranks):
        for run in ("node", "node:k2", "node:k4", "node:k2:g1"):
            gaps = parity_gaps(ref, res[run])
            assert gaps["losses"] <= TOL and gaps["norms"] <= TOL and gaps["params"] <= TOL, (r, run, gaps)
            assert _same_bits(res[run], ranks[0][run]), (r, run)  # every rank ends on the same weights
        _check_kept(ref, res, "node:k2", 2, r, 2, numel, 4)
        _check_kept(ref, res, "node:k4", 4, r, 2, numel, 4)  # every layer kept sharded: the ring still gathers
        _check_kept(ref, res, "node:k2:bf16", 2, r, 2, numel, 2, baseline="node:bf16")
        # a kept graph holds its layer's gathered weights until backward: that layer stays whole, the next sharded
        g1 = res["node:k2:g1"]
        assert _same_bits(g1, res["node"]), (r, parity_gaps(res["node"], g1))
        assert all(st["sharded_weight_layers"] == 1 and st["kept_graph_layers"] == 1 for st in g1["stats"]), r
        # a no-grad forward between each training forward and its backward plans the kept weights without graphs:
        # the whole layer stays whole (its graph reads its slot in that backward), and training is the same bits
        assert _same_bits(res["node:k2:g1:eval"], g1), (r, parity_gaps(g1, res["node:k2:g1:eval"]))
        # the control: each shard refreshed once, never after an update, so the kept layers compute with the weights
        # they started from; the first step is the same, every later one is off by far more than the tolerance
        stale = res["node:k2:stale"]
        assert stale["losses"][:ACCUM] == res["node:k2"]["losses"][:ACCUM], r
        gaps = parity_gaps(ref, stale)
        assert not gaps["params"] <= 100 * TOL and not gaps["losses"] <= TOL, (r, gaps)


@pytest.mark.slow
def test_four_ranks_keep_a_quarter_of_each_kept_layer(node_launches):
    """One node of 4 gloo ranks (micro-batch 1 each) against one process with micro-batch 4, the first 2 of 4 layers
    kept sharded: a quarter of each kept layer per rank, the all-streamed run's bits, the predicted h2d bytes."""
    ref, ranks = node_launches.four()
    numel = layer_numel(ref["state"])
    for r, res in enumerate(ranks):
        gaps = parity_gaps(ref, res["node:k2"])
        assert gaps["losses"] <= TOL and gaps["norms"] <= TOL and gaps["params"] <= TOL, (r, gaps)
        _check_kept(ref, res, "node:k2", 2, r, 4, numel, 4)
