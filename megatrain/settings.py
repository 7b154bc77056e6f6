"""One DeepSpeed-style config, read once into the typed settings its readers share.

A config reaches MegaTrain through either face (`megatrain.initialize`, `Accelerator(config=...)`), and
its `megatrain` section, a sweep point's `engine` mapping and `megatrain plan`'s flags all name the same
engine settings. Here each of them is read the one way:

- `read_config`: what a config says to a face (bf16, clipping, accumulation; None where it leaves the
  face's argument to decide) and which engine settings the user wrote down;
- `engine_config_from`: the engine settings, through the DeepSpeed parser that `megatrain.initialize`
  uses, so one config means the same engine on both faces;
- `planner_knobs`: engine settings under the planner's argument names.

Keys are checked by megatrain/validate.py (did-you-mean included), engine values by `EngineConfig`.
Torch-free (the planner imports it); the DeepSpeed parser, which needs torch, is imported on first use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .config import ENGINE_KEYS, EngineConfig, unknown_setting
from .validate import check_keys

__all__ = ["ConfigSettings", "engine_config_from", "planner_knobs", "read_config"]

AUTO = "auto"


@dataclass(frozen=True)
class ConfigSettings:
    """What a face config (a DeepSpeed-style dict, an EngineConfig or None) says to the face that reads it."""

    bf16: bool | None  # the bf16 section's `enabled`; None: "auto" or unsaid (the face's argument decides)
    gradient_clipping: float  # per step, DeepSpeed's meaning (absent: 1.0); 0.0 for "auto" or no DeepSpeed dict
    gradient_accumulation_steps: int | None  # None: "auto" or unsaid
    engine_keys: frozenset[str]  # the engine settings written down (all of them for an EngineConfig)


def read_config(config: Any) -> ConfigSettings:
    """The face settings of `config`. Values are checked where they are used (the face, the DeepSpeed parser)."""
    if isinstance(config, ConfigSettings):
        return config
    if isinstance(config, EngineConfig):
        return ConfigSettings(bf16=config.compute_dtype == "bfloat16", gradient_clipping=0.0,
                              gradient_accumulation_steps=None, engine_keys=ENGINE_KEYS)
    if not isinstance(config, dict):
        # No DeepSpeed config: clip only where the script calls clip_grad_norm_.
        return ConfigSettings(bf16=None, gradient_clipping=0.0, gradient_accumulation_steps=None,
                              engine_keys=frozenset())
    section = config.get("bf16", config.get("bfloat16", {})) or {}
    on = section.get("enabled", AUTO)
    clip = config.get("gradient_clipping", 1.0)  # DeepSpeed's default is 1.0, not off
    if clip == AUTO or clip is None:
        clip = 0.0  # Accelerate fills "auto" from the script, i.e. from clip_grad_norm_ calls
    clip = float(clip)
    if clip < 0:
        raise ValueError(f"gradient_clipping={clip} must be >= 0")
    steps = config.get("gradient_accumulation_steps", AUTO)
    return ConfigSettings(bf16=None if on == AUTO else bool(on), gradient_clipping=clip,
                          gradient_accumulation_steps=None if steps == AUTO else int(steps),
                          engine_keys=frozenset(config.get("megatrain") or {}))


def engine_config_from(config: dict[str, Any] | EngineConfig | None) -> EngineConfig:
    """The engine settings a face config describes.

    A dict is read as a DeepSpeed config by the same parser `megatrain.initialize` uses, so one
    config means the same engine on both faces. Batch sizes are the dataloader's business under
    Accelerate, so a config without them is completed with a micro batch of one for the parser's sake.
    """
    if config is None:
        return EngineConfig()
    if isinstance(config, EngineConfig):
        return config
    if not isinstance(config, dict):
        raise TypeError(f"config must be a DeepSpeed-style dict, an EngineConfig or None, not {type(config).__name__}")
    from .deepspeed.config import parse_config

    d = dict(config)
    # "auto" values are the face's to fill (from the dataloader, the arguments, clip_grad_norm_ calls)
    # and none of them shapes the engine, so they are dropped before the strict parser sees them.
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping"):
        if d.get(key) == AUTO:
            del d[key]
    for key in ("bf16", "bfloat16"):
        if isinstance(d.get(key), dict) and d[key].get("enabled") == AUTO:
            d[key] = {k: v for k, v in d[key].items() if k != "enabled"}
    if "train_batch_size" not in d and "train_micro_batch_size_per_gpu" not in d:
        d["train_micro_batch_size_per_gpu"] = 1
    return parse_config(d).engine


# Engine settings that change a prediction, under the planner's argument names; the rest (trace,
# watchdog_s, pin_memory, ...) do not.
_PLANNER_NAMES = {
    "num_buffers": "num_buffers", "loss_chunk_tokens": "loss_chunk_tokens",
    "offload_activations": "offload_activations", "mlp_tile_tokens": "mlp_tile_tokens",
    "device_budget_bytes": "device_budget_bytes", "host_master": "master", "host_grad_dtype": "host_grad_dtype",
    "optimizer_in_backward": "optimizer_in_backward", "optimizer_overlap": "optimizer_overlap",
}


def planner_knobs(engine: Mapping[str, Any]) -> dict[str, Any]:
    """Engine settings (EngineConfig's names) as the planner's keyword arguments; an unknown key is refused."""
    eng = dict(engine)
    if "tile_tokens" in eng:  # the planner's old name for the engine's knob
        eng.setdefault("mlp_tile_tokens", eng.pop("tile_tokens"))
    check_keys(eng, ENGINE_KEYS, unknown_setting)
    kw = {_PLANNER_NAMES[k]: v for k, v in eng.items() if k in _PLANNER_NAMES}
    if eng.get("link_gbps"):
        kw["link_gbs"] = float(eng["link_gbps"])
    return kw
