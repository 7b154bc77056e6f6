"""The planner's residency (issue 41): the replay of costs/pipeline.py's order with kept layers and kept graphs,
counted by hand; the placement the planner chooses from a device budget; `megatrain plan`'s placement line and
config section; plain PyTorch's step printed only where the whole model fits the device."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from plan_cli import main as plan_main  # --details: the tables these tests read

from megatrain.config.schema import EngineConfig
from megatrain.costs import residency as kept
from megatrain.models.presets import get_preset
from megatrain.planner import plan
from megatrain.planner.memory import layer_saved_bytes, long_context_plan
from megatrain.planner.pipeline_sim import LayerCosts, simulate_step
from megatrain.planner.placement import Placement, frontier, search
from megatrain.planner.point import ENGINE_RESIDENCY, engine_settings, make_point
from megatrain.planner.reference import torch_reference
from megatrain.planner.step_time import Time

MODEL = get_preset("tiny").with_(name="tiny-6l", num_layers=6)
CONTEXT, MICRO_BATCHES = 64, 2  # two micro-batches: what carries over from one to the next counts too
COSTS = LayerCosts(fwd=1.0, bwd=2.0, load=0.5, act=0.0, grad=0.1, reduce=0.1, cuda=False, recompute=0.75)

# Six layers, two ring buffers (slots 0, 1), two micro-batches per step, counted from costs/pipeline.py's rules:
# reaching a layer copies the kept layers among it and the next one and the next two streamed layers; a kept
# layer is copied once per step into a slot of its own; a graph layer's backward neither copies nor recomputes.
HAND_COUNTED = {
    # stream: forward 0-5 (6 copies); backward 4, 5 still resident, copies 3 2 1 0 (4); the second forward
    # finds 0, 1 resident and copies 2-5 (4); its backward 3 2 1 0 (4): 18 copies, every backward recomputes: 12
    kept.Residency(0, 0): (18, 12),
    # one kept layer (0) with its graph: forward copies 0-5 (6); backward copies 3 2 1 (4, 5 resident; 0 kept)
    # and recomputes 5-1; the second forward finds 0 1 2 resident and copies 3 4 5; its backward 3 2 1 again:
    # 6 + 3 + 3 + 3 = 15 copies, 5 + 5 = 10 recomputes
    kept.Residency(1, 1): (15, 10),
    # two kept layers (0, 1), no graph: forward copies 0 1 2 3, then 4, 5 (6); backward 3, 2 (2; 0 and 1 kept);
    # the second forward finds 0-3 resident, copies 4 5 (2); its backward 3 2 (2): 12 copies, 12 recomputes
    kept.Residency(2, 0): (12, 12),
    # three kept (0-2), graphs for 0 and 1: forward copies 0 1 3 4, 2, 5 (6); backward copies 3 (5, 4 resident,
    # 2 kept) and recomputes 5 4 3 2; the second forward copies only 5 (0-4 resident); its backward 3 again:
    # 6 + 1 + 1 + 1 = 9 copies, 4 + 4 = 8 recomputes
    kept.Residency(3, 2): (9, 8),
    # every layer kept, graph for layer 0 only: each copied once (6), layers 5-1 recomputed in both backwards
    kept.Residency(6, 1): (6, 10),
    # every layer kept with its graph: each copied once (6), nothing recomputed
    kept.Residency(6, 6): (6, 0),
}


def _replayed(r: kept.Residency) -> tuple[int, int]:
    p = make_point(MODEL, CONTEXT, 1, MICRO_BATCHES, "float32", residency=r)
    sim = simulate_step(p, COSTS, head=0.3)[0]
    return sim.bytes_jobs["load"], sim.recomputed


@pytest.mark.parametrize("r", list(HAND_COUNTED), ids=lambda r: f"w{r.weights}a{r.activations}")
def test_the_replay_counts_copies_and_recomputes_by_hand(r):
    assert _replayed(r) == HAND_COUNTED[r]


def test_a_kept_graph_backward_skips_the_recompute():
    p = make_point(MODEL, CONTEXT, 1, 1, "float32")
    stream = simulate_step(p, COSTS, 0.0, residency=kept.Residency(6, 0))[0]
    graphs = simulate_step(p, COSTS, 0.0, residency=kept.Residency(6, 6))[0]
    bwd = [b - a for lane, kind, _, a, b in graphs.spans if lane == "compute" and kind == "bwd"]
    assert bwd == [COSTS.bwd - COSTS.recompute] * 6
    assert stream.t - graphs.t == pytest.approx(6 * COSTS.recompute)


# One layer's weights and one forward graph at this point, and the stream plan's device peak, in bytes (FP32,
# 64 tokens): the device room a budget leaves is 90% of it less that peak (costs/memory.py BUDGET_HEADROOM).
def _sizes() -> tuple[int, int, int, int]:
    lc = long_context_plan(make_point(MODEL, CONTEXT, 1, MICRO_BATCHES, "float32", residency="stream"),
                           _cpu())
    return lc.layer_bytes, lc.graph_bytes, lc.ring_bytes, lc.peak_bytes


def _cpu():
    from megatrain.planner import get_hardware
    return get_hardware("cpu")


def _budget_for(room: int) -> int:
    peak = _sizes()[3]
    return math.ceil((peak + room) / 0.9) + 8


@pytest.mark.parametrize("budget,expect", [
    # room for every layer's weights and graph, the ring freed: all resident
    ("all", kept.Residency(6, 6)),
    # room for 3 weights + 2 graphs: weights first fill it past all six (the ring freed pays), one graph left
    ("half", kept.Residency(6, 1)),
    # room for one layer's weights and graph: two layers' weights fit, no graph beside them
    ("one", kept.Residency(2, 0)),
])
def test_three_budgets_plan_and_replay_as_counted(budget, expect):
    lb, gb, ring, _ = _sizes()
    room = {"all": 6 * lb + 6 * gb - ring, "half": 3 * lb + 2 * gb, "one": lb + gb}[budget]
    pl = plan(MODEL, CONTEXT, 1, MICRO_BATCHES, "float32", hardware="cpu", device_budget_bytes=_budget_for(room),
              residency="auto")
    assert pl.long_context.residency == expect
    loads, recomputes = HAND_COUNTED[expect]
    assert pl.time.recomputed_layers == recomputes
    # a CPU device in FP32 aliases the embedding/head: the step's copies are the layers' alone
    assert pl.time.h2d_bytes == loads * lb
    # the placement is on the device side of the plan, within the budget it was planned for
    assert pl.memory.device["kept layers' weights (residency)"] == expect.weights * lb
    assert pl.memory.device["kept layers' forward graphs (residency)"] == expect.activations * gb
    assert pl.long_context.peak_bytes <= 0.9 * _budget_for(room)


def test_auto_keeps_everything_where_it_fits():
    pl = plan("llama2-7b", 4096, 1, hardware="h200-pcie", residency="auto")
    r, engine = pl.long_context.residency, pl.placement.engine
    # the engine's fill: every layer's weights and optimizer state (engine/update/resident.py; the resident
    # parameters' first), graphs in the room left; the planner's search may trade a few optimizer layers for graphs
    assert (engine.weights, engine.optimizer) == (32, 32) and 0 < engine.activations < 32
    assert r.weights == 32 and r.optimizer >= 24 and r.activations >= engine.activations
    assert pl.time.recomputed_layers == 32 - r.activations
    assert pl.memory.device["layer buffers"] == 0  # the streaming ring is freed
    assert pl.long_context.peak_bytes <= 0.9 * pl.long_context.budget
    # with the engine's fill no layer's weights cross the link (nor the resident parameters': updated on the device), and no gradients
    stream = plan("llama2-7b", 4096, 1, hardware="h200-pcie", residency="stream")
    assert stream.time.recomputed_layers == 32
    fill = plan("llama2-7b", 4096, 1, hardware="h200-pcie", residency=engine)
    assert fill.time.h2d_bytes < stream.time.h2d_bytes / 20 and fill.time.d2h_bytes < stream.time.d2h_bytes / 20
    assert pl.time.step_s <= fill.time.step_s  # the search's trade (optimizer layers for graphs) is no slower
    assert pl.model_tflops > 2 * stream.model_tflops
    # without the optimizer on the device (the weights and every graph kept), the host's update binds
    host = plan("llama2-7b", 4096, 1, hardware="h200-pcie", residency=kept.Residency(32, 32))
    assert pl.model_tflops > 2 * host.model_tflops


def test_the_config_section_writes_residency_only_where_it_changes_the_engines_default():
    assert "residency" not in engine_settings(make_point("qwen2.5-14b", 4096, 1))
    other = kept.Residency(0, 0) if ENGINE_RESIDENCY == kept.AUTO else kept.AUTO
    assert engine_settings(make_point("qwen2.5-14b", 4096, 1, residency=other))["residency"] in ("stream", "auto")
    assert engine_settings(make_point("qwen2.5-14b", 4096, 1, residency={"weights": 3}))["residency"] == {
        "weights": 3, "activations": 0}


def test_a_point_plans_the_engines_own_default():
    # EngineConfig's residency default; an engine without the setting streams every layer
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    expect = kept.parse(fields["residency"]) if "residency" in fields else kept.Residency(0, 0)
    assert make_point("tiny", 64).residency == expect == ENGINE_RESIDENCY
    assert make_point("tiny", 64, engine_config=EngineConfig()).residency == expect


@pytest.mark.parametrize("bad", ["keep", {"weights": 2, "activations": 3}, {"layers": 2}, -1])
def test_a_bad_residency_names_the_value(bad):
    with pytest.raises(ValueError, match="residency"):
        make_point("tiny", 64, residency=bad)


def _timed(steps: dict[kept.Residency, float]):
    def step_of(r: kept.Residency) -> Time:
        t = plan("tiny", 64, dtype="float32", hardware="cpu", residency="stream").time
        t.step_s = steps.get(r, 10.0)
        return t
    return step_of


def test_the_search_keeps_the_engines_fill_unless_another_is_clearly_faster():
    lc = long_context_plan(make_point(MODEL, CONTEXT, 1, 1, "float32"), _cpu())
    lb, gb = lc.layer_bytes, lc.graph_bytes
    lc = dataclasses.replace(lc, residency=kept.Residency(3, 0), residency_room=3 * lb)
    # the frontier: 3 weights and no graph (the engine's fill), then one graph with as many weights as still fit
    assert frontier(lc)[0] == kept.Residency(3, 0)
    assert all(r.weights * lb + r.activations * gb <= 3 * lb for r in frontier(lc))
    other = frontier(lc)[1]
    near, _ = search(lc, _timed({kept.Residency(3, 0): 1.0, other: 0.995}))
    assert near.chosen == kept.Residency(3, 0) and not near.differs  # 0.5% is inside PREFER_ENGINE_WITHIN
    far, _ = search(lc, _timed({kept.Residency(3, 0): 1.0, other: 0.9}))
    assert isinstance(far, Placement) and far.chosen == other and far.differs


def test_plan_prints_the_placement_and_writes_only_a_changed_default(capsys):
    assert plan_main(["--model", "llama2-7b", "--hardware", "h200-pcie", "--context", "4096", "--batch", "1",
                      "--no-search", "--compare", "", "--residency", "auto"]) == 0
    out = capsys.readouterr().out
    # the engine's fill: every layer's weights and optimizer state on the device (engine/update/resident.py), graphs
    # in what is left (the resident parameters' 16 B/param taken first: 4.2 GB, six graphs' room) ...
    assert "would keep 32 layers' weights and 14 graphs (per step h2d 0 B, 18 layers recomputed)" in out
    # ... which the search beats by trading four layers' optimizer state for graphs (their speculative updates
    # hidden behind the device layers' backward): the section writes those counts, as it does wherever they differ
    assert "residency: 32 of 32 layers' weights on the device, 31 keep their activations" in out
    assert "28 update on the device" in out and "1 layers recomputed" in out
    section = json.loads(out.split('"megatrain" config section for this plan: ')[1].splitlines()[0])
    assert section["residency"] == {"weights": 32, "activations": 31, "optimizer": 28}
    assert plan_main(["--model", "llama2-7b", "--hardware", "h200-pcie", "--context", "4096", "--batch", "1",
                      "--no-search", "--compare", "", "--residency", "4,2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["residency"]["weights"], d["residency"]["activations"]) == (4, 2)
    assert d["residency"]["recomputed_layers_per_step"] == 30
    assert d["settings"]["residency"] == {"weights": 4, "activations": 2}


def test_a_bad_residency_flag_is_one_error_line(capsys):
    with pytest.raises(SystemExit):
        plan_main(["--model", "tiny", "--residency", "2,3,4"])
    assert "use auto, stream, W" in capsys.readouterr().err


def test_torch_is_predicted_only_where_the_model_fits(capsys):
    fits = plan("llama2-7b", 4096, 1, hardware="h200-pcie", residency="auto")
    ref = torch_reference(fits)
    assert ref is not None and ref.point.backend == "torch" and not ref.point.gradient_checkpointing
    assert ref.time.recomputed_layers == 0
    too_big = plan("qwen2.5-14b", 4096, 1, hardware="gh200", residency="auto")
    assert torch_reference(too_big) is None
    for model, hw, shown in (("llama2-7b", "h200-pcie", True), ("qwen2.5-14b", "gh200", False)):
        plan_main(["--model", model, "--hardware", hw, "--no-search", "--compare", ""])
        assert ("plain PyTorch here" in capsys.readouterr().out) is shown


def test_torch_without_checkpointing_keeps_every_layers_graph_and_bf16_weights():
    m = get_preset("llama2-7b")
    pl = plan(m, 4096, 1, hardware="h200-pcie", backend="torch", gradient_checkpointing=False)
    assert pl.memory.device["saved activations"] == m.num_layers * layer_saved_bytes(m, 4096, 2)
    assert pl.memory.device["bf16 weight casts (autocast)"] == (m.num_layers * m.layer_params() + m.vocab * m.hidden) * 2
