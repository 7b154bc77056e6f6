"""Where the parity probe keeps its verdicts: one key per model class, structural options, library versions and
the engine's compute dtype and host modes, under `$MEGATRAIN_CACHE/probe`."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import transformers

from ...files import env
from .probe_reference import _Mode
from .probe_shrink import _IGNORED_KEYS, _MORE_SIZES, _SIZES, tiny_config


def cache_key(model_cls: type, config: Any, engine_config: Any | None = None) -> str:
    """What the verdict depends on: class, structural options (sizes excluded), library versions, and the compute
    dtype and host modes the engine trains in."""
    try:
        tiny = tiny_config(config).to_dict()
    except Exception:  # noqa: BLE001 - a config the probe cannot shrink is keyed (and then refused) as it is
        tiny = config.to_dict()
    options = {k: v for k, v in tiny.items() if k not in _IGNORED_KEYS and k not in _SIZES and k not in _MORE_SIZES}
    mode = _Mode.of(engine_config)
    blob = json.dumps([f"{model_cls.__module__}.{model_cls.__qualname__}", options, transformers.__version__,
                       torch.__version__.split("+")[0]] + ([asdict(mode)] if mode.bf16 else []),
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _cache_dir() -> Path:
    return env.cache_dir("probe")
