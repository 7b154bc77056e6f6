"""Nodes sharing one store (docs/DISTRIBUTED.md section 5b, engine/parallel/shared_store.py) on this CPU: two torchrun
agents on localhost (`--nnodes 2`, one rank each: LOCAL_WORLD_SIZE=1, two "nodes") whose host_budget_bytes is 0.6x
one whole store and no NVMe tier. The engine chooses to share the store by itself (each node owns half the layers'
master, slab and Adam state; the weights broadcast from the owner, the gradients reduced to it), trains as one
process on the concatenated batch within the project's data-parallel tolerance (FP32, every layer streamed,
accumulation 2, clipping that acts; and in bf16 compute, with FP32, hilo or bf16 masters, as each node holding its
whole store does), and each rank's host_store_bytes stays <= 0.6x the one-process store. A budget
that holds not even one node's share is refused on every rank, naming the numbers; so is one a lone process cannot
honour without nvme_path. A checkpoint saved by the two nodes halfway resumes bit-identically on two. After training,
an evaluation forward, the model object's state_dict() and save_pretrained() on every rank give the whole stores' bits;
an evaluation forward on rank 0 alone, or a model.state_dict() on rank 1 alone, is refused within seconds on that
rank (it waited for the watchdog before).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from kit import ROOT, parity_gaps, run_python, torchrun_nodes, worker_env

from megatrain.engine.parallel.shared_store import layer_ranges

WORKER = ROOT / "tests" / "workers" / "shared_store_worker.py"
DEADLINE_S = 600  # a bound on a hang, not a speed target: the whole suite shares two cores
TOL = 1e-5  # the project's data-parallel parity tolerance (test_data_parallel.py)
ARGS = {"micro": 2, "world": 2, "steps": 3, "layers": 8}


def _lone(tmp_path, args: dict, runs: tuple[str, ...], fractions: dict[str, float]) -> dict:
    """The one-process runs on the concatenated batch; `fractions`: a run's budget as that fraction of the process's
    own "plain" run's whole store."""
    out = tmp_path / "lone"
    out.mkdir()
    whole = {**args, "micro": args["micro"] * args["world"], "world": 1, "budget": None, "runs": list(runs),
             "fractions": fractions}
    run_python([WORKER, out, json.dumps(whole)], env=worker_env(threads=1, PYTHONWARNINGS="ignore"),
               timeout=DEADLINE_S, check=True)
    return torch.load(out / "rank0.pt")


def _two_nodes(tmp_path, args: dict, name: str) -> list[dict]:
    """Two torchrun agents on this machine, `--nnodes 2 --nproc-per-node 1`: each rank its own node."""
    return torchrun_nodes(WORKER, tmp_path / name, args, 2, 1, DEADLINE_S)


# The budget below one node's share: half the layers plus the resident parameters do not fit.
REFUSED = 0.3


@pytest.fixture(scope="module")
def lone(tmp_path_factory) -> dict:
    """The one-process runs, once for the module: the references, and a lone process under REFUSED x its own
    whole store (the store at step 0 is the same whatever the number of steps), in one process."""
    return _lone(tmp_path_factory.mktemp("lone"), ARGS, ("plain", "bf16", "hilo", "bf16m", "refused"),
                 {"refused": REFUSED})


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, lone) -> list[dict]:
    """The two nodes' runs, one launch for the module: the shared store's and its controls, the "alone" run's calls
    by one rank, and the budget below one node's share ("refused", where every rank refuses before training)."""
    whole = lone["plain"]["stats"][0]["host_store_bytes"]
    budget = int(0.6 * whole)
    whole_bf16 = lone["bf16"]["stats"][0]["host_store_bytes"]  # with the layers' bf16 shadow
    # host_master "hilo" (bf16 hi + int16 lo, exact) and "bf16" ("bf16m" runs), bf16 compute: their stores' bytes.
    # Their shares hold a layer of scratch per buffer kind and the one-layer FP32 update scratch, which in this tiny
    # model is 1/8 of the layers: a share is ~0.64x of one store (hilo), so their budget is 0.75x.
    masters = {m: lone[m]["stats"][0]["host_store_bytes"] for m in ("hilo", "bf16m")}
    # "whole", "bf16_whole", ...: no budget, each node its whole store (the per-rank path), in the same launch
    runs = ["plain", "overlap", "resume", "bf16", "whole", "bf16_whole", "hilo", "hilo_whole", "bf16m", "bf16m_whole",
            "skip_broadcast", "skip_reduce", "alone", "refused"]
    budgets = {"bf16": int(0.6 * whole_bf16), "whole": None, "bf16_whole": None, "hilo_whole": None,
               "bf16m_whole": None, **{m: int(0.75 * b) for m, b in masters.items()}, "refused": int(REFUSED * whole)}
    # "extras": after training, an evaluation forward, model.state_dict() and save_pretrained on every rank; "alone":
    # "plain" again, then rank 0 evaluates by itself (rank 1 in a barrier), and rank 1 calls model.state_dict() by
    # itself, each refused once its engine's join runs out (the worker's ALONE_JOIN_S, not 10 s twice)
    extras = ["plain", "bf16", "whole", "bf16_whole", "hilo", "hilo_whole", "bf16m", "bf16m_whole"]
    return _two_nodes(tmp_path_factory.mktemp("shared"), {**ARGS, "budget": budget, "budgets": budgets, "runs": runs,
                                                          "extras": extras}, "shared")


@pytest.mark.slow
def test_two_nodes_share_one_store_under_a_budget_and_train_as_one_process(lone, ranks):
    ref = lone["plain"]
    assert "refused" not in ref, ref
    whole = ref["stats"][0]["host_store_bytes"]
    assert min(ref["norms"]) > 2 * 0.05  # clipping (to 0.05, the worker's CLIP) acts at every step
    whole_bf16 = lone["bf16"]["stats"][0]["host_store_bytes"]
    masters = {m: lone[m]["stats"][0]["host_store_bytes"] for m in ("hilo", "bf16m")}
    layers = ARGS["layers"]
    owned = [list(range(a, b)) for a, b in layer_ranges([1] * layers, 2)]
    assert owned == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for r, results in enumerate(ranks):
        for run in ("plain", "overlap"):
            res = results[run]
            assert "refused" not in res, (r, run, res)
            assert res["data_path"].startswith(
                f"nodes share one store: node {r} owns layers {owned[r][0]}-{owned[r][-1]}"), res["data_path"]
            assert res["owned"] == owned[r]
            # its own layers and the replicated resident parameters, never the other node's layers
            assert set(res["state"]) < set(ref["state"])
            assert not any(f".layers.{i}." in k for k in res["state"] for i in owned[1 - r])
            gaps = parity_gaps(ref, res)
            assert gaps["losses"] <= TOL and gaps["norms"] <= TOL and gaps["params"] <= TOL, (r, run, gaps)
            for step in res["stats"]:
                assert step["host_store_bytes"] <= 0.6 * whole, (r, run, step["host_store_bytes"], whole)
        # bf16 compute (the bf16 shadow streams, gradients widened to FP32 before the reduce) against each node
        # holding its whole store in the same launch (where the per-rank path all-reduces); and FP32 likewise.
        # host_master "hilo" and "bf16" likewise (their per-layer update unpacks and packs only the owned layers),
        # its engine.state_dict() aside (NodesShare.whole reads FP32 masters: a ranks.py change, requested).
        for shared, full, cap, frac in (("bf16", "bf16_whole", whole_bf16, 0.6), ("plain", "whole", whole, 0.6),
                                        ("hilo", "hilo_whole", masters["hilo"], 0.75),
                                        ("bf16m", "bf16m_whole", masters["bf16m"], 0.75)):
            assert results[full]["data_path"].startswith("per_rank:"), results[full]["data_path"]
            assert results[full]["stats"][0]["host_store_bytes"] > 0.9 * cap  # the negative control's store: whole
            assert results[shared]["data_path"].startswith("nodes share one store"), results[shared]["data_path"]
            assert all(st["host_store_bytes"] <= frac * cap for st in results[shared]["stats"]), (r, shared)
            # Two nodes' sum is one addition whichever term comes first: the reduce to the owner gives the whole
            # stores' all-reduce bit for bit (measured: equal losses, norms and weights)
            assert results[shared]["losses"] == results[full]["losses"], (r, shared)
            assert results[shared]["norms"] == results[full]["norms"], (r, shared)
            assert all(torch.equal(v, results[full]["state"][k]) for k, v in results[shared]["state"].items()), r
            # engine.state_dict() in every master mode: every rank's whole model
            assert all(torch.equal(v, results[full]["whole"][k]) for k, v in results[shared]["whole"].items()), r
            # An evaluation forward on every rank (the owners' broadcasts, joined first): the whole stores' logits
            assert torch.equal(results[shared]["eval_logits"], results[full]["eval_logits"]), (r, shared)
            # The model object's state_dict(), every rank's: the other node's layers gathered from their owner (they
            # were its scratch before), the whole stores' bits; and equal to engine.state_dict()'s
            mine, theirs = results[shared]["model_state"], results[full]["model_state"]
            assert set(mine) == set(theirs) and all(torch.equal(v, theirs[k]) for k, v in mine.items()), (r, shared)
            assert all(torch.equal(v, results[shared].get("whole", mine)[k]) for k, v in mine.items()), (r, shared)
            # save_pretrained on every rank (HF writes on rank 0 only): the whole stores' files, tensor for tensor
            saved, saved_full = results[shared]["saved"], results[full]["saved"]
            assert (len(saved) > 0) == (r == 0) and set(saved) == set(saved_full), (r, shared, len(saved))
            assert all(torch.equal(v, saved_full[k]) for k, v in saved.items()), (r, shared)
        # engine.state_dict() on every rank: the whole model, the other node's layers taken from their owner
        whole_gap = max((ref["state"][k] - v).abs().max().item() for k, v in results["plain"]["whole"].items())
        assert set(results["plain"]["whole"]) == set(ref["whole"]) and whole_gap <= TOL, (r, whole_gap)
        assert all(torch.equal(v, ranks[0]["plain"]["whole"][k]) for k, v in results["plain"]["whole"].items()), r
        # A checkpoint saved by the two nodes halfway (state_dict and the optimizer's, each collective) and loaded by
        # a fresh engine on each: the rest of the run is the uninterrupted one's, bit for bit.
        plain, resumed = results["plain"], results["resume"]
        assert resumed["losses"] == plain["losses"] and resumed["norms"] == plain["norms"], r
        assert all(torch.equal(v, plain["whole"][k]) for k, v in resumed["whole"].items()), r
        # The negative controls: without the owner's broadcast a node computes on whatever its ring slot held; without
        # the reduce an owner updates from its own gradient alone. Either breaks the parity by far more than TOL.
        for run in ("skip_broadcast", "skip_reduce"):
            gaps = parity_gaps(ref, results[run])
            assert all(not gaps[k] <= 100 * TOL for k in ("params", "norms")), (r, run, gaps)
    # A rank alone at a collective call is refused at its join, naming itself and what to do, well before the
    # watchdog (0.9 x 120 s, when the broadcast no owner sends gave up, as it did before the join)
    for r, key, what in ((0, "alone_forward", "an evaluation forward"), (1, "alone_state_dict", "state_dict()")):
        assert ranks[r]["alone"]["data_path"].startswith("nodes share one store"), ranks[r]["alone"]["data_path"]
        got = ranks[r]["alone"][key]
        assert got.get("type") == "RanksOutOfStep", (r, got)
        assert f"rank {r} of 2 ran" in got["message"] and what in got["message"], got["message"]
        assert "every rank" in got["message"], got["message"]
        assert got["seconds"] < 60, got  # JOIN_S (10 s) on the clock; a bound on a hang, not a speed
    # After a refusal the ranks are out of step at that call: it is refused at once on every rank, never a hang
    for r in range(2):
        got = ranks[r]["alone"]["after_forward"]
        assert got.get("type") == "RanksOutOfStep" and got["seconds"] < 60, (r, got)
    assert "another rank ran one alone earlier" in ranks[1]["alone"]["after_forward"]["message"]
    # the two shares hold every layer once: together more than one store (each replicates the resident parameters
    # and a layer of scratch), less than two
    both = sum(res["plain"]["stats"][-1]["host_store_bytes"] for res in ranks)
    assert whole < both < 2 * whole, (both, whole)


@pytest.mark.slow
def test_a_budget_below_one_nodes_share_is_refused_by_name(lone, ranks):
    budget = int(REFUSED * lone["plain"]["stats"][0]["host_store_bytes"])
    for r, res in enumerate(ranks):
        msg = res["refused"].get("refused", "")
        assert f"host_budget_bytes is {budget:,} bytes" in msg, (r, res)
        assert "cannot share one store" in msg and "each of 2 nodes' share needs up to" in msg, (r, msg)
        more = re.search(r"(\d+) nodes' shares would fit", msg)  # the fewest that would, one layer each at most here
        assert more is not None and 2 < int(more.group(1)) <= ARGS["layers"], msg
    # a lone process has no nodes to share with: the budget it cannot honour without nvme_path is refused too
    assert "set nvme_path" in lone["refused"].get("refused", ""), lone["refused"]


def test_layer_ranges_split_by_parameters():
    assert layer_ranges([1] * 8, 2) == [(0, 4), (4, 8)]
    assert layer_ranges([1] * 7, 2) == [(0, 4), (4, 7)]
    assert layer_ranges([4, 1, 1, 1, 1], 2) == [(0, 1), (1, 5)]
    assert layer_ranges([1, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]
