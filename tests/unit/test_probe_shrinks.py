"""The probe never refuses a model plain PyTorch trains: a shrink that breaks plain transformers is followed by a
lesser one, up to the user's own config cut to two layers; only the user's own shapes are refused."""

from __future__ import annotations

import pytest
from conftest import tiny_model

from megatrain.engine import Engine
from megatrain.engine.model import probe


def _broken(shrink):
    """`shrink`, then key/value heads that do not divide the heads: builds, and fails in plain transformers' forward
    (the kind of config a shrink can make of a model whose widths it does not understand)."""
    calls = []

    def broken(config):
        cfg = shrink(config)
        cfg.num_key_value_heads = 3
        calls.append(cfg)
        return cfg

    return broken, calls


def _config():
    return tiny_model("llama", hidden=64, heads=4, kv_heads=2).config


def test_the_broken_shrink_fails_in_plain_transformers():
    """The controlled failure is real: plain PyTorch cannot train the broken shrink."""
    broken, _ = _broken(probe.tiny_config)
    cfg = _config()
    master = probe._build(type(tiny_model("llama")), broken(cfg), cfg)
    with pytest.raises(RuntimeError):
        probe.train_plain(master, probe._batches(1, 256, 24), probe.torch.float32, probe._optimizer(probe._Mode(), False))


def test_a_shrink_plain_transformers_cannot_train_is_followed_by_a_lesser_one(monkeypatch):
    broken, calls = _broken(probe.tiny_config)
    monkeypatch.setattr(probe, "tiny_config", broken)
    model = tiny_model("llama", hidden=64, heads=4, kv_heads=2)
    v = probe.run_probe(type(model), model.config, Engine)
    assert calls, "the broken shrink was never tried"
    assert v.status == "exact", v.detail


def test_up_to_the_users_own_config_cut_to_two_layers(monkeypatch):
    for name in ("tiny_config", "less_shrunk_config"):
        monkeypatch.setattr(probe, name, _broken(getattr(probe, name))[0])
    model = tiny_model("llama", layers=3, hidden=64, heads=4, kv_heads=2)
    v = probe.run_probe(type(model), model.config, Engine)
    assert v.status == "exact", v.detail


def test_negative_control_refused_only_when_the_users_own_shapes_fail(monkeypatch):
    for name in ("tiny_config", "less_shrunk_config", "two_layer_config"):
        monkeypatch.setattr(probe, name, _broken(getattr(probe, name))[0])
    model = tiny_model("llama", hidden=64, heads=4, kv_heads=2)
    v = probe.run_probe(type(model), model.config, Engine)
    assert v.status == "crashed"
    assert "plain transformers fails" in v.detail and "at every size the probe tries" in v.detail
    assert "the user's config cut to two layers" in v.detail
