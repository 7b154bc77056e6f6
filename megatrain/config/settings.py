"""One DeepSpeed-style config, read once into the typed settings its readers share.

A config reaches MegaTrain through either face (`megatrain.initialize`, `Accelerator(config=...)`), and
its `megatrain` section, a sweep point's `engine` mapping and `megatrain plan`'s flags all name the same
engine settings. Here each of them is read the one way:

- DeepSpeed's rules for the keys both faces read (`FACE_KEYS`), written once: `gradient_clipping`
  (`clipping`), the `bf16` section (`bf16_section`, `bf16_enabled`), "auto" filled from TrainingArguments
  (`from_args`); `face_keys` writes them (megatrain train's config);
- `read_config`: what a config says to a face (bf16, clipping, accumulation; None where it leaves the
  face's argument to decide) and which engine settings the user wrote down;
- `planner_knobs`: the engine settings that change a prediction, for the planner (under EngineConfig's names).

megatrain/config/resolve.py combines these with a face's own arguments into the settings it runs with. Keys are
checked by megatrain/config/validate.py (did-you-mean included), engine values by `EngineConfig`. Torch-free (the
planner imports it); the DeepSpeed parser, which needs torch, is imported on first use.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .schema import AUTO, ENGINE_KEYS, EngineConfig, unknown_setting
from .validate import check_keys, is_bool, is_number

__all__ = ["FACE_KEYS", "ConfigSettings", "bf16_enabled", "bf16_section", "clipping", "face_keys", "from_args", "planner_knobs", "read_config"]

Err = Callable[[str], Exception]
# The top-level DeepSpeed keys a face reads itself (the rest shape the optimizer, scheduler and engine).
FACE_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
             "bf16", "bfloat16")


def from_args(args: Any, attr: str, name: str, hint: str, err: Err = ValueError) -> Any:
    """An "auto" value as Hugging Face's integration fills it: from TrainingArguments.`attr`, else refused."""
    if args is not None and getattr(args, attr, None) is not None:
        return getattr(args, attr)
    raise err(f"{name!r} is \"auto\" but nothing determines it (Hugging Face fills it from "
              f"TrainingArguments.{attr}); {hint}")


def clipping(config: Mapping[str, Any], *, args: Any = None, script: bool = False, err: Err = ValueError) -> float:
    """`gradient_clipping` by DeepSpeed's rules: the global-norm clip per optimizer step, 0 off, absent 1.0.

    "auto": from `args` (TrainingArguments.max_grad_norm) as Hugging Face fills it; with `script` (the
    Accelerate face), 0.0: the script clips where it calls clip_grad_norm_ (Accelerate fills it from there).
    """
    clip = config.get("gradient_clipping", 1.0)  # DeepSpeed's default is 1.0, not off
    if clip == AUTO:
        clip = 0.0 if script else from_args(args, "max_grad_norm", "gradient_clipping",
                                             "write e.g. 1.0 (0 disables clipping)", err)
    if not is_number(clip) or not math.isfinite(clip):
        raise err(f"'gradient_clipping' must be a finite number, got {type(clip).__name__} {clip!r}")
    if clip < 0:
        raise err(f"gradient_clipping={float(clip)} must be >= 0 (0 turns clipping off)")
    return float(clip)


def bf16_section(config: Mapping[str, Any], err: Err = ValueError) -> tuple[str, dict[str, Any]]:
    """(the key the config uses, "bf16" or its old name "bfloat16"; that section, {} when absent)."""
    if "bf16" in config and "bfloat16" in config:
        raise err("give only one of 'bf16' and its old name 'bfloat16'")
    key = "bf16" if "bf16" in config else "bfloat16"
    section = config.get(key)
    if section is None:
        return key, {}
    if not isinstance(section, dict):
        raise err(f"{key!r} must be an object (a JSON dict), got {type(section).__name__} {section!r}")
    return key, section


def bf16_enabled(config: Mapping[str, Any], *, args: Any = None, script: bool = False,
                 err: Err = ValueError) -> bool | None:
    """The bf16 section's `enabled` by DeepSpeed's rules: absent false, "auto" from `args` (bf16 or
    bf16_full_eval, as Hugging Face fills it; false without them). With `script` (the Accelerate face),
    None where it is absent or "auto": the face's mixed_precision argument decides."""
    key, section = bf16_section(config, err)
    on = section.get("enabled", AUTO if script else False)
    if on == AUTO:
        if script:
            return None
        on = bool(getattr(args, "bf16", False) or getattr(args, "bf16_full_eval", False)) if args is not None else False
    if not is_bool(on):
        raise err(f"'{key}.enabled' must be true or false, got {type(on).__name__} {on!r}")
    return on


def face_keys(*, micro_batch: int | str, accumulation: int | str, clip: float | str, bf16: bool | str
              ) -> dict[str, Any]:
    """The face keys of a DeepSpeed config, written out ("auto" where Trainer fills them in)."""
    total = AUTO if AUTO in (micro_batch, accumulation) else micro_batch * accumulation
    return {"train_batch_size": total, "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": accumulation, "gradient_clipping": clip, "bf16": {"enabled": bf16}}


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
    steps = config.get("gradient_accumulation_steps", AUTO)
    return ConfigSettings(bf16=bf16_enabled(config, script=True), gradient_clipping=clipping(config, script=True),
                          gradient_accumulation_steps=None if steps == AUTO else int(steps),
                          engine_keys=frozenset(config.get("megatrain") or {}))


# Engine settings that change a prediction (the planner's point takes them under these names); the rest (trace,
# watchdog_s, pin_memory, ...) do not.
_PLANNER_NAMES = frozenset({
    "num_buffers", "loss_chunk_tokens", "offload_activations", "mlp_tile_tokens", "device_budget_bytes", "host_master",
    "host_grad_dtype", "optimizer_in_backward", "optimizer_overlap", "residency", "speculative_step",
})


def planner_knobs(engine: Mapping[str, Any]) -> dict[str, Any]:
    """The engine settings that change a prediction, as the planner's keyword arguments (EngineConfig's names; the
    link's rate as the profile's link_gbs); an unknown key is refused."""
    eng = dict(engine)
    if "tile_tokens" in eng:  # the planner's old name for the engine's knob
        eng.setdefault("mlp_tile_tokens", eng.pop("tile_tokens"))
    check_keys(eng, ENGINE_KEYS, unknown_setting)
    kw = {k: v for k, v in eng.items() if k in _PLANNER_NAMES}
    if eng.get("link_gbps"):
        kw["link_gbs"] = float(eng["link_gbps"])
    return kw
