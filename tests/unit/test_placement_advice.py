"""Residency "auto" as the planner's search (planner/advice.py, costs/advice.py, backend/placement.py).

On a GPU a hardware profile describes, the backend hands the engine the planner's placement search: the engine's
optimizer-resident count and each training batch's kept weights and graphs are then what `megatrain plan` prints
for that point, not the engine's fixed fill. Checked here: which profile a device name maps to; the advisor's
answer is the plan's own (llama2-7b on an H200 at 1 x 4096, where the engine's fill is predicted ~16% slower); an
engine under the device-budget emulation takes the advice (its count at build, its placement per batch), refuses
advice that does not fit its measured room, and trains bit for bit as streaming does with it (kept, and offloaded,
graphs included).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from conftest import tiny_model

from megatrain.backend.placement import placement_advice
from megatrain.config import EngineConfig
from megatrain.costs.residency import Residency
from megatrain.engine import Engine
from megatrain.planner import plan
from megatrain.planner.advice import Advisor, profile_for_device
from megatrain.planner.hardware import get_hardware
from megatrain.run.start_line import describe

LAYERS = 4
EMULATED = {"compute_dtype": "float32", "device_budget_bytes": 8 << 20, "link_gbps": 100.0}


@pytest.mark.parametrize("name, profile", [
    ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA H200", "h200-pcie"), ("NVIDIA H200 NVL", "h200-pcie"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA A100-SXM4-80GB", "a100-pcie"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"), ("NVIDIA RTX 6000 Ada Generation", None), ("", None)])
def test_a_device_name_maps_to_its_profile(name, profile):
    hw = profile_for_device(name)
    assert (hw.name if hw is not None else None) == profile


def test_the_profile_takes_this_machines_memory_sizes_and_keeps_its_rates():
    base = get_hardware("gh200")
    hw = profile_for_device("NVIDIA GH200 480GB", device_bytes=90 << 30, host_bytes=400 << 30)
    assert (hw.device_memory_gib, hw.host_memory_gib) == (90, 400)
    assert (hw.link_gbs_achieved, hw.peak_bf16_tflops) == (base.link_gbs_achieved, base.peak_bf16_tflops)


def test_the_advice_is_the_plans_placement_where_the_engines_fill_is_slower():
    # llama2-7b, H200, 1 x 4096: the engine's fill keeps every layer's optimizer and crowds out graphs; the plan's
    # search trades some optimizer layers for graphs. The advisor, given the plan's budget, answers the same.
    pl = plan("llama2-7b", context=4096, batch=1, hardware="h200-pcie", host_master="hilo",
              host_grad_dtype="bfloat16")
    assert pl.placement is not None and pl.placement.differs  # the case this exists for
    config = EngineConfig(compute_dtype="bfloat16", host_master="hilo", host_grad_dtype="bfloat16")
    advisor = Advisor("llama2-7b", get_hardware("h200-pcie"))
    budget = pl.long_context.budget
    assert advisor.optimizer_layers(config, budget) == pl.placement.chosen.optimizer
    assert advisor.residency(config, 4096, budget) == pl.placement.chosen
    # with the engine's count fixed, the search's graphs for it
    fixed = advisor.residency(config, 4096, budget, optimizer=pl.placement.engine.optimizer)
    assert fixed.optimizer == pl.placement.engine.optimizer


def test_the_backend_gives_advice_only_on_a_profiled_gpu_with_residency_auto():
    model = tiny_model("llama", layers=LAYERS)
    auto = EngineConfig()
    cuda = torch.device("cuda", 0)
    assert isinstance(placement_advice(cuda, model, auto, device_name="NVIDIA H200"), Advisor)
    assert placement_advice(cuda, model, auto, device_name="NVIDIA RTX 6000 Ada Generation") is None
    assert placement_advice(torch.device("cpu"), model, auto) is None
    assert placement_advice(cuda, model, EngineConfig(residency="stream"), device_name="NVIDIA H200") is None


class _Fixed:
    """Advice that answers fixed counts, recording what it was asked."""

    source = "a fixed advice"

    def __init__(self, optimizer: int, residency: Residency | None) -> None:
        self.count, self.answer, self.asked = optimizer, residency, []

    def optimizer_layers(self, config, budget):
        self.asked.append(("optimizer", budget))
        return self.count

    def residency(self, config, tokens, budget, optimizer):
        self.asked.append(("residency", tokens, budget, optimizer))
        return None if self.answer is None else dataclasses.replace(self.answer, optimizer=optimizer)


def _train(residency="auto", advice=None, steps: int = 2, **cfg) -> tuple[Engine, list[float]]:
    model = tiny_model("llama", layers=LAYERS)
    eng = Engine(model, EngineConfig(residency=residency, **{**EMULATED, **cfg}), placement_advice=advice,
                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    g, losses = torch.Generator().manual_seed(0), []
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 32), generator=g)
        out = eng(input_ids=ids, labels=ids)
        eng.backward(out.loss)
        eng.step()
        eng.zero_grad()
        losses.append(out.loss.item())
    return eng, losses


# FP32, and the GPU's defaults (bf16 compute, the exact hi/lo master, the update overlapped)
MODES = [{}, {"compute_dtype": "bfloat16", "host_master": "hilo", "optimizer_overlap": True}]


@pytest.mark.parametrize("mode", MODES, ids=["fp32", "gpu-defaults"])
def test_the_engine_takes_the_advice_and_trains_as_streaming_does(mode):
    own, _ = _train(**mode)
    advice = _Fixed(1, Residency(3, 1, 0))
    eng, losses = _train(advice=advice, **mode)
    assert ("optimizer", eng.pipeline.policy.budget) in advice.asked  # asked at build, under its own budget
    assert len(eng.optimizer_layers) == 1
    assert eng.pipeline.residency == Residency(3, 1, 1)
    assert ("residency", 64, eng.pipeline.policy.budget, 1) in advice.asked
    assert (own.pipeline.residency, len(own.optimizer_layers)) != (eng.pipeline.residency, 1)  # not its own fill
    _, streamed = _train("stream", **mode)
    assert losses == streamed


def test_advised_offloaded_graphs_run_as_advised_and_train_as_streaming_does():
    eng, losses = _train(advice=_Fixed(0, Residency(3, 2, 0, 1)))
    assert eng.pipeline.residency == Residency(3, 2, 0, 1)
    st = eng.collect_stats()
    assert st["offloaded_graph_layers"] == 1 and st["offloaded_graph_bytes"] > 0
    assert losses == _train("stream")[1]


def test_advice_that_does_not_fit_the_measured_room_is_not_taken():
    own, _ = _train()
    eng, _ = _train(advice=_Fixed(0, Residency(LAYERS, LAYERS, 0)))  # every graph: beyond 8 MiB at 2 x 32
    assert eng.pipeline.residency == own.pipeline.residency
    none, _ = _train(advice=_Fixed(0, None))
    assert none.pipeline.residency == own.pipeline.residency


def test_the_planners_advice_drives_an_engine_and_the_start_line_names_it():
    model = tiny_model("llama", layers=LAYERS)
    advisor = Advisor(model.config, get_hardware("h200-pcie"))
    eng = Engine(model, EngineConfig(**EMULATED), placement_advice=advisor,
                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    eng.backward(eng(input_ids=ids, labels=ids).loss)
    eng.step()
    asked = advisor.residency(eng.config, 64, eng.pipeline.policy.budget, len(eng.optimizer_layers))
    assert asked is not None and eng.pipeline.residency == asked
    assert "residency: auto (the planner's search on the h200-pcie profile)" in describe("accelerate", eng)


def test_an_engine_built_already_gets_the_plans_offloaded_graphs_beside_its_count():
    # SuperOffload's point (qwen2.5-14b, GH200, 4 x 4096): the plan offloads graphs over NVLink-C2C. The engine asks
    # for its count when built, then for each batch with that count fixed: the same placement comes back.
    pl = plan("qwen2.5-14b", 4096, batch=4, hardware="gh200")
    assert pl.placement.chosen.offload > 0
    config = EngineConfig(compute_dtype="bfloat16", host_master=pl.point.host_master,
                          host_grad_dtype=pl.point.host_grad_dtype)
    advisor, budget = Advisor("qwen2.5-14b", get_hardware("gh200")), pl.long_context.budget
    count = advisor.optimizer_layers(config, budget)
    assert advisor.residency(config, 4 * 4096, budget, count) == pl.placement.chosen


def test_each_local_rank_plans_with_its_share_of_the_host(monkeypatch):
    model = tiny_model("llama", layers=LAYERS)
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = placement_advice(cuda, model, EngineConfig(), device_name="NVIDIA H200").hardware.host_memory_gib
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # as torchrun --nproc-per-node 4 sets it
    shared = placement_advice(cuda, model, EngineConfig(), device_name="NVIDIA H200").hardware.host_memory_gib
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert alone == pytest.approx(total) and shared == pytest.approx(total / 4, rel=1e-9)
