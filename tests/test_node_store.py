"""One host store per node: what two ranks on a machine hold together is one store plus a process, not two
stores (measured as the ranks' summed PSS), and the pieces that make it so (topology, shared buffers, the
optimizer state's sharding, the configuration's refusals)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from experiments.studies.scaling_host_memory import POINTS, measure
from megatrain.config import EngineConfig
from megatrain.engine.node_store import NodeStore, shard_optimizer_state, topology_of


@pytest.mark.slow
def test_two_ranks_hold_one_host_store_and_replicated_ranks_hold_two(tmp_path):
    one, shared, replicated = (measure(tmp_path / f"{n}-{host}", n, host) for n, host in POINTS)
    assert shared["shared"] and not replicated["shared"]
    state = one["state_bytes"]  # masters, gradients and Adam state of the whole model: 1.6 GB
    # The engine's own count: the ranks' shares add up to one store (plus each rank's resident parameters).
    assert abs(shared["state_bytes"] - state) < 0.01 * state, (shared["state_bytes"], state)
    # Measured: a second rank adds its process (the torch runtime, ~0.3 GB) and layer-sized buffers, ~0.26 of
    # this small store and a vanishing part of a large one; a second private store would add the whole store.
    extra_shared = shared["pss_bytes"] - one["pss_bytes"]
    extra_replicated = replicated["pss_bytes"] - one["pss_bytes"]
    assert extra_shared < 0.35 * state, (extra_shared / state, one, shared)
    assert extra_replicated > 0.8 * state, (extra_replicated / state, one, replicated)  # the negative control


def test_topology_groups_ranks_by_node_in_rank_order():
    assert topology_of(["a/", "a/", "b/", "b/"]) == [[0, 1], [2, 3]]
    assert topology_of(["a/0", "a/1", "a/0", "a/1"]) == [[0, 2], [1, 3]]
    assert topology_of(["a/"]) == [[0]]


def test_shared_memory_shortfall_is_an_error_naming_the_fix(tmp_path):
    # More than /dev/shm can hold: refused up front (a sparse file would crash on first touch), nothing left behind.
    st = os.statvfs("/dev/shm")
    too_big = st.f_bavail * st.f_frsize + 2**30
    path = "/dev/shm/megatrain-test-shortfall"
    message = NodeStore._create([path], [too_big], "layer weights")
    assert message is not None and "--shm-size" in message and "data_parallel_host='replicated'" in message
    assert not os.path.exists(path)
    assert NodeStore._create([path + "-ok"], [4096], "layer weights") is None
    os.unlink(path + "-ok")


def test_host_modes_the_shared_store_cannot_take_are_refused_or_replicated():
    assert EngineConfig().share_host_store
    assert not EngineConfig(data_parallel_host="replicated").share_host_store
    hilo = {"compute_dtype": "bfloat16", "host_master": "hilo"}
    assert not EngineConfig(**hilo).share_host_store  # "auto" replicates what it cannot share
    with pytest.raises(ValueError, match="data_parallel_host='replicated'"):
        EngineConfig(**hilo, data_parallel_host="shared")
    with pytest.raises(ValueError, match="data_parallel_host='everywhere'"):
        EngineConfig(data_parallel_host="everywhere")


@pytest.fixture
def one_rank_group():
    # An earlier test of this process may have left a one-process default group: use it, else make one.
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    yield dist.new_group(backend="gloo")
    if made:
        dist.destroy_process_group()


def test_optimizer_state_is_whole_when_saved_and_only_owned_when_loaded(one_rank_group):
    own, foreign = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([own, foreign], lr=0.1)
    waited = []
    shard_optimizer_state(opt, {id(foreign)}, one_rank_group, lambda: waited.append(1))
    own.grad = torch.ones(3)
    opt.step()  # `foreign` has no gradient: torch makes no state for it, as on a rank that does not own it
    assert set(opt.state) == {own}
    sd = opt.state_dict()
    assert waited and set(sd["state"]) == {0}
    # A whole state (as gathered from every owner) loads, keeping only this rank's share.
    whole = {"state": {0: sd["state"][0], 1: {k: v.clone() for k, v in sd["state"][0].items()}},
             "param_groups": sd["param_groups"]}
    whole["state"][1]["exp_avg"] = torch.full((2,), 5.0)
    whole["state"][1]["exp_avg_sq"] = torch.full((2,), 5.0)
    opt.load_state_dict(whole)
    assert set(opt.state) == {own}
    torch.testing.assert_close(opt.state[own]["exp_avg"], sd["state"][0]["exp_avg"])
