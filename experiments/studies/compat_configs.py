"""A valid config for every causal-LM model type, for the compatibility study (compat.py).

transformers' default config of a type is not always one its model builds from: a composite config handed to a
text-only causal LM, sizes left None for the checkpoint to give (head_dim, key/value heads, expert counts), a
per-layer list left None or sized for another depth, a rope table missing the layer type its rotary reads. The
study fills those from the family's own config class (`study_config`), so its "crashed" means the engine or plain
PyTorch failed, never that the study could not build a model. What it filled is recorded beside the verdict.

Rules, in order: the causal LM's own config class (a sub-config of a composite one); a None size from the rest of
the config (head_dim = hidden_size / heads, key/value heads = heads, expert counts); the family's values for what
no rule can derive (`FAMILY`, each with the class field it fills); a per-layer type list sized to the layer count.
"""

from __future__ import annotations

import copy
from typing import Any

import transformers

from megatrain.models.lookup import resolve

# What no rule derives: values the family's config class documents or validates (its docstring, its
# validate_architecture), set only where the default leaves them None or unusable.
FAMILY: dict[str, dict[str, Any]] = {
    # Qwen4-Exp's sparse attention indexer: every QSA field or none (validate_architecture); kv heads must be 1,
    # the budget a multiple of the compression ratio, the index head at least the rotary width.
    "qwen4_exp_text": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128, "indexer_budget": 8,
                       "indexer_compress_ratio": 4},
    # ReformerModelWithLMHead asserts is_decoder (its class's own check).
    "reformer": {"is_decoder": True},
    # Gemma 4's assistant (a drafter) validates a text config without per-layer inputs, MoE block or double-wide
    # MLP (its validate_architecture); the default text config has all three.
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                                         "enable_moe_block": False, "use_double_wide_mlp": False}},
    # DBRX's attention clamps q/k/v to +-clip_qkv unconditionally, and its default leaves it None (its released
    # checkpoints: 8).
    "dbrx": {"attn_config.clip_qkv": 8.0},
    # LFM2-MoE leaves layer_types None; its layers and masks are keyed by these two kinds (LFM2's own default
    # interleaves them the same way).
    "lfm2_moe": {"layer_kinds": ["conv", "full_attention"]},
}
FAMILY["qwen4_exp"] = FAMILY["qwen4_exp_text"]
_EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts")


def _own_config(model_cls: type, config: Any, filled: dict) -> Any:
    """The causal LM's own config class: a composite config's sub-config of that class (Qwen3.5's text config)."""
    own = getattr(model_cls, "config_class", None)
    if own is None or isinstance(config, own):
        return config
    for key, value in vars(config).items():
        if isinstance(value, own):
            filled["config"] = key
            return value
    return config


def _sizes(config: Any, filled: dict) -> None:
    present = vars(config)

    def fill(key: str, value: Any) -> None:
        setattr(config, key, value)
        filled[key] = value

    heads = present.get("num_attention_heads")
    if "head_dim" in present and present["head_dim"] is None and heads and present.get("hidden_size"):
        fill("head_dim", present["hidden_size"] // heads)
    if "num_key_value_heads" in present and present["num_key_value_heads"] is None and heads:
        fill("num_key_value_heads", heads)
    if any(k in present for k in _EXPERT_COUNTS) and all(present.get(k) is None for k in _EXPERT_COUNTS if k in present):
        for k in _EXPERT_COUNTS:
            if k in present:
                fill(k, 4)
    if "num_experts_per_tok" in present and present["num_experts_per_tok"] is None and any(
            present.get(k) for k in _EXPERT_COUNTS):
        fill("num_experts_per_tok", 2)
    if "n_shared_experts" in present and present["n_shared_experts"] is None:
        fill("n_shared_experts", 1)


def _rope(config: Any, filled: dict) -> None:
    """Rope parameters where the model reads them: per layer kind when the config keys them so (an empty table
    beside layer_types), and a sub-config's rope_theta from its parent's (DBRX's attention config)."""
    present = vars(config)
    rope, types = present.get("rope_parameters"), present.get("layer_types")
    theta = getattr(type(config), "default_theta", None) or 10000.0
    if rope == {} and isinstance(types, list) and types:
        config.rope_parameters = {kind: {"rope_type": "default", "rope_theta": theta} for kind in dict.fromkeys(types)}
        filled["rope_parameters"] = config.rope_parameters
    if isinstance(rope, dict) and isinstance(rope.get("rope_theta"), float):
        for key, sub in present.items():
            if isinstance(sub, transformers.PretrainedConfig) and not {"rope_theta", "rope_parameters"} & set(vars(sub)):
                sub.rope_theta = rope["rope_theta"]
                filled[f"{key}.rope_theta"] = rope["rope_theta"]


def _layer_types(config: Any, filled: dict, kinds: list[str] | None) -> None:
    """A per-layer type list the model indexes by layer: sized for another depth, it is cycled to the layer count;
    None, it is the family's kinds (`kinds`, from FAMILY) cycled so."""
    present = vars(config)
    n = present.get("num_hidden_layers")
    types = present.get("layer_types", "absent")
    if not isinstance(n, int) or types == "absent" or (isinstance(types, list) and len(types) == n):
        return
    kinds = types if isinstance(types, list) and types else kinds
    if not kinds:
        return
    config.layer_types = [kinds[i % len(kinds)] for i in range(n)]
    filled["layer_types"] = config.layer_types


def study_config(model_type: str) -> tuple[type, Any, dict[str, Any]]:
    """(causal-LM class, a config it builds from, what was filled) for `model_type`."""
    family = dict(FAMILY.get(model_type, {}))
    kinds = family.pop("layer_kinds", None)
    filled: dict[str, Any] = {}
    try:
        model_cls, config = resolve(model_type)
    except Exception:  # noqa: BLE001 - a default the config class itself rejects: built with the family's values
        if not family:
            raise
        config = transformers.AutoConfig.for_model(model_type, **family)
        model_cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
        filled.update(family)
        family = {}
    config = copy.deepcopy(config)
    config = _own_config(model_cls, config, filled)
    _sizes(config, filled)
    _rope(config, filled)
    for key, value in family.items():
        owner, _, name = key.rpartition(".")  # "attn_config.clip_qkv": a sub-config's field
        setattr(getattr(config, owner) if owner else config, name, value)
        filled[key] = value
    _layer_types(config, filled, kinds)
    return model_cls, config, filled
