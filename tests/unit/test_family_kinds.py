"""Families the compatibility table calls exact stay exact, in FP32 and in the GPU's defaults (tests/gpu_defaults.py),
through the engine users run: the two regressions issue 57 found (Llama 4's MoE writing into a linear's output in
place; a small DeepSeek-V4 whose layers are all hash-routed, which the probe's reference could not train), and
one family per structural kind, so an engine change cannot silently break a kind the table calls exact."""

from __future__ import annotations

import pytest
import torch
from gpu_defaults import FP32, GPU_DEFAULTS
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from experiments.studies.compat import _overrides
from experiments.studies.compat_configs import study_config
from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.model import probe
from megatrain.engine.model.probe_shrink import _build, tiny_config

MODES = [pytest.param(FP32, id="fp32"), pytest.param(GPU_DEFAULTS, id="gpu-defaults")]


def _verdict(model_cls: type, config, mode: dict) -> probe.Verdict:
    return probe.run_probe(model_cls, config, Engine, EngineConfig(device="cpu", **mode))


def _study(model_type: str):
    model_cls, config, _ = study_config(model_type)
    for k, v in _overrides(model_type).items():
        setattr(config, k, v)
    return model_cls, config


def _small_deepseek_v4() -> DeepseekV4Config:
    """A valid config plain transformers trains: 3 layers (all hash-routed), 2 hyper-connection streams."""
    return DeepseekV4Config(num_hidden_layers=3, hc_mult=2, sliding_window=8, index_topk=8)


@pytest.mark.parametrize("mode", MODES)
def test_llama4_text_is_exact(mode):
    v = _verdict(*_study("llama4_text"), mode)
    assert v.status == "exact", v.detail


@pytest.mark.parametrize("mode", MODES)
def test_a_small_deepseek_v4_with_every_layer_hash_routed_is_exact(mode):
    v = _verdict(DeepseekV4ForCausalLM, _small_deepseek_v4(), mode)
    assert v.status == "exact", v.detail


def test_the_router_loss_stays_on_where_plain_transformers_trains_it():
    """The probe measures the router's gradient through the router loss; it takes the user's setting only where
    the model fails with the loss on. DeepSeek-V4's default (hash-routed and top-k layers) trains with it on."""
    default = DeepseekV4Config()
    model = _build(DeepseekV4ForCausalLM, tiny_config(default), default)
    assert model.config.output_router_logits is True
    small = _small_deepseek_v4()
    model = _build(DeepseekV4ForCausalLM, tiny_config(small), small)
    assert model.config.output_router_logits is False  # every shrunk layer hash-routed: no router logits exist
    ids = torch.arange(3, 11).view(1, -1)
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


# One family per structural kind, each exact in the table at the commit it names.
KINDS = {
    "moe": "qwen3_moe",
    "hybrid": "lfm2",  # short convolutions and attention layers
    "mla": "deepseek_v3",  # multi-head latent attention
    "per-layer-inputs": "gemma4_text",
    "hyper-connections": "deepseek_v4",
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_one_family_per_structural_kind_is_exact(kind, mode):
    v = _verdict(*_study(KINDS[kind]), mode)
    assert v.status == "exact", f"{KINDS[kind]}: {v.detail}"
