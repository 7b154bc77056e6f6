"""The final norm is found by what the decoder stack does (the module it applies after its layer loop), not by its
name: LFM2's `embedding_norm`, DeepSeek-V4's hyper-connection head then norm; clear refusals otherwise."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from megatrain.models import adapter
from megatrain.models.adapter import FinalChain, find_parts

LFM2 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, layer_types=["conv", "full_attention", "conv", "full_attention"])
LFM2_MOE = dict(LFM2, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_dense_layers=1)


def _model(model_type: str, meta: bool = False, **kw) -> nn.Module:
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("meta", [False, True])
def test_lfm2s_final_norm_is_found_by_what_runs_after_the_layers(meta):
    model = _model("lfm2", meta=meta, **LFM2)
    parts = find_parts(model)
    assert parts.norm is model.model.embedding_norm  # not among any list of norm names
    # The trace leaves the model as it was: its layers, training flags, weights' device.
    assert model.model.layers is parts.layers and all(isinstance(m, type(parts.layers[0])) for m in parts.layers[:1])
    assert model.training and all(p.is_meta == meta for p in model.parameters())


def test_the_trace_draws_nothing_from_the_random_stream():
    model = _model("lfm2", **LFM2)
    torch.manual_seed(3)
    find_parts(model)
    after = torch.rand(3)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(3))


def test_deepseek_v4s_hyper_connection_head_and_norm_are_one_chain():
    cfg = transformers.AutoConfig.for_model("deepseek_v4")
    model_cls = transformers.AutoModelForCausalLM._model_mapping[type(cfg)]
    from megatrain.engine.model import probe

    model = probe._instantiate(model_cls, probe.tiny_config(cfg), meta=True)
    norm = find_parts(model).norm
    assert isinstance(norm, FinalChain)
    assert list(norm.chain) == [model.model.hc_head, model.model.norm]


class _Stack(nn.Module):
    """A minimal decoder stack whose post-loop math the tests choose."""

    def __init__(self, after: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.norm = nn.LayerNorm(8)
        self.gate = nn.Linear(8, 8)
        self.after = after

    def forward(self, input_ids=None, inputs_embeds=None, **kw):
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        first = h
        for layer in self.layers:
            h = layer(h)
        if self.after == "none":
            return h
        if self.after == "mixed":
            return self.norm(h + self.gate(first))  # the norm takes more than the last layer's output
        return self.norm(h)


class _LM(nn.Module):
    def __init__(self, after: str) -> None:
        super().__init__()
        self.config = transformers.PretrainedConfig(num_hidden_layers=2)
        self.model = _Stack(after)
        self.lm_head = nn.Linear(8, 16)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head


def test_the_toy_stack_with_a_norm_after_its_layers_is_taken():
    lm = _LM("norm")
    assert find_parts(lm).norm is lm.model.norm


@pytest.mark.parametrize("after, says", [
    ("none", "applies no module after its decoder layers"),
    ("mixed", "takes more than the previous one's output"),
])
def test_a_stack_without_one_final_module_is_refused_by_what_it_applies(after, says):
    with pytest.raises(ValueError, match="no final norm found") as e:
        find_parts(_LM(after))
    assert says in str(e.value)


def _verdict(model_type: str, kw: dict):
    """The parity probe on this config (FP32: first-step gradients within 1e-5, 3 SGD steps' losses within 1e-5 of
    plain PyTorch's; docs/COMPATIBILITY.md), run now rather than read from a cache."""
    from megatrain.config import EngineConfig  # noqa: F401 - check_config builds it
    from megatrain.engine import check_config

    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    return check_config(transformers.AutoModelForCausalLM._model_mapping[type(cfg)], cfg)


@pytest.mark.slow
@pytest.mark.parametrize("model_type, kw", [("lfm2", LFM2), ("lfm2_moe", LFM2_MOE)])
def test_lfm2_trains_exact_in_fp32(model_type, kw):
    """Refused before ("no final norm found": its norm is `embedding_norm`); now exact against plain PyTorch."""
    v = _verdict(model_type, kw)
    assert v.status == "exact", v.detail
    assert v.max_grad_rel <= 1e-5 and v.max_loss_diff <= 1e-5


def test_negative_control_lfm2_without_its_final_norm_is_a_mismatch(monkeypatch):
    """The check above can fail: an engine that applies no final norm is caught."""
    monkeypatch.setattr(adapter, "find_final_norm", lambda *a: nn.Identity())
    v = _verdict("lfm2", LFM2)
    assert v.status == "mismatch", v.detail
