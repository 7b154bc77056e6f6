"""Offloaded graphs (residency `offload`, engine/pipeline/saved_offload.py): a kept graph whose saved activations wait
for backward in host memory trains bit for bit as the graph kept on the device and as streaming with recompute (a
copy, not a recompute), moves exactly its saved activations' bytes each way, and holds less device memory.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_batches, tiny_model
from gpu_defaults import CONFIGS

from megatrain.config.schema import EngineConfig
from megatrain.costs.memory import LayerDims, LongContextPolicy, layer_graph_bytes
from megatrain.costs.residency import OFFLOADED_GRAPHS_IN_FLIGHT, Residency, parse
from megatrain.engine import Engine
from megatrain.engine.pipeline import saved_offload
from megatrain.engine.pipeline.schedule import LayerPipeline

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
    """Six graphs kept against two kept and four offloaded (two in flight): the measured peak drops by about two
    layers' graphs, and the plan predicts it."""
    batches = make_batches(1, batch=2, seq=96)
    kept = _train({"weights": DEEP, "activations": DEEP}, layers=DEEP, batches=batches, **PEAK)[2]
    off = _train({"weights": DEEP, "activations": DEEP, "offload": 4}, layers=DEEP, batches=batches, **PEAK)[2]
    graph = off["offloaded_graph_bytes"] / (4 * STEPS)  # one layer's saved activations, measured
    saved = kept["peak_device_bytes"] - off["peak_device_bytes"]
    assert saved >= 1.5 * graph, (saved / graph, kept["peak_device_bytes"], off["peak_device_bytes"])
    assert off["predicted_peak_device_bytes"] < kept["predicted_peak_device_bytes"]
    assert off["peak_device_bytes"] <= off["predicted_peak_device_bytes"]


def test_the_setting_reads_writes_and_refuses_as_documented():
    r = parse({"weights": 4, "activations": 3, "offload": 2})
    assert r == Residency(4, 3, 0, 2) and r.offloaded == frozenset({1, 2}) and r.graphs == frozenset({0, 1, 2})
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
        expect = (8 - j + min(j, OFFLOADED_GRAPHS_IN_FLIGHT)) * graph
        assert peak(Residency(8, 8, 0, j)) - peak(Residency(8, 0)) == expect
