"""Layers that take more than the hidden state: side inputs with gradients (Gemma 4's per-layer input embeddings).

Gemma 4 (`gemma4_text` with hidden_size_per_layer_input > 0, as Gemma 3n) computes a per-layer input for every
decoder layer from a per-layer embedding table and a projection of the input embedding, both trained. The engine
records them with their graph, hands each layer a leaf, sums each leaf's gradient from the layer's backward and
sends it back through the recorded graph (engine/layer/side_inputs.py). Compared with plain PyTorch the probe's
way (tolerances from engine/model/probe.py): plain SGD, whose update is linear in the gradient, because this
model is chaotic under Adam in FP32: plain PyTorch against itself with only sdpa's CPU kernel changed (flash vs
math) differs by 3e-5 in its first-step gradients and by 4.5e-3 in the 12th micro-batch's loss (AdamW, lr 1e-3,
measured here), so the dense parity tests' 12-micro-batch AdamW comparison cannot separate anything on it. The
GPU's defaults are held to the mixed-precision reference's own floor (tests/gpu_defaults.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from kit import engine_factory, kept_graphs

from megatrain.config import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.layer.side_inputs import SideInputs
from megatrain.engine.model import probe

# The streaming path; and a mix where layer 0 keeps its forward graph (no recompute) and the rest keep their weights.
RESIDENCY = [pytest.param("stream", id="streamed"), pytest.param({"weights": 3, "activations": 1}, id="kept")]


def gemma4(layers: int = 3) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(
        "gemma4_text", hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=8, num_kv_shared_layers=0, max_position_embeddings=512, sliding_window=8,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"], tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("residency", RESIDENCY)
def test_gemma4_per_layer_inputs_train_exact_in_fp32(residency):
    model, engines = gemma4(), []
    assert model.config.hidden_size_per_layer_input > 0
    verdict = probe.run_probe(type(model), model.config, engine_factory(residency, engines))
    assert verdict.status == "exact", verdict.detail
    assert verdict.max_grad_rel <= probe.GRAD_RTOL and verdict.max_loss_diff <= probe.LOSS_ATOL
    assert (kept_graphs(engines) > 0) == (residency != "stream")


def test_every_layer_takes_its_per_layer_input_as_a_side_input():
    """The mechanism is what runs: each layer's per-layer input comes back with a graph to the trained producer."""
    model = gemma4()
    eng = Engine(model, EngineConfig(device="cpu", compute_dtype="float32", parity_probe=False))
    seen = []
    real = SideInputs.__init__

    def spy(self, per_layer):
        real(self, per_layer)
        seen.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SideInputs, "__init__", spy)
        ids = torch.randint(0, 256, (2, 12))
        eng.backward(eng(input_ids=ids, labels=ids).loss)
    side = seen[-1]
    assert all(side.of_layer(i) for i in range(3)) and len(side.roots) == 3
    table = model.model.embed_tokens_per_layer.weight
    assert table.grad is not None and table.grad.abs().sum() > 0


def test_a_lost_side_input_gradient_is_a_mismatch(monkeypatch):
    """Negative control: the layers' per-layer-input gradients never reach their producer (what the engine would
    compute had it not refused such models before): the probe finds it."""
    monkeypatch.setattr(SideInputs, "add_grads", lambda self, i, grads: None)
    model = gemma4()
    verdict = probe.run_probe(type(model), model.config, engine_factory("stream"))
    assert verdict.status == "mismatch", verdict
    assert verdict.max_grad_rel > 1e-2, verdict  # first named: the input embedding, which the projection feeds too


@pytest.mark.slow
@pytest.mark.parametrize("residency", RESIDENCY)
def test_gemma4_in_the_gpu_defaults_within_the_bf16_floor(residency):
    """bf16 compute, optimizer overlap, hilo (tests/gpu_defaults.py) against plain PyTorch's same scheme."""
    from conftest import make_batches
    from gpu_defaults import GPU_DEFAULTS, bf16_reference, lag_updates, train

    lr, wd, clip, accum, steps = 1e-3, 0.01, 0.5, 2, 3
    model, batches = gemma4(), make_batches(steps * accum)
    floor = bf16_reference(model, batches, steps, accum, clip,
                           optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd, fused=True))
    eng = lag_updates(Engine(copy.deepcopy(model), EngineConfig(residency=residency, **GPU_DEFAULTS),
                             optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=lr, weight_decay=wd)))
    floor.check(train(eng, batches, steps, accum, clip), eng.state_dict())
