"""Layers that hand state to the next one: GLM-5 (`glm_moe_dsa`, DeepSeek sparse attention) and Zaya.

A GLM-5 layer with its own indexer ("full") selects the top-k keys each query attends to and returns those indices
beside its hidden state; a "shared" layer reuses the previous layer's. The model's loop takes both back from each
layer, so the recording hands it a stand-in for the indices (models/adapter.py: HandedState), and the engine puts
the forward's real indices in the stand-in's place as the layers run, so the recompute replays them
(engine/layer/handed_state.py). A Zaya layer hands the next its router's hidden states, a floating-point state with
a gradient: it is carried with the hidden state, packed into one tensor between the two layers. Compared with plain
PyTorch the probe's way (engine/model/probe.py tolerances), on
the streaming path and with kept layers, and in the GPU's defaults against the mixed-precision reference.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from kit import engine_factory, kept_graphs

from megatrain.config import EngineConfig
from megatrain.engine.layer import handed_state
from megatrain.engine.model import probe
from megatrain.models import adapter

RESIDENCY = [pytest.param("stream", id="streamed"), pytest.param({"weights": 4, "activations": 1}, id="kept")]


def glm5(layers: int = 4) -> torch.nn.Module:
    """Indexers that select 8 of up to 24 keys, every other layer reusing the previous layer's selection."""
    cfg = transformers.AutoConfig.for_model(
        "glm_moe_dsa", hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=256, max_position_embeddings=512,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8, index_topk=8,
        index_head_dim=16, index_n_heads=2, first_k_dense_replace=1, tie_word_embeddings=False,
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), layer_types=["indexed_attention"] * layers,
        indexer_types=["full", "shared"] * (layers // 2))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def zaya(layers: int = 3) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(
        "zaya", hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=256, max_position_embeddings=512, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=1,
        router_hidden_size=16, tie_word_embeddings=False, layer_types=["hybrid"] * layers)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("residency", RESIDENCY)
def test_glm5_trains_exact_in_fp32(residency, monkeypatch):
    replayed = []
    real = handed_state.HandedStates._value

    def spy(self, i, v):
        out = real(self, i, v)
        if isinstance(v, adapter.HandedState):
            replayed.append((v.layer, i, out.dtype))
        return out

    monkeypatch.setattr(handed_state.HandedStates, "_value", spy)
    model, engines = glm5(), []
    verdict = probe.run_probe(type(model), model.config, engine_factory(residency, engines))
    assert verdict.status == "exact", verdict.detail
    assert verdict.max_grad_rel <= probe.GRAD_RTOL and verdict.max_loss_diff <= probe.LOSS_ATOL
    assert (kept_graphs(engines) > 0) == (residency != "stream")
    # The mechanism ran: layer 1 (shared) took layer 0's indices, integers.
    assert replayed and all(src == 0 and dst == 1 and not dt.is_floating_point for src, dst, dt in replayed)


def test_without_stand_ins_the_old_refusal_names_the_handed_state(monkeypatch):
    """Negative control: a recording that hands the loop the hidden state alone (as before) is refused by name."""
    monkeypatch.setattr(adapter, "_MAX_OUTPUTS", 1)
    model = glm5()
    verdict = probe.run_probe(type(model), model.config, engine_factory("stream"))
    assert verdict.status == "refused", verdict
    assert "takes more than the hidden state back from decoder layer 0" in verdict.detail


def test_other_indices_replayed_are_a_mismatch(monkeypatch):
    """Negative control: the shared layer given indices other than its predecessor's (shifted by one query): the
    comparison finds it, so the indices the engine replays are what the result depends on."""
    real = handed_state.HandedStates._value

    def shifted(self, i, v):
        out = real(self, i, v)
        return out.roll(1, dims=1) if isinstance(v, adapter.HandedState) else out

    monkeypatch.setattr(handed_state.HandedStates, "_value", shifted)
    model = glm5()
    verdict = probe.run_probe(type(model), model.config, engine_factory("stream"))
    assert verdict.status == "mismatch", verdict


@pytest.mark.parametrize("residency", [pytest.param("stream", id="streamed"),
                                       pytest.param({"weights": 3, "activations": 1}, id="kept")])
def test_zaya_carries_its_router_states_exact_in_fp32(residency, monkeypatch):
    carried = []
    real = handed_state.HandedStates.unpack

    def spy(self, i, x, inputs):
        if i in self.carried:
            carried.append((i, x.shape[-1]))
        return real(self, i, x, inputs)

    monkeypatch.setattr(handed_state.HandedStates, "unpack", spy)
    model, engines = zaya(), []
    verdict = probe.run_probe(type(model), model.config, engine_factory(residency, engines))
    assert verdict.status == "exact", verdict.detail
    assert (kept_graphs(engines) > 0) == (residency != "stream")
    # Layer 1 took the hidden state (64) and layer 0's router states (16) as one carried tensor.
    assert (1, 64 + 16) in carried


def test_a_carried_state_without_its_gradient_is_a_mismatch(monkeypatch):
    """Negative control: the router states handed on without their gradient (replayed, as indices are): the
    earlier layer's router weights miss what the later layer sends back."""
    real = handed_state.HandedStates.unpack

    def detached(self, i, x, inputs):
        h, (args, kwargs) = real(self, i, x, inputs)
        return h, (tuple(a.detach() if torch.is_tensor(a) else a for a in args), kwargs)

    monkeypatch.setattr(handed_state.HandedStates, "unpack", detached)
    model = zaya()
    verdict = probe.run_probe(type(model), model.config, engine_factory("stream", []))
    assert verdict.status == "mismatch", verdict


@pytest.mark.slow
def test_zaya_in_the_gpu_defaults():
    """bf16 compute (its residual stream stays FP32, its router states bf16: packed in FP32, exact both ways), hilo,
    optimizer overlap, within the probe's bf16 tolerance."""
    from gpu_defaults import GPU_DEFAULTS

    model, engines = zaya(), []
    gpu = EngineConfig(device="cpu", **GPU_DEFAULTS)
    verdict = probe.run_probe(type(model), model.config, engine_factory("stream", engines, optimizer_overlap=True), gpu)
    assert verdict.status == "exact", verdict.detail


def test_floating_point_state_is_refused_by_name():
    """State that would carry a gradient from layer to layer is not replayed: a clear refusal, not a wrong gradient."""
    states = handed_state.HandedStates([((), {}), ((), {"prev": adapter.HandedState(0, 1)})])
    states.keep(0, (torch.zeros(2, 3),))
    with pytest.raises(ValueError, match="layer 0 hands layer 1 a floating-point state"):
        states.resolve(1, ((), {"prev": adapter.HandedState(0, 1)}))


@pytest.mark.parametrize("residency", RESIDENCY)
def test_glm5_in_the_gpu_defaults_within_the_bf16_floor(residency):
    """bf16 compute, hilo, optimizer overlap against plain PyTorch's same mixed-precision scheme, within the probe's
    bf16 tolerance (its reference's own floor). GLM-5's attention is eager only: tests/gpu_defaults.py's floor (sdpa's
    two CPU kernels) does not exist for it, as for GPT-OSS in test_moe.py."""
    from gpu_defaults import GPU_DEFAULTS

    model, engines = glm5(), []
    gpu = EngineConfig(device="cpu", **GPU_DEFAULTS)
    verdict = probe.run_probe(type(model), model.config, engine_factory(residency, engines, optimizer_overlap=True), gpu)
    assert verdict.status == "exact", verdict.detail
    assert engines[-1].config.compute_dtype == "bfloat16" and engines[-1]._layered is not None  # overlap ran
