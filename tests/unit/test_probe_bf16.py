"""The probe proves what will train: bf16 compute against plain PyTorch's bf16 scheme, a shrink that never refuses
what plain transformers trains, and every random generator left as it was found."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import make_batches, tiny_model
from kit import assert_trains_like_sgd

from megatrain.config.schema import EngineConfig
from megatrain.engine import Engine
from megatrain.engine.layer import loss as loss_mod
from megatrain.engine.model import probe
from megatrain.models.lookup import resolve

BF16 = EngineConfig(device="cpu", compute_dtype="bfloat16")


@pytest.mark.parametrize("model_type", ["mamba", "xglm"])
def test_bf16_crash_families_train_exactly_in_bf16(model_type):
    """Mamba hands the head an FP32 hidden state (its residual is kept in FP32), XGLM's layer 0 an FP32 input (its
    sinusoidal positions are an FP32 buffer): both crashed the engine in bf16 ('expected m1 and m2 to have the
    same dtype', 'mixed dtype (CPU)')."""
    cls, cfg = resolve(model_type)
    verdict = probe.run_probe(cls, cfg, Engine, BF16)
    assert verdict.status == "exact", verdict.detail


def test_a_model_whose_own_code_mixes_fp32_buffers_is_refused_in_bf16_with_the_reason():
    cls, cfg = resolve("minimax")
    verdict = probe.run_probe(cls, cfg, Engine, BF16)
    assert verdict.status == "crashed"
    assert "bf16" in verdict.detail and "compute_dtype='float32'" in verdict.detail


def test_the_bf16_phase_catches_a_defect_only_bf16_has(monkeypatch):
    """Negative control: logits scaled wrongly only when the head computes in bf16. FP32 is exact; the bf16 phase
    refuses, naming the tolerance and the floor it came from."""
    real = loss_mod._logits

    def wrong_in_bf16(h, weight, bias, softcap):
        z = real(h, weight, bias, softcap)
        return z * 1.5 if weight.dtype == torch.bfloat16 else z

    monkeypatch.setattr(loss_mod, "_logits", wrong_in_bf16)
    model = tiny_model("llama")
    assert probe.run_probe(type(model), model.config, Engine).status == "exact"
    verdict = probe.run_probe(type(model), model.config, Engine, BF16)
    assert verdict.status == "mismatch", verdict
    assert "4 x the reference's bf16 floor: bf16 vs FP32 reference" in verdict.detail


def test_the_bf16_tolerance_is_the_references_own_floor():
    """The floor is measured: plain PyTorch's bf16 run against its FP32 run, nonzero and far below a defect."""
    model = tiny_model("llama")
    cfg = probe.tiny_config(model.config)
    master = probe._build(type(model), cfg, model.config).float()
    batches = probe._batches(probe.STEPS, cfg.vocab_size, probe._SEQ)
    make_opt = probe._optimizer(probe._Mode("bfloat16"), True)
    fp32 = probe.train_plain(master, batches, torch.float32, make_opt)
    grad, loss, how = probe.bf16_floor(master, batches, make_opt, fp32)
    assert 1e-3 < grad < 0.1 and 1e-5 < loss < 1e-2, how


def test_verify_model_probes_in_the_engines_compute_dtype(monkeypatch, tmp_path):
    """What the engine hands verify_model decides the phase: MiniMax is exact in FP32 and refused in bf16."""
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(probe, "_MEMO", {})
    cls, cfg = resolve("minimax")
    model = probe._build(cls, probe.tiny_config(cfg), cfg)
    assert probe.verify_model(model, Engine).exact
    with pytest.raises(probe.ModelMismatchError, match=r"MiniMaxForCausalLM \(crashed\).*compute_dtype='float32'"):
        probe.verify_model(model, Engine, BF16)


def test_the_engine_probes_in_its_own_compute_dtype(monkeypatch, tmp_path):
    """An engine built in bf16 refuses what only bf16 breaks; the same model in FP32 trains."""
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(probe, "_MEMO", {})
    cls, cfg = resolve("minimax")
    Engine(probe._build(cls, probe.tiny_config(cfg), cfg), EngineConfig(device="cpu"))
    with pytest.raises(probe.ModelMismatchError, match=r"compute_dtype='float32'"):
        Engine(probe._build(cls, probe.tiny_config(cfg), cfg), BF16)


def test_verdicts_are_cached_per_compute_dtype():
    model = tiny_model("llama")
    assert probe.cache_key(type(model), model.config, BF16) != probe.cache_key(type(model), model.config)
    fp32 = EngineConfig(device="cpu", compute_dtype="float32")
    assert probe.cache_key(type(model), model.config, fp32) == probe.cache_key(type(model), model.config)


# -- never refuse what plain transformers trains -----------------------------------------------------------------

def _deepseek_v3(**kw) -> transformers.DeepseekV3Config:
    """The reported model: 3 layers, hidden 64, MLA (q rank 24, kv rank 16, rope 8, nope 8, v 16), 4 routed experts
    + 1 shared, the first layer dense; 8 heads over 4 key/value heads. Plain transformers trains it only without
    padding, and the full shrink (4 heads over 2) not at all: the probe's "(4) must match (8)" refusal."""
    base = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, q_lora_rank=24,
                kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                n_shared_experts=1, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=4,
                num_experts_per_tok=1, n_group=1, topk_group=1, vocab_size=256)
    return transformers.DeepseekV3Config(**{**base, **kw})


def test_the_reported_deepseek_v3_trains_with_pytorchs_losses():
    cfg = _deepseek_v3()
    with pytest.raises(RuntimeError):  # the full shrink is what broke it ...
        tiny = probe.tiny_config(cfg)
        probe._build(transformers.DeepseekV3ForCausalLM, tiny, cfg)(**make_batches(1)[0]).loss.backward()
    torch.manual_seed(0)
    # unpadded: plain transformers trains it so (any mask breaks its GQA path)
    assert_trains_like_sgd(transformers.DeepseekV3ForCausalLM(cfg), EngineConfig(device="cpu"),
                           make_batches(3, pad=False), lr=0.05, tol=1e-5)


class _NeverTrains(transformers.LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        raise RuntimeError("this model fails in plain transformers at any size")


def test_what_plain_transformers_cannot_train_at_any_size_is_still_refused():
    verdict = probe.run_probe(_NeverTrains, tiny_model("llama").config, Engine)
    assert verdict.status == "crashed"
    for tried in ("the probe's shrunk config", "a less shrunk config", "cut to two layers", "unpadded batches"):
        assert tried in verdict.detail, tried


# -- the caller's random streams ---------------------------------------------------------------------------------

def test_the_probe_leaves_every_generator_as_it_found_it(monkeypatch):
    """torch.manual_seed inside fork_rng(devices=[]) reseeded every CUDA generator and never restored them. A
    CUDA seeding call is recorded (none may happen); the CPU generator's state must come back unchanged."""
    model = tiny_model("llama")
    calls = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(("all", seed)))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: calls.append(("one", seed)))
    torch.manual_seed(123)
    assert calls  # the control: torch.manual_seed does seed the CUDA generators
    calls.clear()
    before = torch.get_rng_state()
    assert probe.run_probe(type(model), model.config, Engine).status == "exact"
    assert torch.equal(torch.get_rng_state(), before)
    assert calls == [], calls
