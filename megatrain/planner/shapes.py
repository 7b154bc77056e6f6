"""Model shapes the planner accepts: a preset name, a ModelPreset, or a transformers config."""

from __future__ import annotations

from typing import Any

from megatrain.models.presets import ModelPreset, get_preset

# Architectures whose decoder layer has the shape ModelPreset.layer_params() counts
# (attention + SwiGLU MLP + two RMSNorms; q/k/v biases for the qwen2 family).
_FAMILY = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


def resolve_model(model: str | ModelPreset | Any) -> ModelPreset:
    """A ModelPreset from a preset name/alias, a ModelPreset, an HF config object or its dict."""
    if isinstance(model, ModelPreset):
        return model
    if isinstance(model, str):
        return get_preset(model)
    if hasattr(model, "to_dict"):
        d = model.to_dict()
    elif isinstance(model, dict):
        d = dict(model)
    else:
        raise TypeError(f"model must be a preset name, a ModelPreset or a transformers config, not {type(model).__name__}")
    return _from_hf_dict(d)


def _from_hf_dict(d: dict[str, Any]) -> ModelPreset:
    mtype = d.get("model_type", "")
    family = _FAMILY.get(mtype)
    if family is None:
        raise ValueError(
            f"the planner knows the layer shape of model_type {sorted(_FAMILY)}, not {mtype!r}; "
            "describe the model as a ModelPreset instead")
    if d.get("attention_bias"):
        family = "qwen2"  # same bias count (q, k, v)
    try:
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        preset = ModelPreset(
            name=str(d.get("_name_or_path") or f"hf-{mtype}"),
            family=family,
            num_layers=int(d["num_hidden_layers"]),
            hidden=hidden,
            intermediate=int(d["intermediate_size"]),
            heads=heads,
            kv_heads=int(d.get("num_key_value_heads") or heads),
            vocab=int(d["vocab_size"]),
            max_positions=int(d.get("max_position_embeddings") or 4096),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            rope_theta=float(d.get("rope_theta") or 10000.0),
        )
    except KeyError as e:
        raise ValueError(f"transformers config lacks {e.args[0]!r}; cannot plan for it") from None
    head_dim = d.get("head_dim")
    if head_dim is not None and int(head_dim) != preset.head_dim:
        # ModelPreset derives head_dim = hidden // heads; a config that sets another one has other
        # projection sizes, and planning it with the wrong count would be silently off.
        raise ValueError(
            f"config sets head_dim={head_dim} but hidden/heads = {preset.head_dim}; the planner's "
            "ModelPreset cannot express that shape yet")
    return preset
