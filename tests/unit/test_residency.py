"""Residency (costs/residency.py): layers kept on the device train bit for bit as streamed ones, with fewer
copies and no recompute, as many as the plan says.

Kept weights are the same values read from another buffer; a kept graph is the recompute's own call made once,
in the forward: the same ops in the same order. So every comparison here is exact (torch.equal), in FP32 and in
the GPU's defaults (bf16 compute, hilo masters, the update overlapped with the next forward), on a dense model,
a mixture of experts with its router loss, and a model with dropout.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_batches, tiny_model
from gpu_defaults import CONFIGS
from kit import router_loss_moe

from megatrain.config.schema import EngineConfig
from megatrain.costs import pipeline as order
from megatrain.costs.memory import layer_graph_bytes
from megatrain.costs.residency import Residency, parse
from megatrain.engine import Engine
from megatrain.engine.layer.tiling import layer_dims

STEPS, MICRO = 3, 2
LAYERS = 4
SETTINGS = ["stream", {"weights": 2, "activations": 1}, {"weights": LAYERS, "activations": 0}, "auto"]


def _train(model: torch.nn.Module, residency, batches=None, **cfg) -> tuple[list[float], list[torch.Tensor], dict]:
    eng = Engine(model, EngineConfig(residency=residency, **cfg),
                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    losses = []
    batches = batches or make_batches(MICRO)
    eng.reset_stats()
    for _ in range(STEPS):
        for b in batches:
            out = eng(**b)
            eng.backward(out.loss)
            losses.append(out.loss.item())
        eng.clip_grad_norm_(0.5)
        eng.step()
        eng.zero_grad()
    stats = eng.collect_stats()
    masters = [v.clone() for v in eng.state_dict().values()]
    return losses, masters, stats


def _same(a, b) -> None:
    assert a[0] == b[0], (a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


# A CPU device with no emulation keeps a layer by aliasing its host stream source; an emulated link (as a GPU)
# copies it into a buffer of its own once per step. Both are checked.
COPIES = [pytest.param({}, id="aliased"), pytest.param({"link_gbps": 100.0}, id="copied")]


@pytest.mark.parametrize("copies", COPIES)
@pytest.mark.parametrize("mode", CONFIGS)
def test_kept_weights_and_graphs_train_bit_for_bit_as_streaming(mode, copies):
    runs = {str(s): _train(tiny_model("llama", layers=LAYERS), s, **mode, **copies) for s in SETTINGS}
    ref = runs["stream"]
    assert ref[2]["recomputed_layers"] == LAYERS * MICRO * STEPS and ref[2]["resident_weight_layers"] == 0
    for s in SETTINGS[1:]:
        _same(runs[str(s)], ref)
    # "auto" with no device budget on the CPU keeps every layer and every graph: nothing recomputed
    auto = runs["auto"][2]
    assert auto["resident_weight_layers"] == LAYERS and auto["kept_graph_layers"] == LAYERS
    assert auto["recomputed_layers"] == 0
    assert auto["h2d_bytes"] < ref[2]["h2d_bytes"]


def test_negative_control_kept_weights_not_copied_after_a_step_are_caught(monkeypatch):
    """The comparison above can fail: kept layers whose copies survive the optimizer step (stale weights) train
    differently from streaming."""
    def invalidate_ring_only(self):
        self.resident = [None] * self.k + self.resident[self.k:]

    copied = {"compute_dtype": "float32", "link_gbps": 100.0}  # kept layers copied, as on a GPU
    ref = _train(tiny_model("llama", layers=LAYERS), "stream", **copied)
    monkeypatch.setattr(order.DeviceBuffers, "invalidate", invalidate_ring_only)
    broken = _train(tiny_model("llama", layers=LAYERS), {"weights": LAYERS, "activations": LAYERS}, **copied)  # copied: no optimizer residency
    with pytest.raises(AssertionError):
        _same(broken, ref)



def test_a_mixture_of_experts_with_its_router_loss_keeps_its_graphs_exactly():
    ref = _train(router_loss_moe(), "stream", compute_dtype="float32")
    kept = _train(router_loss_moe(), {"weights": 3, "activations": 2}, compute_dtype="float32")
    _same(kept, ref)
    assert kept[2]["kept_graph_layers"] == 2 and kept[2]["recomputed_layers"] == 1 * MICRO * STEPS


def test_dropout_draws_the_same_numbers_kept_or_recomputed():
    def model():
        return tiny_model("llama", layers=LAYERS, attention_dropout=0.3)

    torch.manual_seed(5)
    ref = _train(model(), "stream", compute_dtype="float32")
    torch.manual_seed(5)
    kept = _train(model(), "auto", compute_dtype="float32")
    _same(kept, ref)
    assert kept[2]["recomputed_layers"] == 0


def _loads_by_order(n_layers: int, k: int, r: Residency, micro: int, steps: int) -> tuple[list[int], int]:
    """(layers copied, layers recomputed) over `steps` steps as costs/pipeline.py defines the order."""
    buffers = order.DeviceBuffers(k, r.kept)
    loads, recomputed = [], 0
    for _ in range(steps):
        for _ in range(micro):
            for phase in (order.forward_steps, order.backward_steps):
                for s in phase(buffers, n_layers, r.graphs):
                    loads += [s.layer] if s.op == order.LOAD else []
                    recomputed += s.op == order.BACKWARD
        buffers.invalidate()
    return loads, recomputed


@pytest.mark.parametrize("share", [None, 0.6, 0.0])
def test_copies_and_recomputes_under_a_device_budget_are_the_orders(share):
    """The device-budget emulation: all fits, about half, nothing beyond the ring. The engine's copied bytes and
    recomputed layers per step are exactly what the issue order gives for the residency it planned."""
    model = tiny_model("llama", layers=LAYERS)
    probe = Engine(tiny_model("llama", layers=LAYERS), EngineConfig(residency="stream", compute_dtype="float32"))
    probe(**make_batches(1)[0])
    base = probe.pipeline.last_plan.predicted_peak_bytes
    layer_bytes = probe.store.layers[0].numel * 4
    graph = layer_graph_bytes(probe.pipeline.policy.dims, 2 * 24, 4)
    whole = base + LAYERS * (layer_bytes + graph)
    budget = None if share is None else int((base + share * LAYERS * layer_bytes) / 0.9) + 1
    cfg = {"compute_dtype": "float32", "device_budget_bytes": budget, "link_gbps": 100.0}  # copies, as a GPU
    if budget is not None:
        assert budget < whole / 0.9
    _, _, st = _train(model, "auto", **cfg)
    r = Residency(int(st["resident_weight_layers"]), int(st["kept_graph_layers"]))
    expect = {None: (LAYERS, LAYERS), 0.6: (2, 0), 0.0: (0, 0)}[share]
    assert (r.weights, r.activations) == expect
    loads, recomputed = _loads_by_order(LAYERS, 2, r, MICRO, STEPS)
    assert st["h2d_bytes"] == len(loads) * layer_bytes
    assert st["recomputed_layers"] == recomputed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_graph_bytes_model_matches_what_autograd_saves(dtype):
    """layer_graph_bytes (the plan's per-layer cost of a kept graph) against the saved tensors of a Llama layer's
    forward, FP32 and bf16, within 5%."""
    model = tiny_model("llama", layers=1, hidden=128).to(dtype)
    layer = model.model.layers[0]
    tokens = 256
    x = torch.randn(1, tokens, 128, dtype=dtype, requires_grad=True)
    pos = torch.arange(tokens).unsqueeze(0)
    pe = model.model.rotary_emb(x, pos)
    own = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in own:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, position_embeddings=pe, position_ids=pos)
    numel = sum(p.numel() for p in layer.parameters())
    predicted = layer_graph_bytes(layer_dims(layer, numel, 128), tokens, x.element_size())
    assert abs(predicted / sum(saved.values()) - 1) < 0.05, (dtype, predicted, sum(saved.values()))


def test_eval_and_generate_run_from_kept_weights():
    b = make_batches(1)[0]

    def logits_after_a_step(residency) -> torch.Tensor:
        eng = Engine(tiny_model("llama", layers=LAYERS), EngineConfig(residency=residency, compute_dtype="float32"))
        eng.backward(eng(**b).loss)
        eng.step()
        eng.zero_grad()
        eng.eval()
        with torch.no_grad():
            return eng(input_ids=b["input_ids"], attention_mask=b["attention_mask"], return_logits=True).logits

    assert torch.equal(logits_after_a_step("auto"), logits_after_a_step("stream"))


@pytest.mark.parametrize("bad,why", [
    ("all", "is not a residency"), ({"weights": -1}, "must be an int >= 0"),
    ({"weights": 1, "activations": 2}, "activations=2 > weights=1"), ({"layers": 2}, "give {'weights'"),
    ({"weights": True}, "must be an int"),
])
def test_a_bad_residency_is_refused_with_the_fix(bad, why):
    with pytest.raises(ValueError, match=why.replace("{", r"\{").replace("(", r"\(")):
        EngineConfig(residency=bad)


def test_the_setting_keeps_what_the_user_wrote():
    c = EngineConfig(residency="stream")
    assert c.residency == Residency(0, 0) and c.written["residency"] == "stream"
    assert parse({"weights": 3}) == Residency(3, 0)
    assert EngineConfig.from_dict(EngineConfig(residency={"weights": 2, "activations": 1}).to_dict()).residency == \
        Residency(2, 1)


def test_the_engine_copies_and_recomputes_what_the_planner_predicts_at_three_budgets():
    """The device-budget emulation through experiments/studies/residency_budget.py on a 4-layer model: at the
    whole-resident budget, ~60% of it, and the streaming plan's own budget, the engine's host->device bytes and
    recomputed layers per step equal the planner's replay of the engine's fill, and its losses equal streaming's."""
    from experiments.studies import residency_budget as study

    preset, seq, batch, steps = "small-7m", 64, 2, 2
    whole, streaming = study.whole_resident_budget(preset, seq, batch)
    ref, _ = study._train(preset, seq, batch, steps, residency="stream")
    kept = []
    for share in (1.0, 0.6, 0.0):
        budget = int(streaming + share * (whole - streaming))
        losses, st = study._train(preset, seq, batch, steps, device_budget_bytes=budget)
        pl = study.plan(preset, seq, batch, dtype="float32", hardware="cpu",
                        engine_config=EngineConfig(device="cpu", compute_dtype="float32", device_budget_bytes=budget))
        fill = pl.placement.engine
        _, h2d, recomputed = pl.placement.replayed[fill]
        assert (fill.weights, fill.activations) == (st["resident_weight_layers"], st["kept_graph_layers"])
        assert st["h2d_bytes"] / steps == h2d and st["recomputed_layers"] / steps == recomputed
        assert losses == ref
        kept.append((fill.weights, fill.activations))
    assert kept[0] == (4, 4) and kept[-1] == (0, 0) and kept[1] not in (kept[0], kept[-1]), kept
