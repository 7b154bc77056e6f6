"""The probe's verdict for a model a user names: a model type, a local checkpoint or a config file.

`megatrain check-model` and the compatibility study (experiments/studies/compat.py) both ask this; the probe itself
is model/probe.py, and what a name means is models/lookup.py.
"""

from __future__ import annotations

import os
from typing import Any

from ..config.schema import EngineConfig
from ..models.lookup import resolve
from .engine import Engine
from .model.probe import Verdict, run_probe


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
