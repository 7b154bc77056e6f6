"""Offloaded graphs (residency `offload`, engine/pipeline/saved_offload.py): a kept graph whose saved activations wait
for backward in host memory trains bit for bit as the graph kept on the device and as streaming with recompute (a
copy, not a recompute), moves exactly its saved activations' bytes each way, and holds less device memory.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import make_batches, tiny_model
from gpu_defaults import CONFIGS
from kit import router_loss_moe
from plan_cli import main as plan_main  # --details: the tables these tests read

from megatrain.config.schema import EngineConfig
from megatrain.costs.memory import LayerDims, LongContextPolicy, layer_graph_bytes
from megatrain.costs.residency import OFFLOADED_GRAPHS_IN_FLIGHT, Residency, parse
from megatrain.engine import Engine
from megatrain.engine.pipeline import saved_offload
from megatrain.engine.pipeline.schedule import LayerPipeline
from megatrain.models.presets import get_preset
from megatrain.planner import get_hardware, pipeline_sim, plan
from megatrain.planner.memory import long_context_plan, megatrain_memory
from megatrain.planner.pipeline_sim import LayerCosts, graph_bytes, simulate_step
from megatrain.planner.point import make_point
from megatrain.planner.step_time import layer_costs

LAYERS, STEPS, MICRO = 4, 2, 2
KEPT = {"weights": LAYERS, "activations": LAYERS}
OFFLOADED = {**KEPT, "offload": 2}
LINK = {"link_gbps": 100.0}  # an emulated link: the copies run on the copy workers, as on a GPU


def _train(residency, layers: int = LAYERS, batches=None, **cfg) -> tuple[list[float], list[torch.Tensor], dict]:
    torch.manual_seed(0)
    model = tiny_model("llama", layers=layers)
    eng = Engine(model, EngineConfig(residency=residency, **cfg),
                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    losses, grads = [], []
    eng.reset_stats()
    for _ in range(STEPS):
        for b in batches or make_batches(MICRO):
            out = eng(**b)
            eng.backward(out.loss)
            losses.append(out.loss.item())
        eng.synchronize()
        grads += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        eng.clip_grad_norm_(0.5)
        eng.step()
        eng.zero_grad()
    stats = eng.collect_stats()
    return losses, grads + [v.clone() for v in eng.state_dict().values()], stats


def _same(a, b) -> None:
    assert a[0] == b[0], (a[0], b[0])
    assert len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("mode", CONFIGS)
def test_offloaded_graphs_train_bit_for_bit_as_kept_graphs_and_as_streaming(mode):
    ref = _train("stream", **mode, **LINK)
    kept = _train(KEPT, **mode, **LINK)
    off = _train(OFFLOADED, **mode, **LINK)
    _same(off, kept)
    _same(off, ref)
    st = off[2]
    assert st["offloaded_graph_layers"] == 2 and st["kept_graph_layers"] == LAYERS and st["recomputed_layers"] == 0
    # the copies are on the link: each way, exactly what the offloaded layers sent
    assert st["d2h_bytes"] - kept[2]["d2h_bytes"] == st["offloaded_graph_bytes"] > 0
    assert st["h2d_bytes"] - kept[2]["h2d_bytes"] == st["offloaded_graph_bytes"]


def _measured_saved_bytes(monkeypatch, offloaded: frozenset[int]) -> list[int]:
    """Record, in a run that keeps every graph on the device, the bytes each forward of an `offloaded` layer saves
    for backward beyond its weights and inputs (the tensors it made): per storage, the range its saved views read."""
    seen: list[int] = []
    call = LayerPipeline._call

    def recording(self, i, weights, x, inputs, handed, tile=None):
        if i not in offloaded or not torch.is_grad_enabled():
            return call(self, i, weights, x, inputs, handed, tile)
        outside = {t.untyped_storage().data_ptr() for t in [x, *weights.values(), *torch.utils._pytree.tree_flatten(
            inputs)[0]] if isinstance(t, torch.Tensor)}
        ranges: dict[tuple, tuple[int, int, int]] = {}  # (storage, dtype) -> (first, last + 1, itemsize)

        def pack(t):
            key = (t.untyped_storage().data_ptr(), t.dtype)
            if key[0] not in outside and t.numel():
                last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
                lo, hi, _ = ranges.get(key, (t.storage_offset(), last + 1, 0))
                ranges[key] = (min(lo, t.storage_offset()), max(hi, last + 1), t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = call(self, i, weights, x, inputs, handed, tile)
        seen.append(sum((hi - lo) * size for lo, hi, size in ranges.values()))
        return y

    monkeypatch.setattr(LayerPipeline, "_call", recording)
    return seen


def _bytes_match(monkeypatch, mode: dict) -> None:
    """The offloaded run's bytes each way equal the saved activations a kept run's same layers made (measured)."""
    off = Residency(**OFFLOADED).offloaded
    with monkeypatch.context() as m:
        seen = _measured_saved_bytes(m, off)
        _train(KEPT, **mode, **LINK)
    assert len(seen) == len(off) * MICRO * STEPS
    st = _train(OFFLOADED, **mode, **LINK)[2]
    assert st["offloaded_graph_bytes"] == sum(seen), (st["offloaded_graph_bytes"], sum(seen))


@pytest.mark.parametrize("mode", CONFIGS)
def test_the_bytes_moved_are_the_saved_activations_measured(monkeypatch, mode):
    _bytes_match(monkeypatch, mode)


def test_negative_control_a_weight_packed_to_the_host_miscounts_the_bytes(monkeypatch):
    """Move everything saved (the kept weights and the input too): more bytes than the activations made."""
    recording = saved_offload.GraphOffload.recording
    monkeypatch.setattr(saved_offload.GraphOffload, "recording", lambda self, layer, keep: recording(self, layer, []))
    with pytest.raises(AssertionError):
        _bytes_match(monkeypatch, {"compute_dtype": "float32"})


def test_negative_control_a_broken_unpack_order_changes_the_gradients(monkeypatch):
    """Hand back two saved tensors of the same shape swapped: the comparison sees it."""
    ref = _train(KEPT, compute_dtype="float32", **LINK)
    fetch = saved_offload.GraphOffload.fetch

    def swapped(self, layer):
        fetch(self, layer)  # copied back and waited for: the swap below is the last write
        devs = self._device[layer]
        by_size: dict[tuple, list[int]] = {}
        for n, d in enumerate(devs):
            by_size.setdefault((d.numel(), d.dtype), []).append(n)
        a, b = next(v for v in by_size.values() if len(v) > 1)[:2]
        devs[a], devs[b] = devs[b], devs[a]

    monkeypatch.setattr(saved_offload.GraphOffload, "fetch", swapped)
    broken = _train(OFFLOADED, compute_dtype="float32", **LINK)
    with pytest.raises(AssertionError):
        _same(broken, ref)


PEAK = {"compute_dtype": "float32", "device_budget_bytes": 256 << 20, "measure_device_memory": True, **LINK}
DEEP = 6


def test_offloaded_graphs_lower_the_measured_device_peak():
    """Six graphs kept against two kept and four offloaded (two in flight, never beside the kept ones): the
    measured peak drops by about four layers' graphs, as the plan predicts."""
    batches = make_batches(1, batch=2, seq=96)
    kept = _train({"weights": DEEP, "activations": DEEP}, layers=DEEP, batches=batches, **PEAK)[2]
    off = _train({"weights": DEEP, "activations": DEEP, "offload": 4}, layers=DEEP, batches=batches, **PEAK)[2]
    graph = off["offloaded_graph_bytes"] / (4 * STEPS)  # one layer's saved activations, measured
    saved = kept["peak_device_bytes"] - off["peak_device_bytes"]
    assert saved >= 3.5 * graph, (saved / graph, kept["peak_device_bytes"], off["peak_device_bytes"])
    assert off["predicted_peak_device_bytes"] < kept["predicted_peak_device_bytes"]
    assert off["peak_device_bytes"] <= off["predicted_peak_device_bytes"]


def test_a_link_slower_than_the_compute_holds_the_offloaded_graphs_in_flight_to_the_plan(monkeypatch):
    """At 0.01 GB/s one layer's ~1 MB of saved activations takes ~100 ms to leave, far longer than the tiny layer's
    forward even on a loaded machine (at 0.05 GB/s, 20 ms, a forward slowed by other work let the copies drain and
    the control passed by chance): the forward must wait for the copy before the previous layer's, or the device
    copies pile up behind the link. The control: without that wait, the measured peak passes the plan's."""
    slow = {**PEAK, "link_gbps": 0.01}
    batches = make_batches(1, batch=2, seq=96)
    setting = {"weights": DEEP, "activations": DEEP, "offload": DEEP}
    held = _train(setting, layers=DEEP, batches=batches, **slow)[2]
    assert held["peak_device_bytes"] <= held["predicted_peak_device_bytes"]

    monkeypatch.setattr(saved_offload.GraphOffload, "_sending", property(lambda self: None, lambda self, v: None),
                        raising=False)
    piled = _train(setting, layers=DEEP, batches=batches, **slow)[2]
    assert piled["peak_device_bytes"] > piled["predicted_peak_device_bytes"]


def test_the_setting_reads_writes_and_refuses_as_documented():
    r = parse({"weights": 4, "activations": 3, "offload": 2})
    assert r == Residency(4, 3, 0, 2) and r.offloaded == frozenset({0, 1}) and r.graphs == frozenset({0, 1, 2})
    assert r.to_dict() == {"weights": 4, "activations": 3, "offload": 2}
    assert Residency(4, 3).to_dict() == {"weights": 4, "activations": 3}  # as written before offload existed
    assert "2 of those graphs' saved activations offloaded" in r.describe(8)
    with pytest.raises(ValueError, match=r"offload=3 > activations=2.*activations >= 3"):
        parse({"weights": 4, "activations": 2, "offload": 3})
    assert Residency(4, 4, 0, 4).capped(2) == Residency(2, 2, 0, 2)


def test_the_plan_counts_the_offloaded_graphs_in_flight_not_all_of_them():
    dims = LayerDims(hidden=64, kv=32, intermediate=128, numel=50_000, head_dim=16)

    def peak(r: Residency) -> int:
        p = LongContextPolicy(dims, 8, 4, 256, "auto", None, False, 1 << 40, 0, residency=r)
        return p.plan(512).predicted_peak_bytes

    graph = layer_graph_bytes(dims, 512, 4)
    for j in range(9):
        expect = max(8 - j, min(j, OFFLOADED_GRAPHS_IN_FLIGHT)) * graph
        assert peak(Residency(8, 8, 0, j)) - peak(Residency(8, 0)) == expect


# -- the planner ---------------------------------------------------------------------------------------------------

SIM_MODEL = get_preset("tiny").with_(name="tiny-6l", num_layers=6)
SIM_COSTS = LayerCosts(fwd=1.0, bwd=2.0, load=0.5, act=0.0, grad=0.1, reduce=0.1, cuda=False, recompute=0.75)


def _sim(r: Residency, graph: float, micro: int = 2):
    p = make_point(SIM_MODEL, 64, 1, micro, "float32", residency=r)
    return simulate_step(p, dataclasses.replace(SIM_COSTS, graph=graph), head=0.3, residency=r)[0]


def test_an_offloaded_graph_replays_with_no_recompute_and_its_copies_on_both_lanes():
    sim = _sim(Residency(6, 6, 0, 4), graph=0.4)
    assert sim.recomputed == 0
    assert sim.bytes_jobs["graph_out"] == sim.bytes_jobs["graph_in"] == 4 * 2  # four layers, two micro-batches
    spans = {(lane, kind) for lane, kind, *_ in sim.spans if kind.startswith("graph")}
    assert spans == {("d2h", "graph-out"), ("h2d", "graph-in")}
    # each offloaded layer's copy back is issued one layer ahead (before the backward of the layer after it) and
    # its own backward starts only once the copy is done; the spans are in issue order
    for n, (_, kind, i, _, end) in enumerate(sim.spans):
        if kind != "graph-in":
            continue
        later = [(j, a) for ln, k, j, a, _ in sim.spans[n + 1:] if ln == "compute" and k == "bwd"]
        if i + 1 < 6:
            assert later[0][0] == i + 1, (i, later[:2])
        assert next(a for j, a in later if j == i) >= end
    kept_all = _sim(Residency(6, 6), graph=0.0)
    assert _sim(Residency(6, 6, 0, 4), graph=0.01).t == pytest.approx(kept_all.t)  # hidden under compute
    slow = _sim(Residency(6, 6, 0, 4), graph=5.0)  # a copy slower than the recompute it saves
    assert slow.t > _sim(Residency(6, 2), graph=0.0).t > kept_all.t


def test_a_point_replays_its_offloaded_graphs_at_the_links_rate():
    hw = get_hardware("gh200")
    p = make_point("qwen2.5-14b", 4096, 4, 1, "bfloat16", residency=Residency(24, 24, 2, 20), host_master="fp32")
    sim = simulate_step(p, layer_costs(p, hw, False), head=0.0, residency=p.residency)[0]
    out = [b - a for lane, kind, _, a, b in sim.spans if kind == "graph-out"]
    assert len(out) == 20 and out[0] == pytest.approx(graph_bytes(p) / hw.link_bps)
    assert sim.recomputed == 48 - 24


def test_the_memory_rows_hold_two_offloaded_graphs_on_the_device_and_all_of_them_on_the_host():
    hw = get_hardware("gh200")
    rows = {}
    for j in (0, 20):
        p = make_point("qwen2.5-14b", 4096, 4, 1, "bfloat16", residency=Residency(24, 24, 2, j), host_master="fp32")
        lc = long_context_plan(p, hw)
        rows[j] = (lc, megatrain_memory(p, hw, lc))
    g = rows[0][0].graph_bytes
    assert g == graph_bytes(make_point("qwen2.5-14b", 4096, 4, 1, "bfloat16", host_master="fp32"))
    assert rows[0][1].device["kept layers' forward graphs (residency)"] == 24 * g
    assert rows[20][1].device["kept layers' forward graphs (residency)"] == (24 - 20) * g
    assert rows[20][1].host["offloaded graphs (residency)"] == 20 * g and rows[0][1].host["offloaded graphs (residency)"] == 0
    assert rows[0][0].peak_bytes - rows[20][0].peak_bytes == 20 * g
    # the layer or loss working set is the same either way: the placement is not counted twice into it
    assert rows[0][1].device["working set (layer or loss)"] == rows[20][1].device["working set (layer or loss)"]


def _auto(hardware: str, **kw):
    return plan("qwen2.5-14b", 4096, 4, hardware=hardware, residency="auto", **kw)


def test_the_search_offloads_graphs_over_nvlink_c2c_but_not_over_pcie():
    c2c, pcie = _auto("gh200"), _auto("h200-pcie")
    assert c2c.placement.chosen.offload > 0, c2c.placement.chosen
    assert c2c.time.recomputed_layers == 48 - c2c.placement.chosen.activations
    tried = [r for r in pcie.placement.replayed if r.offload]
    assert tried, "offload counts are candidates over PCIe too"
    assert pcie.placement.chosen.offload == 0
    # each offloaded candidate over PCIe replays slower than the placement chosen
    assert all(pcie.placement.step_s[r] > pcie.placement.step_s[pcie.placement.chosen] for r in tried)
    # the engine's own "auto" never offloads
    assert c2c.placement.engine.offload == 0


def test_negative_control_a_copy_that_costs_nothing_would_offload_over_pcie_too(monkeypatch):
    monkeypatch.setattr(pipeline_sim, "graph_seconds", lambda p, costs: 0.0)
    assert _auto("h200-pcie").placement.chosen.offload > 0


def test_no_offload_where_host_memory_cannot_hold_the_graphs():
    lean = _auto("gh200", host_memory_gib=420)  # the rest of the host store fits; 20 graphs' 66 GiB do not
    assert lean.placement.chosen.offload * lean.long_context.graph_bytes <= lean.long_context.graph_host_room
    assert all(lean.long_context.fits(r) for r in lean.placement.replayed if r.offload)



def test_a_mixture_of_experts_with_its_router_loss_offloads_its_graphs_exactly():
    def run(residency):
        model = router_loss_moe()
        eng = Engine(model, EngineConfig(residency=residency, compute_dtype="float32", **LINK),
                     optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
        eng.reset_stats()
        losses = []
        for _ in range(STEPS):
            for b in make_batches(MICRO):
                out = eng(**b)
                eng.backward(out.loss)
                losses.append(out.loss.item())
            eng.step()
            eng.zero_grad()
        return losses, [v.clone() for v in eng.state_dict().values()], eng.collect_stats()

    kept, off = run({"weights": 3, "activations": 3}), run({"weights": 3, "activations": 3, "offload": 3})
    _same(off, kept)
    assert off[2]["offloaded_graph_layers"] == 3 and off[2]["recomputed_layers"] == 0


def test_plan_takes_the_settings_json_with_an_offload_count(capsys):
    setting = {"weights": 24, "activations": 24, "offload": 20, "optimizer": 2}
    assert plan_main(["--model", "qwen2.5-14b", "--hardware", "gh200", "--context", "4096", "--batch", "4",
                      "--no-search", "--compare", "", "--residency", json.dumps(setting), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["settings"]["residency"] == setting
    assert d["residency"]["recomputed_layers_per_step"] == 48 - 24
    with pytest.raises(SystemExit):
        plan_main(["--model", "tiny", "--residency", json.dumps({**setting, "offload": 30})])
    assert "offload=30 > activations=24" in capsys.readouterr().err
