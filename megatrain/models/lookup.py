"""A model a user names (a model type such as "gemma", a checkpoint directory or a config.json) as its causal-LM
class and config, and the causal LMs the installed transformers ships. Needs transformers only."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def resolve(name_or_path: str | os.PathLike) -> tuple[type, Any]:
    """(causal-LM class, config) for a model type such as "gemma", a checkpoint directory or a config.json."""
    path = Path(name_or_path)
    if path.exists():
        config = transformers.AutoConfig.from_pretrained(path.parent if path.is_file() else path)
    elif str(name_or_path) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        config = transformers.AutoConfig.for_model(str(name_or_path))
    else:
        close = [t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if str(name_or_path).lower() in t][:5]
        raise ValueError(f"{str(name_or_path)!r} is neither a local checkpoint/config nor a causal-LM model type of "
                         f"transformers {transformers.__version__}" + (f" (close: {', '.join(close)})" if close else "")
                         + "; pass a model type such as 'llama' or a directory holding config.json")
    mapping = transformers.AutoModelForCausalLM._model_mapping
    if type(config) not in mapping:
        raise ValueError(f"{type(config).__name__} has no causal-LM class in transformers {transformers.__version__}")
    return mapping[type(config)], config


def causal_lm_types() -> list[str]:
    """Every model type the installed transformers maps to a causal-LM class, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
