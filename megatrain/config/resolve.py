"""Settings resolved once: what a user wrote, through any face, into the settings that face runs with.

A user writes settings in one of four forms: a DeepSpeed-style config (`megatrain.initialize`, Trainer's
`deepspeed=`), Accelerate's arguments with or without such a config (`megatrain.Accelerator`), an
`EngineConfig`, or TrainingArguments (which fill a DeepSpeed config's "auto" values). `resolve` takes them
and returns `Settings`: the face's own (mixed precision, clipping, accumulation, the parsed DeepSpeed config)
and the engine's settings with the face's arguments folded in (a frozen `ResolvedConfig`, whose `written` keeps what
the user wrote; its backend does not resolve it again).

Each rule it applies is written once: DeepSpeed's keys in megatrain/config/settings.py, the compute dtype that the
bf16 section, `mixed_precision` and `compute_dtype` name together in `EngineConfig.settle_compute_dtype`,
the device-dependent "auto" in `EngineConfig`.

The second and last step, once per engine build before it builds anything (the device, the optimizer and the
model's host bytes known), is megatrain/config/settle.py's `settle_engine`: one engine's `EnginePlan`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .deepspeed import parse_config
from .schema import AUTO, EngineConfig, EnginePlan, ResolvedConfig
from .settings import FACE_KEYS, ConfigSettings, read_config
from .validate import is_int

__all__ = ["Settings", "cpu_config", "engine_config_from", "precision_is_bf16", "resolve"]

_BATCH_KEYS = FACE_KEYS[:3]

FACES = ("accelerate", "deepspeed")


@dataclass(frozen=True)
class Settings:
    """What a face runs with, every "auto" settled."""

    engine: EngineConfig | None  # a ResolvedConfig, frozen; `engine.written`: as the user wrote it. None: not asked for
    mixed_precision: str  # "no" or "bf16": the compute dtype under Accelerate's name
    gradient_clipping: float  # per optimizer step, DeepSpeed's meaning; 0.0: only where the script clips
    gradient_accumulation_steps: int
    deepspeed: Any = None  # the DeepSpeed face's whole config (config/deepspeed.py's DeepSpeedConfig)


def resolve(config: dict[str, Any] | str | os.PathLike | EngineConfig | None = None, *, face: str = "accelerate",
            args: Any = None, world_size: int = 1, mixed_precision: str | None = None,
            gradient_accumulation_steps: int = 1, cpu: bool = False, engine: bool = True) -> Settings:
    """The settings `face` runs with, from what the user wrote.

    face "deepspeed": `config` is a DeepSpeed config (a dict or a .json path), its "auto" values filled from
    `args` (TrainingArguments) as Hugging Face does, batch sizes split over `world_size` ranks.
    face "accelerate": `config` is a DeepSpeed-style dict, an EngineConfig or None, settled against
    Accelerate's `mixed_precision` (None: not given), `gradient_accumulation_steps` and `cpu`; `engine=False`
    for a backend that reads no EngineConfig (its config is then not parsed as MegaTrain's).
    """
    if face == "deepspeed":
        from .deepspeed import parse_config

        ds = parse_config(config, args=args, world_size=world_size)
        ec = _resolved(_slabs_for(ds.engine, ds.gradient_accumulation_steps))
        ds = dataclasses.replace(ds, engine=ec)  # the one engine config the face and its backend hold
        return Settings(ec, _mixed_precision(ec.compute_dtype), ds.gradient_clipping, ds.gradient_accumulation_steps, ds)
    if face != "accelerate":
        raise ValueError(f"face={face!r} is not one of {FACES}")
    if config is not None and not isinstance(config, (dict, EngineConfig)):
        raise TypeError(f"config must be a DeepSpeed-style dict, an EngineConfig or None, not {type(config).__name__}")
    said = read_config(config)  # as the user gave it: cpu=True adds no DeepSpeed keys (None clips nothing)
    if cpu:
        config = cpu_config(config)
        if isinstance(config, EngineConfig):
            said = read_config(config)  # its compute dtype, resolved for the CPU
    label = mixed_precision
    if mixed_precision is not None:
        label = _mixed_precision(EngineConfig.settle_compute_dtype(bf16=said.bf16, mixed_precision=mixed_precision))
    ec = engine_config_from(config, label) if engine else None
    if label is None:  # no argument: the compute dtype the config says
        label = _mixed_precision(ec.compute_dtype if ec is not None else
                                 EngineConfig.settle_compute_dtype(bf16=said.bf16, unsaid="float32"))
    steps = _accumulation(gradient_accumulation_steps, said)
    return Settings(_resolved(_slabs_for(ec, steps)), label, said.gradient_clipping, steps)


def _resolved(ec: EngineConfig | None) -> EngineConfig | None:
    """`ec` marked as through a face's resolve (its backend takes it as it is), the written settings kept."""
    if ec is None or isinstance(ec, (ResolvedConfig, EnginePlan)):
        return ec
    return ec.as_type(ResolvedConfig)


def _slabs_for(ec: EngineConfig | None, steps: int) -> EngineConfig | None:
    """Host mode "auto" may choose bf16 gradient slabs only where one micro-batch makes a step (bf16 addition
    rounds a sum): with accumulation the face settles the slabs at FP32 before the engine chooses the rest."""
    if ec is None or steps == 1 or ec.host_grad_dtype != "auto":
        return ec
    return dataclasses.replace(ec, host_grad_dtype="float32")


def cpu_config(config: dict[str, Any] | EngineConfig | None) -> dict[str, Any] | EngineConfig:
    """`config` with the engine's device set to the CPU (`Accelerator(cpu=True)`); a contradiction is refused.
    An EngineConfig's "auto" settings are resolved afresh for the CPU."""
    if isinstance(config, EngineConfig):
        if config.device not in (None, "cpu"):
            raise ValueError(f"cpu=True contradicts the EngineConfig's device={config.device!r}; drop one of them")
        return config.rewrite(device="cpu")
    config = dict(config or {})
    section = dict(config.get("megatrain") or {})
    if section.get("device") not in (None, "cpu"):
        raise ValueError(f"cpu=True contradicts the config's megatrain.device={section['device']!r}; drop one of them")
    config["megatrain"] = {**section, "device": "cpu"}
    return config


def _mixed_precision(compute_dtype: str) -> str:
    return "bf16" if compute_dtype == "bfloat16" else "no"


def _accumulation(steps: int, said: ConfigSettings) -> int:
    if not is_int(steps) or steps < 1:
        raise ValueError(f"gradient_accumulation_steps={steps!r} must be an int >= 1")
    from_config = said.gradient_accumulation_steps
    if from_config is not None:
        if steps == 1:
            return from_config  # the argument was left at its default
        if from_config != steps:
            raise ValueError(f"gradient_accumulation_steps={steps} contradicts the config's {from_config}; set one of them")
    return steps


def engine_config_from(config: dict[str, Any] | EngineConfig | None, mixed_precision: str | None = None
                       ) -> EngineConfig:
    """The engine settings a face config describes, with the Accelerate face's `mixed_precision` (None: none).

    A dict is read as a DeepSpeed config by the same parser `megatrain.initialize` uses, so one
    config means the same engine on both faces. Batch sizes are the dataloader's business under
    Accelerate, so a config without them is completed with a micro batch of one for the parser's sake.
    """
    if config is None or isinstance(config, EngineConfig):
        ec = config or EngineConfig()
        if mixed_precision is None:
            return ec
        # An EngineConfig's compute dtype counts as a config's bf16 section (as read_config reads it).
        dtype = EngineConfig.settle_compute_dtype(written=ec.compute_dtype if config else None,
                                                  bf16=ec.compute_dtype == "bfloat16" if config else None,
                                                  mixed_precision=mixed_precision)
        return ec if dtype == ec.compute_dtype else ec.rewrite(compute_dtype=dtype)
    if not isinstance(config, dict):
        raise TypeError(f"config must be a DeepSpeed-style dict, an EngineConfig or None, not {type(config).__name__}")
    d = dict(config)
    # "auto" batch sizes are the face's to fill (from the dataloader, the arguments) and none of them shapes
    # the engine, so they are dropped before the strict parser sees them; it reads "auto" clipping and bf16
    # as this face does (script=True).
    for key in _BATCH_KEYS:
        if d.get(key) == AUTO:
            del d[key]
    if "train_batch_size" not in d and "train_micro_batch_size_per_gpu" not in d:
        d["train_micro_batch_size_per_gpu"] = 1
    return parse_config(d, mixed_precision=mixed_precision, script=True).engine


def precision_is_bf16(precision: str, on_accelerator: Callable[[], bool]) -> bool:
    """A command's `precision` ("bf16", "fp32" or "auto": bf16 on an accelerator) as the bf16 switch it means;
    `on_accelerator` is asked only for "auto"."""
    return precision == "bf16" or (precision == AUTO and on_accelerator())
