"""Transformers configs for the presets' shapes (no download; a model built from one has random weights),
one builder per family, dense and mixture of experts."""

from __future__ import annotations

from typing import Any


def _dense_kw(p: Any) -> dict[str, Any]:
    return dict(num_hidden_layers=p.num_layers, hidden_size=p.hidden, intermediate_size=p.intermediate,
                num_attention_heads=p.heads, num_key_value_heads=p.kv_heads, vocab_size=p.vocab,
                max_position_embeddings=p.max_positions, tie_word_embeddings=p.tie_embeddings,
                rope_theta=p.rope_theta)


def _moe_kw(p: Any) -> dict[str, Any]:
    """The family-specific keys of a MoE preset's config."""
    e, a, fam = p.moe, p.attn, p.family
    kw: dict[str, Any] = {"num_experts_per_tok": e.top_k}
    if a.head_dim:
        kw["head_dim"] = a.head_dim
    if fam == "mixtral":
        kw.update(num_local_experts=e.experts, intermediate_size=e.expert_intermediate)
    elif fam == "gpt_oss":
        kw.update(num_local_experts=e.experts, intermediate_size=e.expert_intermediate,
                  attention_bias=a.qkv_bias, sliding_window=a.sliding_window or 128,
                  layer_types=_gpt_oss_layer_types(p))
    elif fam == "qwen3_moe":
        kw.update(num_experts=e.experts, moe_intermediate_size=e.expert_intermediate,
                  mlp_only_layers=list(range(e.dense_layers)))
    elif fam == "deepseek_v3":
        m = a.mla
        shared = e.shared_intermediate // e.expert_intermediate if e.shared_intermediate else 0
        kw.update(n_routed_experts=e.experts, moe_intermediate_size=e.expert_intermediate, n_shared_experts=shared,
                  first_k_dense_replace=e.dense_layers, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                  qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                  v_head_dim=m.v_head_dim, n_group=1, topk_group=1)
        kw.pop("head_dim", None)
    elif fam == "qwen3_5_moe":
        la = a.linear
        kw.update(num_experts=e.experts, moe_intermediate_size=e.expert_intermediate,
                  shared_expert_intermediate_size=e.shared_intermediate,
                  linear_num_key_heads=la.key_heads, linear_num_value_heads=la.value_heads,
                  linear_key_head_dim=la.key_head_dim, linear_value_head_dim=la.value_head_dim,
                  linear_conv_kernel_dim=la.conv_kernel, layer_types=_qwen3_5_layer_types(p))
    return kw


def _gpt_oss_layer_types(p: Any) -> list[str]:
    slide = p.attn.sliding_layers
    return ["sliding_attention" if i % 2 == 0 and i // 2 < slide else "full_attention" for i in range(p.num_layers)]


def _qwen3_5_layer_types(p: Any) -> list[str]:
    """Linear attention in `attn.linear.layers` of the layers, full attention in every 4th (Qwen3.5's 3:1)."""
    full = p.num_layers - p.attn.linear.layers
    every = p.num_layers // full if full else p.num_layers + 1
    return ["full_attention" if (i + 1) % every == 0 and (i + 1) // every <= full else "linear_attention"
            for i in range(p.num_layers)]


_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig", "mixtral": "MixtralConfig",
            "qwen3_moe": "Qwen3MoeConfig", "gpt_oss": "GptOssConfig", "deepseek_v3": "DeepseekV3Config",
            "qwen3_5_moe": "Qwen3_5MoeTextConfig"}


def hf_config(p: Any, **overrides: Any) -> Any:
    """A transformers config of preset `p`'s family and shape; `overrides` are config keys."""
    import transformers

    if p.family not in _CLASSES:
        raise ValueError(f"preset {p.name!r}: no transformers config for family {p.family!r} "
                         f"(known: {', '.join(_CLASSES)})")
    cls = getattr(transformers, _CLASSES[p.family])
    kw = _dense_kw(p)
    if p.moe is not None:
        kw.update(_moe_kw(p))
    if p.family in ("gpt_oss", "qwen3_5_moe", "deepseek_v3", "qwen3_moe", "mixtral"):
        kw.pop("rope_theta")  # transformers 5 reads it from rope_parameters
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": p.rope_theta}
        if p.family == "qwen3_5_moe":
            kw["rope_parameters"]["partial_rotary_factor"] = 0.25
    kw["attn_implementation"] = "eager" if p.family == "gpt_oss" else "sdpa"  # GPT-OSS's sinks: no sdpa path
    kw.update(overrides)
    attn = kw.pop("attn_implementation")
    cfg = cls(**kw)
    cfg._attn_implementation = attn
    return cfg
