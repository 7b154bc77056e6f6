"""The node path (docs/DISTRIBUTED.md, steps 2-4) on gloo ranks standing in for a node's GPUs: 2 ranks under torchrun,
every layer streamed, accumulation 2, clipping that acts. Each rank copies its half of every layer host-to-device
and the ranks all-gather the rest; each layer's gradients are reduce-scattered in FP32 and each rank copies only its
half to the host, and updates only its half of every layer (the update's own count of the elements it wrote). They
train as one process on the concatenated batch, while each rank's h2d and d2h bytes per step are about half a lone
rank's (the per-rank path, run in the same launch: the whole of them, and the same weights bit for bit where the
clip scales nothing, in FP32 compute); skipping the gather or the reduce-scatter (the negative controls) breaks the
parity by far more than the tolerance. 4 ranks: a quarter of the bytes and of the update.
"""

from __future__ import annotations

import pytest
import torch
from kit import NodeLaunches, bits, layer_numel, parity_gaps

from megatrain.costs.shards import ShardMap

TOL = 1e-5  # the project's data-parallel parity tolerance (test_data_parallel.py)
ARGS = NodeLaunches.ARGS  # one launch serves test_node_path.py and test_node_residency.py (kit.NodeLaunches)
CHUNK = 1280  # elements: a layer of the worker's (11,584) in 10 chunks, the last of padding and one rank's tail
RUNS = ["node", f"node:chunk{CHUNK}", "node:overlap", "per_rank", "node:skip_gather", "node:skip_scatter",
        "node:whole_update", "node:bf16",
        "per_rank:bf16", "node:noclip", "per_rank:noclip", "auto:adamw", "auto", "auto:cpu", "node:bf16slab",
        "per_rank:bf16slab"]


def _check_update_split(node: dict, smap: ShardMap, rank: int, layers: int, share: float) -> None:
    """Each step this rank's host update wrote exactly its ranges of every layer (the shard map's owned elements),
    counted by the update itself, not timed: about 1/G of the layers' elements, at most `share` of them."""
    owned = sum(b - a for a, b in smap.owned(rank))
    for step, st in enumerate(node["stats"]):
        assert st["updated_elements"] == layers * owned, (rank, step, st["updated_elements"], layers * owned)
        assert st["updated_elements"] <= share * layers * smap.numel, (rank, step)


@pytest.mark.slow
def test_two_ranks_node_path_match_one_process_at_half_the_link_bytes(node_launches):
    ref, ranks = node_launches.two()
    assert min(ref["norms"]) > 2 * 0.05  # clipping (to 0.05, the worker's CLIP) acts at every step

    numel = layer_numel(ref["state"])
    for r, res in enumerate(ranks):
        assert res["per_rank"]["data_path"].startswith("per_rank:"), res["per_rank"]["data_path"]
        for run, smap in (("node", ShardMap.of(numel, 2)), (f"node:chunk{CHUNK}", ShardMap.of(numel, 2, CHUNK)),
                          ("node:overlap", ShardMap.of(numel, 2))):
            node = res[run]
            assert node["data_path"].startswith("node:") and "reduce-scattered" in node["data_path"], node["data_path"]
            gaps = parity_gaps(ref, node)
            assert gaps["losses"] <= TOL and gaps["norms"] <= TOL and gaps["params"] <= TOL, (r, run, gaps)
            assert all(torch.equal(ranks[0][run]["state"][k], node["state"][k]) for k in node["state"]), (r, run)
            owned = sum(b - a for a, b in smap.owned(r))
            for step, (got, whole, alone) in enumerate(zip(node["stats"], res["per_rank"]["stats"], ref["stats"])):
                # the per-rank path, 2 ranks: every rank the whole of a lone rank's link bytes
                assert whole["h2d_bytes"] == alone["h2d_bytes"] and whole["d2h_bytes"] == alone["d2h_bytes"], step
                # the node path: this rank's ranges only (the shard map's, to the byte), the rest by the collectives
                assert got["h2d_bytes"] * numel == alone["h2d_bytes"] * owned, (r, run, step)
                assert got["d2h_bytes"] * numel == alone["d2h_bytes"] * owned, (r, run, step)
                assert got["h2d_bytes"] <= 0.6 * alone["h2d_bytes"] and got["d2h_bytes"] <= 0.6 * alone["d2h_bytes"]
                assert got["gathered_bytes"] * 2 * numel == alone["h2d_bytes"] * smap.padded, (r, run, step)
                assert got["scattered_bytes"] * 2 * numel == alone["d2h_bytes"] * smap.padded, (r, run, step)
        for run in ("node", f"node:chunk{CHUNK}", "node:overlap", "node:bf16", "node:noclip"):
            _check_update_split(res[run], ShardMap.of(numel, 2, CHUNK if "chunk" in run else None), r,
                                ARGS["layers"], 0.6)
        # Two ranks' FP32 sum is one addition whichever rank's term comes first: the node path's reduce-scatter gives
        # the per-rank path's owner sum bit for bit, and each rank's update of its ranges is elementwise torch AdamW,
        # so with a clip that scales nothing the node path's weights are the per-rank path's bit for bit. With the
        # clip acting the norm is summed from the ranks' ranges (another order of the same squares): its last bits,
        # so the coefficient's, may differ; the node path is then within the tolerance of the per-rank path (and of
        # one process, above), in FP32 compute and in bf16 (gradients widened before the sum).
        a, b = "node:noclip", "per_rank:noclip"
        assert res[a]["losses"] == res[b]["losses"], r
        assert all(torch.equal(bits(res[a]["state"][k]), bits(res[b]["state"][k])) for k in res[a]["state"]), r
        for a, b in (("node", "per_rank"), ("node:bf16", "per_rank:bf16")):
            gaps = parity_gaps(res[b], res[a])
            assert gaps["losses"] <= TOL and gaps["norms"] <= TOL and gaps["params"] <= TOL, (r, a, gaps)
        # bf16 gradient slabs (bf16 compute, one micro-batch per step, where such a slab is exact): the shard crosses
        # the link as the bf16 mean, rounded on the device as the host would round it into the slab, so the d2h
        # bytes are this rank's ranges at 2 bytes (~0.5x a lone rank's bf16 gradients at G = 2, where the FP32
        # shard of an FP32 slab is ~1.0x) and the weights the per-rank path's bit for bit (a clip scaling nothing)
        a, b = "node:bf16slab", "per_rank:bf16slab"
        assert res[a]["losses"] == res[b]["losses"], r
        assert all(torch.equal(bits(res[a]["state"][k]), bits(res[b]["state"][k])) for k in res[a]["state"]), r
        owned = sum(b_ - a_ for a_, b_ in ShardMap.of(numel, 2).owned(r))
        for step, (got, whole) in enumerate(zip(res[a]["stats"], res[b]["stats"])):
            assert got["d2h_bytes"] * numel == whole["d2h_bytes"] * owned, (r, step, got["d2h_bytes"], whole["d2h_bytes"])
            assert got["d2h_bytes"] <= 0.6 * whole["d2h_bytes"], (r, step)
        # "auto" (the default), choosing as on a GPU node: the node path with its update by shard where it can run
        # (several local ranks sharing the node's store, the optimizer given as torch's AdamW), said so; the per-rank
        # path where it cannot (an optimizer factory: its type is known only once built), with the reason
        auto = res["auto:adamw"]
        assert auto["data_path"].startswith("node:") and "'auto'" in auto["data_path"], auto["data_path"]
        assert "updating its 1/2 of every layer" in auto["data_path"], auto["data_path"]
        gaps = parity_gaps(ref, auto)
        assert gaps["losses"] <= TOL and gaps["norms"] <= TOL and gaps["params"] <= TOL, (r, gaps)
        _check_update_split(auto, ShardMap.of(numel, 2), r, ARGS["layers"], 0.6)
        assert res["auto"]["data_path"].startswith("per_rank:") and "factory" in res["auto"]["data_path"], r
        # on a CPU device "auto" itself keeps the per-rank path (the gloo ranks stand in for GPUs where "node" asks)
        cpu = res["auto:cpu"]["data_path"]
        assert cpu.startswith("per_rank:") and "CPU device" in cpu, cpu
        # the update's count is the elements it wrote: a rank updating whole layers counts all of them
        assert all(st["updated_elements"] == ARGS["layers"] * numel for st in res["node:whole_update"]["stats"]), r
        for control in ("node:skip_gather", "node:skip_scatter", "node:whole_update"):
            gaps = parity_gaps(ref, res[control])
            # "not <=": a NaN is off too (with the gather skipped a slot's other half is whatever it held before,
            # at times an uninitialised buffer's NaN)
            assert all(not gaps[k] <= 100 * TOL for k in ("params", "norms")), (r, control, gaps)


@pytest.mark.slow
def test_four_ranks_node_path_match_one_process_at_a_quarter_of_the_link_bytes(node_launches):
    """One node of 4 gloo ranks (micro-batch 1 each) against one process with micro-batch 4: each rank copies a
    quarter of every layer each way (<= 0.35x a lone rank's bytes), and the losses, norms and weights match."""
    ref, ranks = node_launches.four()
    args = {**ARGS, "micro": 1, "world": 4}
    numel = layer_numel(ref["state"])
    smap = ShardMap.of(numel, 4)
    for r, res in enumerate(ranks):
        node = res["node"]
        gaps = parity_gaps(ref, node)
        assert gaps["losses"] <= TOL and gaps["norms"] <= TOL and gaps["params"] <= TOL, (r, gaps)
        assert all(torch.equal(ranks[0]["node"]["state"][k], node["state"][k]) for k in node["state"]), r
        _check_update_split(node, smap, r, args["layers"], 0.35)
        owned = sum(b - a for a, b in smap.owned(r))
        for step, (got, alone) in enumerate(zip(node["stats"], ref["stats"])):
            assert got["h2d_bytes"] * numel == alone["h2d_bytes"] * owned, (r, step)
            assert got["d2h_bytes"] * numel == alone["d2h_bytes"] * owned, (r, step)
            assert got["h2d_bytes"] <= 0.35 * alone["h2d_bytes"] and got["d2h_bytes"] <= 0.35 * alone["d2h_bytes"]
            assert got["gathered_bytes"] * 4 * numel == alone["h2d_bytes"] * smap.padded * 3, (r, step)
