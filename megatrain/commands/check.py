"""`megatrain check-model`: run the parity probe for a model type, a local checkpoint or a config file.

The probe itself lives with the engine (engine/model/probe.py); this module resolves what a user names into a model
class and config, and lists the causal LMs the installed transformers ships (for the compatibility table).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..config.schema import EngineConfig
from ..engine import Engine, Verdict, run_probe


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


def check_model(name_or_path: str | os.PathLike, compute_dtype: str = "float32", host_master: str = "fp32",
                overrides: dict[str, Any] | None = None) -> Verdict:
    """The probe's verdict, computed now (never read from the cache), for an engine computing in `compute_dtype`
    with `host_master`; `overrides` set config values first (e.g. a non-default logit_scale)."""
    model_cls, config = resolve(name_or_path)
    return check_config(model_cls, config, compute_dtype, host_master, overrides)


def check_config(model_cls: type, config: Any, compute_dtype: str = "float32", host_master: str = "fp32",
                 overrides: dict[str, Any] | None = None) -> Verdict:
    """`check_model` for a causal-LM class and a config of it (the compatibility study's filled configs)."""
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    if getattr(config, "is_encoder_decoder", False):
        return Verdict("refused", f"{config.model_type}'s config is an encoder-decoder one; MegaTrain trains "
                       "decoder-only causal LMs", model_cls.__name__)
    return run_probe(model_cls, config, Engine, EngineConfig(device="cpu", compute_dtype=compute_dtype,
                                                             host_master=host_master))


def causal_lm_types() -> list[str]:
    """Every model type the installed transformers maps to a causal-LM class, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
