"""Model shapes the planner accepts: a preset name, a ModelPreset, a transformers config (object or dict),
or a local model directory / config.json (read with transformers' AutoConfig, nothing downloaded). A dense
model given as a config is measured off the model transformers builds for it on the meta device
(meta_shapes.py), whatever its model_type; mixtures of experts are read by moe_shapes.py."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from megatrain.models.presets import ALIASES, PRESETS, ModelPreset, get_preset

from .moe_shapes import MOE_MODEL_TYPES, moe_shapes, text_config

# model_type -> the preset family whose transformers config rebuilds the same model (preset_configs.py); any
# other dense model_type keeps its own name (planned from its measured shape, not rebuilt from a preset)
_FAMILY = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


def resolve_model(model: str | os.PathLike | ModelPreset | Any) -> ModelPreset:
    """A ModelPreset from a preset name/alias, a local model directory or config.json, a ModelPreset, or an
    HF config object or its dict."""
    if isinstance(model, ModelPreset):
        return model
    if isinstance(model, os.PathLike) or (isinstance(model, str) and is_model_path(model)):
        return model_from_path(model)
    if isinstance(model, str):
        return get_preset(model)
    if hasattr(model, "to_dict"):
        return _from_hf_dict(model.to_dict(), model)
    if isinstance(model, dict):
        d = dict(model)
    else:
        raise TypeError(f"model must be a preset name, a model directory, a ModelPreset or a transformers config, "
                        f"not {type(model).__name__}")
    return _from_hf_dict(d)


def is_model_path(name: str) -> bool:
    """Whether a --model value means a local directory or config.json rather than a preset: it looks like a
    path (a separator, a .json name) or names something on disk that is not a preset."""
    if os.sep in name or "/" in name or name.endswith(".json") or name.startswith(("~", ".")):
        return True
    return name not in PRESETS and name not in ALIASES and os.path.exists(name)


def model_from_path(path: str | os.PathLike) -> ModelPreset:
    """The shape of a local model: a directory holding config.json (as save_pretrained writes it) or the
    config.json itself, read with AutoConfig from that path only."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"model path {str(path)!r} does not exist (a model directory with config.json, a "
                         "config.json, or a preset name)")
    if p.is_dir() and not (p / "config.json").is_file():
        raise ValueError(f"model directory {str(p)!r} holds no config.json")
    import transformers  # only for a model on disk: planning a preset stays torch-free

    try:
        cfg = transformers.AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers' field validation errors are no ValueError: one line
        raise ValueError(f"cannot read a transformers config from {str(p)!r}: {one_line(e)}; fix that field in "
                         "config.json") from None
    name = (p if p.is_dir() else p.parent).resolve().name
    return _from_hf_dict({**cfg.to_dict(), "_name_or_path": name}, cfg)


def _from_hf_dict(d: dict[str, Any], cfg: Any = None) -> ModelPreset:
    d = text_config(d)
    if cfg is not None and d is not cfg and hasattr(cfg, "get_text_config"):
        cfg = _buildable_text_config(cfg)
    mtype = d.get("model_type", "")
    if mtype not in MOE_MODEL_TYPES:
        # dense, or a mixture without a formula reader (OLMoE, DeepSeek-V4, GLM-5, ...): counted as built
        return _measured(d, cfg, mtype)
    try:
        hidden, heads, layers = int(d["hidden_size"]), int(d["num_attention_heads"]), int(d["num_hidden_layers"])
        return ModelPreset(
            name=str(d.get("_name_or_path") or f"hf-{mtype}"),
            family=mtype,
            num_layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=int(d.get("num_key_value_heads") or heads),
            vocab=int(d["vocab_size"]),
            max_positions=_trainable_positions(d, cfg),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            rope_theta=_rope_theta(d),
            **moe_shapes(d, mtype, hidden, heads, layers),
        )
    except KeyError as e:
        raise ValueError(f"transformers config of model_type {mtype!r} lacks {e.args[0]!r}; cannot plan for it") from None


def _buildable_text_config(cfg: Any) -> Any:
    """The language model's config of a composite one where transformers builds a causal LM from it (Qwen3.5's
    text_config), else the whole config (Mllama's causal LM takes the composite config)."""
    import transformers

    text = cfg.get_text_config()
    mapping = transformers.AutoModelForCausalLM._model_mapping
    return text if text is cfg or type(text) in mapping or type(cfg) not in mapping else cfg


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and its message's lines joined (transformers' errors span several)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:400]}" if text else type(e).__name__


def _rope_theta(d: dict[str, Any]) -> float:
    return float(d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def _measured(d: dict[str, Any], cfg: Any, mtype: str) -> ModelPreset:
    """A model's shape measured off the model transformers builds for it on the meta device."""
    from .meta_shapes import measured_preset

    if cfg is None:  # a dict or config object given directly: the config class of its model_type
        import transformers

        try:
            cfg = transformers.AutoConfig.for_model(mtype, **{k: v for k, v in d.items() if k != "model_type"})
        except ValueError as e:
            raise ValueError(f"transformers knows no config for model_type {mtype!r} ({e})") from None
    family = _FAMILY.get(mtype, mtype)
    if family == "llama" and d.get("attention_bias"):
        family = "qwen2"  # biased q/k/v: the zero3 baseline's layer model counts them as Qwen2's
    name = str(d.get("_name_or_path") or f"hf-{mtype}")
    try:
        return measured_preset(cfg, name, family, _trainable_positions(d, cfg), _rope_theta(d))
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever transformers raises reading a config: one line, not a traceback
        raise ValueError(f"cannot read the layer shape of model_type {mtype!r} off its model ({one_line(e)}); "
                         "check that field in config.json, or describe the model as a ModelPreset") from None


def _trainable_positions(d: dict[str, Any], cfg: Any = None) -> int:
    """The longest sequence the engine trains this model at: max_position_embeddings, or what RoPE scaling
    extends it to, by the engine's own rule (engine/layer/batch.py checks every batch against it)."""
    max_pos = d.get("max_position_embeddings")
    if not max_pos:
        return 4096
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    per_type = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    scaled = any(r.get("rope_type", r.get("type", "default")) not in (None, "default") for r in per_type)
    if not scaled:
        return int(max_pos)
    from ..models.positions import max_trainable_positions

    return int(max_trainable_positions(cfg if cfg is not None else SimpleNamespace(**d)) or max_pos)
