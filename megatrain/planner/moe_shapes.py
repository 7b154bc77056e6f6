"""Mixture-of-experts transformers configs read into a ModelPreset (its MoEShape and AttnShape): Mixtral,
Qwen2-MoE, Qwen3-MoE, GPT-OSS, DeepSeek-V3 (latent attention), Qwen3-Next and Qwen3.5-MoE (gated DeltaNet
layers). tests/unit/test_planner_moe.py checks each reader's count against the model class built on the meta device.
"""

from __future__ import annotations

from typing import Any

from megatrain.models.presets import AttnShape, LinearAttnShape, MLAShape, MoEShape

# model_type -> how its config names the routed experts' count and width
_EXPERTS = {"mixtral": ("num_local_experts", "intermediate_size"), "gpt_oss": ("num_local_experts", "intermediate_size"),
            "qwen2_moe": ("num_experts", "moe_intermediate_size"), "qwen3_moe": ("num_experts", "moe_intermediate_size"),
            "qwen3_next": ("num_experts", "moe_intermediate_size"),
            "qwen3_5_moe_text": ("num_experts", "moe_intermediate_size"),
            "deepseek_v3": ("n_routed_experts", "moe_intermediate_size")}
MOE_MODEL_TYPES = tuple(_EXPERTS)


def text_config(d: dict[str, Any]) -> dict[str, Any]:
    """The language model's keys of a composite config (Qwen3.5-MoE's text_config), else `d`."""
    sub = d.get("text_config")
    return {**sub, "_name_or_path": d.get("_name_or_path")} if isinstance(sub, dict) else d


def _dense_layers(d: dict[str, Any], n_layers: int) -> int:
    """Layers with a dense MLP: DeepSeek's first_k_dense_replace, or the Qwen-MoE rule (mlp_only_layers, and
    a sparse layer only every decoder_sparse_step)."""
    if "first_k_dense_replace" in d:
        return int(d.get("first_k_dense_replace") or 0)
    only, step = set(d.get("mlp_only_layers") or ()), int(d.get("decoder_sparse_step") or 1)
    return sum(1 for i in range(n_layers) if i in only or (i + 1) % step != 0)


def moe_shapes(d: dict[str, Any], mtype: str, hidden: int, heads: int, n_layers: int) -> dict[str, Any]:
    """ModelPreset keyword arguments (moe, attn, intermediate) for a mixture-of-experts config `d`."""
    if mtype not in _EXPERTS:
        raise ValueError(f"model_type {mtype!r} is a mixture-of-experts model the planner has no shape reader "
                         f"for; it reads {', '.join(sorted(_EXPERTS))} (or describe it as a ModelPreset with a MoEShape)")
    n_key, width_key = _EXPERTS[mtype]
    # transformers 5 stores some families' expert count as num_local_experts whatever the config.json said
    n_key = next((k for k in (n_key, "num_local_experts", "num_experts", "n_routed_experts") if d.get(k)), n_key)
    experts, width = int(d[n_key]), int(d[width_key])
    shared = int(d.get("shared_expert_intermediate_size") or 0)
    if mtype == "deepseek_v3":
        shared = int(d.get("n_shared_experts") or 0) * width
    gpt_oss = mtype == "gpt_oss"
    moe = MoEShape(experts=experts, top_k=int(d["num_experts_per_tok"]), expert_intermediate=width,
                   shared_intermediate=shared, shared_gate=bool(shared) and mtype != "deepseek_v3",
                   expert_bias=gpt_oss, router_bias=gpt_oss, dense_layers=_dense_layers(d, n_layers))
    head_dim = int(d.get("head_dim") or hidden // heads)
    bias = bool(d.get("attention_bias"))
    types = list(d.get("layer_types") or ())
    sliding = sum(t == "sliding_attention" for t in types)
    window = int(d.get("sliding_window") or 0)
    if mtype == "mixtral" and window:
        sliding = n_layers  # every Mixtral layer uses the window when one is set
    attn = AttnShape(head_dim=head_dim if head_dim != hidden // heads else 0,
                     qkv_bias=bias or (mtype == "qwen2_moe" and bool(d.get("qkv_bias", True))),
                     o_bias=bias and mtype != "qwen2_moe", qk_norm=mtype in ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text"),
                     sinks=gpt_oss, output_gate=mtype in ("qwen3_next", "qwen3_5_moe_text"),
                     sliding_window=window if sliding else 0, sliding_layers=sliding if window else 0)
    if mtype == "deepseek_v3":
        if bias:
            raise ValueError("deepseek_v3 config sets attention_bias=true; the planner counts latent attention "
                             "without biases")
        q_lora = d.get("q_lora_rank")
        attn = AttnShape(mla=MLAShape(int(q_lora) if q_lora else None, int(d["kv_lora_rank"]),
                                      int(d["qk_nope_head_dim"]), int(d["qk_rope_head_dim"]), int(d["v_head_dim"])))
    if mtype in ("qwen3_next", "qwen3_5_moe_text"):
        if not types:  # Qwen3-Next without layer_types: full attention every full_attention_interval layers
            every = int(d.get("full_attention_interval") or 4)
            types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
        linear = sum(t == "linear_attention" for t in types)
        attn = AttnShape(head_dim=attn.head_dim, qkv_bias=bias, o_bias=bias, qk_norm=True, output_gate=True,
                         linear=LinearAttnShape(linear, int(d["linear_num_key_heads"]), int(d["linear_num_value_heads"]),
                                                int(d["linear_key_head_dim"]), int(d["linear_value_head_dim"]),
                                                int(d.get("linear_conv_kernel_dim") or 4)) if linear else None)
    # the dense layers' MLP width (configs without dense layers may not carry intermediate_size)
    intermediate = int(d.get("intermediate_size") or width)
    return {"moe": moe, "attn": attn, "intermediate": intermediate}
