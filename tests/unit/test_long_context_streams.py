"""Two shape readers that must not surprise their callers: the engine's layer dims count hyper-connection streams as
the planner does (engine/layer/tiling.py layer_dims, costs/memory.py residual_streams), and the planner's meta build
leaves the caller's config as it was (planner/meta_shapes.py build_on_meta)."""

from __future__ import annotations

import torch
import transformers
from conftest import tiny_model
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from megatrain.costs.memory import boundary_bytes, residual_streams
from megatrain.engine.layer.tiling import layer_dims, layer_streams
from megatrain.planner.meta_shapes import build_on_meta


def _small_v4() -> DeepseekV4Config:
    return DeepseekV4Config(num_hidden_layers=2, hc_mult=2, hidden_size=64, vocab_size=256, num_attention_heads=4,
                            q_lora_rank=32, o_lora_rank=32, head_dim=32, qk_rope_head_dim=16, index_head_dim=16,
                            index_n_heads=2, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2)


def small_v4_layer_input(tokens: int = 8) -> tuple[DeepseekV4Config, DeepseekV4ForCausalLM, torch.Size]:
    """A small DeepSeek-V4 (hyper-connections: hc_mult 2), and its layer 1's input shape measured on `tokens`."""
    cfg = _small_v4()
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg)
    seen = []
    model.model.layers[1].register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).shape), with_kwargs=True)
    model(input_ids=torch.randint(3, 256, (1, tokens)))
    return cfg, model, seen[0]


def test_the_engines_layer_dims_count_the_streams_a_layer_passes_on():
    cfg, model, shape = small_v4_layer_input()
    layer = model.model.layers[1]
    assert layer_streams(layer) == residual_streams(cfg) == 2  # the planner's reading of the same model
    dims = layer_dims(layer, sum(p.numel() for p in layer.parameters()), cfg.hidden_size)
    assert dims.streams == 2
    assert boundary_bytes(dims, 8, 4) == shape.numel() * 4  # the layer's measured input, FP32
    plain = tiny_model("llama").model.layers[0]
    assert layer_streams(plain) == 1 and layer_dims(plain, 1, 64).streams == 1


def test_build_on_meta_leaves_the_callers_config_as_it_was():
    cfg = transformers.AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    cfg._attn_implementation = "sdpa"
    model = build_on_meta(cfg)
    assert model.config._attn_implementation == "eager" and model.config is not cfg
    assert cfg._attn_implementation == "sdpa"
    # Control: handed the caller's config, transformers switches it (what build_on_meta did before the copy).
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    assert cfg._attn_implementation == "eager"
