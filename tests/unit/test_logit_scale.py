"""Scalar logit transforms in the chunked head: Cohere's logit_scale, Granite's logits_scaling (and the same
settings in the families that use them the other way round), trained exactly; a wrong factor is caught."""

from __future__ import annotations

import pytest
from conftest import make_batches
from kit import assert_trains_like_sgd

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.layer.loss import LogitTransform
from megatrain.engine.model import probe
from megatrain.models import adapter
from megatrain.models.lookup import resolve


def _small(model_type: str, **overrides):
    cls, cfg = resolve(model_type)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    tiny = probe.tiny_config(cfg)
    return probe._build(cls, tiny, cfg).float()


@pytest.mark.parametrize("model_type,setting", [("granitemoe", {"logits_scaling": 2.0}),
                                                ("cohere", {"logit_scale": 0.5})])
def test_scaled_logits_train_with_pytorchs_losses(model_type, setting):
    """Through the engine with the probe on (it refused both before): 3 SGD steps, PyTorch's losses."""
    assert_trains_like_sgd(_small(model_type, **setting), EngineConfig(device="cpu", loss_chunk_tokens=7),
                           make_batches(3), lr=0.05, tol=1e-5)


@pytest.mark.parametrize("model_type,setting", [("granitemoe", {"logits_scaling": 2.0}),
                                                ("cohere", {"logit_scale": 0.5})])
def test_scaled_logits_are_exact_in_bf16(model_type, setting):
    cls, cfg = resolve(model_type)
    for k, v in setting.items():
        setattr(cfg, k, v)
    verdict = probe.run_probe(cls, cfg, Engine, EngineConfig(device="cpu", compute_dtype="bfloat16"))
    assert verdict.status == "exact", verdict.detail


@pytest.mark.parametrize("model_type,setting,scale", [("granite", {"logits_scaling": 4.0}, 0.25),
                                                      ("hyperclovax", {"logits_scaling": 4.0}, 4.0),
                                                      ("cohere", {"logit_scale": 0.5}, 0.5)])
def test_the_direction_is_read_from_the_models_own_forward(model_type, setting, scale):
    """Granite divides by logits_scaling, HyperCLOVAX multiplies by it: the same setting, opposite factors."""
    parts = adapter.find_parts(_small(model_type, **setting))
    assert parts.softcap == LogitTransform(scale, None)


def test_the_probe_catches_a_wrong_factor(monkeypatch):
    """Negative control: the factor inverted (Granite's division taken for a product) is a mismatch."""
    real = adapter._logit_scale
    monkeypatch.setattr(adapter, "_logit_scale", lambda *a: 1.0 / real(*a))
    cls, cfg = resolve("granite")
    cfg.logits_scaling = 2.0
    verdict = probe.run_probe(cls, cfg, Engine)
    assert verdict.status == "mismatch", verdict


def test_a_scale_applied_some_other_way_is_refused(monkeypatch):
    monkeypatch.setattr(adapter, "_forward_source", lambda model: "logits = logits + self.config.logits_scaling")
    with pytest.raises(ValueError, match="applies `logits_scaling` to its logits in a way the chunked head"):
        adapter.find_parts(_small("granite", logits_scaling=2.0))
