"""The planner's speculative step (planner/point.py speculative_on, memory.py, step_time.py): the rollback copy in
the host memory where the engine's "auto" would run it, and the layer updates started in backward instead of
waiting behind the next forward."""

from __future__ import annotations

import pytest

from megatrain.config.settings import planner_knobs
from megatrain.costs.modes import HostMaster, rollback_bytes_per_param
from megatrain.planner import plan
from megatrain.planner.hardware import get_hardware
from megatrain.planner.point import engine_settings, make_point, speculative_on
from megatrain.planner.step_time import IDLE_LAYERS, IDLE_LAYERS_SPECULATIVE

COPY = "speculative rollback copy"


def test_the_rollback_copy_is_in_the_host_memory_where_auto_runs_it():
    # every layer updated on the host (residency "stream"): the copy is each layer's, the only difference
    on = plan("llama2-7b", 4096, batch=4, hardware="h200-pcie", residency="stream")
    off = plan("llama2-7b", 4096, batch=4, hardware="h200-pcie", residency="stream", speculative_step=False)
    m = on.point.model
    per_layer = m.layer_params() * rollback_bytes_per_param(HostMaster.FP32, True)
    assert on.memory.host[COPY] == m.num_layers * per_layer
    assert off.memory.host[COPY] == 0
    assert on.memory.host_total - off.memory.host_total == on.memory.host[COPY]
    # residency "auto": optimizer-resident layers update on the device, not speculated: no copy of theirs
    auto = plan("llama2-7b", 4096, batch=4, hardware="h200-pcie")
    k = auto.long_context.residency.optimizer
    assert 0 < k < m.num_layers and auto.memory.host[COPY] == (m.num_layers - k) * per_layer
    # "auto" is off on a CPU device, and where the copy would not fit beside the store
    assert not speculative_on(make_point("llama2-7b", 4096, host_master="fp32"), get_hardware("cpu"))
    small = get_hardware("h200-pcie")
    import dataclasses

    tight = dataclasses.replace(small, host_memory_gib=150.0)
    assert not speculative_on(make_point("llama2-7b", 4096, host_master="fp32"), tight)
    assert speculative_on(make_point("llama2-7b", 4096, host_master="fp32", speculative_step=True), tight)  # as set


@pytest.mark.parametrize("overlap", [True, False])
def test_layer_updates_start_in_backward(overlap):
    kw = dict(batch=4, hardware="h200-pcie", optimizer_overlap=overlap)
    on = plan("llama2-7b", 4096, **kw)
    off = plan("llama2-7b", 4096, speculative_step=False, **kw)
    assert on.time.step_s < off.time.step_s  # backward hides what the next forward did not
    assert IDLE_LAYERS_SPECULATIVE in on.time.idle_s and IDLE_LAYERS_SPECULATIVE not in off.time.idle_s
    assert on.time.busy_s["host rollback copy"] > 0 and "host rollback copy" not in off.time.busy_s
    assert on.timeline.host_busy_s["rollback copy"] == on.time.busy_s["host rollback copy"]
    if overlap:
        assert IDLE_LAYERS in off.time.idle_s


def test_the_setting_as_written():
    assert make_point("llama2-7b", 4096, speculative_step="auto").speculative_step == "auto"  # EngineConfig's value
    with pytest.raises(ValueError, match="speculative_step='yes'"):
        make_point("llama2-7b", 4096, speculative_step="yes")
    assert "speculative_step" not in engine_settings(make_point("llama2-7b", 4096))
    assert engine_settings(make_point("llama2-7b", 4096, speculative_step=False))["speculative_step"] is False
    assert planner_knobs({"speculative_step": False}) == {"speculative_step": False}


def test_auto_speculates_with_data_parallel_ranks():
    from megatrain.planner.multi import plan_multi

    mp = plan_multi("llama2-7b", 4096, batch=4, hardware="h200-pcie", gpus_per_node=2)
    # one rollback copy per node, of every layer here (7B's fit a 1.5 TB node beside two ranks' state), as the
    # engine's "auto" sizes it (planner/multi.py node_speculation); the one-GPU reference speculates too
    assert mp.rank.memory.host[COPY] == mp.single.memory.host[COPY] > 0
    assert mp.rank.time.busy_s["host rollback copy"] > 0
