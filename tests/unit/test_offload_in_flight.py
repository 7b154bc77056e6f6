"""Offloaded boundary activations when the budget binds: copies stop overlapping, so three boundaries are on the
device at once instead of four (engine/pipeline/activations.py, costs/memory.py OFFLOAD_IN_FLIGHT_TIGHT)."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from conftest import tiny_model

from megatrain.config.schema import EngineConfig
from megatrain.costs.memory import BUDGET_HEADROOM, OFFLOAD_IN_FLIGHT, OFFLOAD_IN_FLIGHT_TIGHT
from megatrain.engine import Engine


def _run(model, seq: int, **kw):
    eng = Engine(copy.deepcopy(model), EngineConfig(measure_device_memory=True, offload_activations=True,
                                                     mlp_tile_tokens=256, loss_chunk_tokens=256, **kw))
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(3))
    loss = eng(input_ids=ids, labels=ids).loss
    eng.backward(loss)
    eng.pipeline.synchronize_grads()
    st = eng.collect_stats()
    return loss.item(), {n: p.grad.clone() for n, p in eng.named_parameters()}, st, eng.pipeline.last_plan


@pytest.mark.slow
def test_a_binding_budget_keeps_one_boundary_fewer_with_the_same_gradients():
    model = tiny_model("llama", layers=4, hidden=128, max_pos=2048)
    seq = 2048
    free = _run(model, seq)  # no budget on a CPU device: copies overlap
    assert free[3].offload and free[3].in_flight == OFFLOAD_IN_FLIGHT
    # a budget the overlapped plan misses by one boundary and the serial one meets
    policy = Engine(copy.deepcopy(model), EngineConfig(offload_activations=True, mlp_tile_tokens=256,
                                                       loss_chunk_tokens=256)).pipeline.policy
    boundary = seq * 128 * 4
    tight_peak = dataclasses.replace(policy, budget=None).plan(seq).predicted_peak_bytes - (OFFLOAD_IN_FLIGHT - OFFLOAD_IN_FLIGHT_TIGHT) * boundary
    budget = int((tight_peak + boundary // 2) / BUDGET_HEADROOM)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the plan must fit without the engine warning
        tight = _run(model, seq, device_budget_bytes=budget)
    assert tight[3].in_flight == OFFLOAD_IN_FLIGHT_TIGHT
    saved = free[2]["peak_device_bytes"] - tight[2]["peak_device_bytes"]
    assert saved >= 0.9 * boundary, (saved, boundary)  # the control: with overlap it holds one more
    assert tight[2]["peak_device_bytes"] <= budget
    for st in (free[2], tight[2]):
        err = st["predicted_peak_device_bytes"] / st["peak_device_bytes"] - 1
        assert abs(err) <= 0.10, f"predicted vs measured: {err:+.1%}"
    assert tight[0] == free[0] and all(torch.equal(tight[1][n], g) for n, g in free[1].items())
