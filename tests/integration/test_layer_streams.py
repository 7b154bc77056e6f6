"""Several residual streams as one hidden state: DeepSeek-V4 (`deepseek_v4`, hyper-connections, `hc_mult`).

DeepSeek-V4's layers pass `batch x seq x hc_mult x hidden` from one to the next (the embedding expanded into
hc_mult streams); the layer loop carries it as it carries any hidden state, and the tiled head keeps the stream
dims per token (engine/layer/loss.py). After the loop the model applies `norm(hc_head(h))`: its hyper-head mixes
the streams into one before the final norm. The compatibility table's mismatch (embedding gradient off by ~1
relative) is that the engine applied the final norm alone: the hyper-head got no gradient and the loss was another
one (measured: 5.549 against PyTorch's 5.570 on the model below), a wrong result of ours, not of the reference.
The structure detection (models/adapter.find_final_norm) finds the chain the model applies after its loop, the
hyper-head then the norm; the negative control hands the engine the norm alone.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from gpu_defaults import GPU_DEFAULTS
from kit import engine_factory

from megatrain.config import EngineConfig
from megatrain.engine import Engine
from megatrain.engine import engine as engine_module
from megatrain.engine.model import probe

RESIDENCY = [pytest.param("stream", id="streamed"), pytest.param({"weights": 2, "activations": 1}, id="kept")]


def dsv4(layers: int = 2) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(
        "deepseek_v4", hidden_size=64, moe_intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4,
        n_shared_experts=1, vocab_size=256, max_position_embeddings=512, hc_mult=2, sliding_window=8,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"] * (layers // 2),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, o_groups=2,
        o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4, num_nextn_predict_layers=0,
        mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1), qk_rope_head_dim=8, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _norm_alone(monkeypatch) -> None:
    """The engine's old structure: the final norm alone after the loop, the hyper-head left out."""
    real = engine_module.find_parts

    def find(model):
        parts = real(model)
        parts.norm = parts.base.norm
        return parts

    monkeypatch.setattr(engine_module, "find_parts", find)


@pytest.mark.parametrize("gpu_defaults", [pytest.param(False, id="fp32"),
                                          pytest.param(True, id="gpu-defaults", marks=pytest.mark.slow)])
@pytest.mark.parametrize("residency", RESIDENCY)
def test_deepseek_v4_streams_train_exact(residency, gpu_defaults):
    model, engines = dsv4(), []
    assert model.config.hc_mult == 2
    mode = EngineConfig(device="cpu", **GPU_DEFAULTS) if gpu_defaults else None
    extra = {"optimizer_overlap": True} if gpu_defaults else {}
    verdict = probe.run_probe(type(model), model.config, engine_factory(residency, engines, **extra), mode)
    assert verdict.status == "exact", verdict.detail
    assert not gpu_defaults or engines[-1]._layered is not None  # the overlapped update ran
    stats = engines[-1].pipeline.residency_stats()
    assert (stats["kept_graph_layers"] > 0) == (residency != "stream")


def test_the_tiled_head_keeps_the_streams_per_token():
    """The loss through the tiled head equals PyTorch's on the same weights, for tiles smaller than the sequence:
    tokens are tiled, never the streams within a token."""
    model = dsv4()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = model(input_ids=ids, labels=ids).loss.item()
    eng = Engine(model, EngineConfig(device="cpu", compute_dtype="float32", parity_probe=False, loss_chunk_tokens=5))
    got = eng(input_ids=ids, labels=ids)
    eng.backward(got.loss)
    assert abs(got.loss.item() - ref) <= 1e-5, (got.loss.item(), ref)


def test_negative_control_the_final_norm_alone_is_refused(monkeypatch):
    """The norm alone leaves hc_mult vectors per token for the head: the loss refuses it by name (it used to
    train on a wrong selection of them, a mismatch the probe caught)."""
    _norm_alone(monkeypatch)
    model = dsv4()
    verdict = probe.run_probe(type(model), model.config, engine_factory("stream", []))
    assert verdict.status == "refused" and "one per token" in verdict.detail, verdict.detail
