"""The speculative step planned with several data-parallel ranks (planner/multi.py node_speculation), as the engine
runs it (engine/update/speculative.py, "Several ranks"): one rollback copy per node (each rank its 1/G ranges on the
node path, each layer's owner on the per-rank path), "auto" taking as many layers as fit what the node has left by
costs/rollback.py's rule, the step with the speculation's saving; nodes sharing one store as set only."""

from __future__ import annotations

import pytest

from megatrain.costs.modes import HostMaster, rollback_bytes_per_param
from megatrain.costs.rollback import ROLLBACK_HEADROOM_BYTES, layers_that_fit, rollback_budget
from megatrain.models.presets import get_preset
from megatrain.planner import get_hardware, plan
from megatrain.planner.multi import ROLLBACK, node_speculation, plan_multi, plan_point_multi
from megatrain.planner.point import make_point, speculative_layers

GIB = 1024**3
HW = "h100-sxm"
POINT = dict(context=4096, batch=1, hardware=HW, gpus_per_node=8)


def _per_param(mp) -> int:
    p = mp.rank.point
    return rollback_bytes_per_param(HostMaster(p.host_master), p.c == 2)


@pytest.mark.parametrize("path", ["auto", "per-rank"])
def test_70b_node_holds_one_rollback_copy_of_the_layers_that_fit(path):
    mdl, hw = get_preset("llama3.1-70b"), get_hardware(HW)
    on = plan_multi(mdl.name, **POINT, data_path=path)
    off = plan_multi(mdl.name, **POINT, data_path=path, speculative_step=False)
    assert on.fits and on.rank.point.host_master == off.rank.point.host_master
    row = on.rank.memory.host[ROLLBACK]
    held = on.host_node_bytes - row
    assert held == off.host_node_bytes  # the copies are all the speculation adds to the node
    # the engine's rule over the node's host: whole layers' copies in forward order while they fit what is left
    per_param = _per_param(on)
    count = layers_that_fit(mdl.layer_sizes(), per_param, rollback_budget(hw.host_bytes - held))
    assert 0 < count < mdl.num_layers  # 70B's copies do not all fit a 2 TiB node beside its state: partial
    assert row == per_param * sum(mdl.layer_sizes()[:count])  # one copy per node, not one per rank
    assert 8 * row > hw.host_bytes  # (a copy per rank could never have fitted)
    t_on, t_off = on.rank.time, off.rank.time
    assert t_on.busy_s.get("host rollback copy", 0.0) > 0 and "host rollback copy" not in t_off.busy_s
    assert on.step_s < off.step_s and on.job_tokens_per_s > off.job_tokens_per_s


def test_speculative_step_saves_time_on_qwen_32b_node():
    on = plan_multi("qwen2.5-32b", **POINT)
    off = plan_multi("qwen2.5-32b", **POINT, speculative_step=False)
    assert on.rank.memory.host[ROLLBACK] > 0 and on.step_s < off.step_s


def test_a_host_too_small_for_the_copies_plans_them_off():
    """As the engine's resolve would: room for three layers' copies takes three, room for less than one takes
    none, and the plan is then the plan without the speculative step."""
    mdl = get_preset("llama3.1-70b")
    off = plan_multi(mdl.name, **POINT, speculative_step=False)
    held, sizes, per_param = off.host_node_bytes, mdl.layer_sizes(), _per_param(off)
    for k in (3, 0):
        room = held + ROLLBACK_HEADROOM_BYTES + per_param * (sum(sizes[:k]) + sizes[k] // 2)
        on = plan_multi(mdl.name, **POINT, host_memory_gib=room / GIB)
        small_off = plan_multi(mdl.name, **POINT, host_memory_gib=room / GIB, speculative_step=False)
        assert small_off.host_node_bytes == held and on.fits
        assert on.rank.memory.host[ROLLBACK] == per_param * sum(sizes[:k]), k
        if k == 0:
            assert "host rollback copy" not in on.rank.time.busy_s
            assert on.step_s == small_off.step_s and on.host_node_bytes == held
        else:  # (the lowest layers' gradients land last: three of them hide little, planned as the engine runs them)
            assert on.rank.time.busy_s["host rollback copy"] > 0


def test_nodes_sharing_one_store_speculate_their_own_layers_as_set_only():
    """The engine runs speculative_step=True with nodes sharing one store (each layer's owner copies and restores it)
    and keeps "auto" off there: the plan counts each node's copies of its own block of layers, once."""
    p = make_point("llama3.1-70b", 4096, 1, 1, "bfloat16", "megatrain", host_master="fp32")
    hw = get_hardware(HW).with_(network_gbs=50.0)
    shared = plan_point_multi(p, hw, 8, 2, store_nodes=2)
    assert shared.rank.memory.host[ROLLBACK] == 0 and "host rollback copy" not in shared.rank.time.busy_s
    on = plan_point_multi(make_point("llama3.1-70b", 4096, 1, 1, "bfloat16", "megatrain", host_master="fp32",
                                     speculative_step=True), hw, 8, 2, store_nodes=2)
    layers = get_preset("llama3.1-70b").num_layers
    assert node_speculation(on.rank, 8, 2, "node", 2) == layers // 2
    assert on.rank.memory.host[ROLLBACK] == layers // 2 * on.rank.point.model.layer_params() * _per_param(on)
    assert on.host_node_bytes - shared.host_node_bytes == on.rank.memory.host[ROLLBACK]


@pytest.mark.parametrize("hw, host_gib", [("h100-sxm", 1000), ("h200-pcie", None)])
def test_one_rank_counts_the_copies_as_one_gpu_does(hw, host_gib):
    """The node's count at one rank is point.speculative_layers' (the one-GPU rule): the same costs/rollback.py
    budget, fed the node's rows; both partial here (a few of 80 layers' copies fit)."""
    pl = plan("llama3.1-70b", 4096, 1, hardware=hw, residency="stream",
              **({} if host_gib is None else {"host_memory_gib": host_gib}))
    lc = pl.long_context
    one = speculative_layers(pl.point, pl.hardware, lc.residency.optimizer, lc.offload, lc.offloaded_graph_host_bytes)
    assert 0 < one < pl.point.model.num_layers
    assert node_speculation(pl, 1) == one
